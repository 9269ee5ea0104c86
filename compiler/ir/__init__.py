"""Flow-graph IR and compute definitions."""
from .evaluate import evaluate_compute, evaluate_task
from .expr import (Expr, Var, Const, BinOp, UnaryOp, Cast, IfThenElse, TensorElement, Reduce, affine_form,
                   as_expr, cast, eq, if_then_else, infer_dtype, logical_and, logical_not, logical_or, maximum,
                   minimum, ne, walk)
from .graph import FlowGraph, Operator, Tensor, const_tensor, topological_sort
from .task import ExternCompute, GridCompute, Task, TensorInput, compute, extern, reduce, tensor_input

__all__ = [
    "Expr", "Var", "Const", "BinOp", "UnaryOp", "Cast", "IfThenElse", "TensorElement", "Reduce", "affine_form",
    "as_expr", "cast", "eq", "ne", "if_then_else", "infer_dtype", "logical_and", "logical_or", "logical_not",
    "maximum", "minimum", "walk", "FlowGraph", "Operator", "Tensor", "const_tensor", "topological_sort",
    "ExternCompute", "GridCompute", "Task", "TensorInput", "compute", "extern", "reduce", "tensor_input",
    "evaluate_task", "evaluate_compute",
]
