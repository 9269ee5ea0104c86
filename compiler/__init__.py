"""Shardflow compiler: ONNX import, flow-graph IR, passes, automatic parallelization."""
from __future__ import annotations

import os
from typing import Mapping, Sequence

from shardflow.runtime import __version__

from .errors import (ConfigError, DtypeError, GraphError, MemoryLimitError, ModelFormatError, ShapeError,
                     ShardflowError, UnsupportedOperatorError)
from .ir import FlowGraph, Operator, Tensor
from .driver import CompileResult, compile  # noqa: A004 - shardflow.compiler.compile is the public API
from .variants import VariantsResult, compile_variants

__all__ = ["load_onnx", "compile", "CompileResult", "compile_variants", "VariantsResult", "supported_ops", "FlowGraph",
           "Operator", "Tensor", "ShardflowError", "ModelFormatError",
           "UnsupportedOperatorError", "ShapeError", "DtypeError", "ConfigError", "GraphError",
           "MemoryLimitError", "__version__"]


def load_onnx(model: "str | os.PathLike | bytes | object", input_shapes: Mapping[str, Sequence[int]] | None = None,
              simplify: bool = True, instruments=(), input_values: Mapping[str, object] | None = None,
              int8_qdq: bool = False, routed_experts: bool = False,
              dim_sizes: Mapping[str, int] | None = None) -> FlowGraph:
    """Import an ONNX model into a :class:`FlowGraph`.

    Parameters
    ----------
    model
        A path to an ``.onnx`` file, its bytes, or an ``onnx.ModelProto``.
    input_shapes
        Shapes for graph inputs, by input name; required for every input with a dynamic dim,
        except one whose dynamic dims all have names (``dim_param``) that the inputs given here or in
        ``input_values`` size, or that ``dim_sizes`` sizes: dims of one name are one size
        (``attention_mask``'s ``[batch, sequence]`` from ``input_ids``').
    simplify
        Run constant folding, no-op removal, CSE and dead-code elimination (default ``True``).
    instruments
        Callables ``(pass_name, graph)`` run after each pass (e.g. ``passes.DumpGraph(dir)``).
    input_values
        Values for graph inputs that are fixed for the compiled program, by input name (arrays of
        the declared type and a shape the model allows). Each becomes a constant and leaves the
        graph's inputs, so that shapes and parameters computed from it (a ``Reshape``'s shape, a
        ``Resize``'s sizes, reduction axes, a ``TopK``'s ``k``) are known at compile time.
    int8_qdq
        Rewrite each MatMul of two ``DequantizeLinear``'d int8/uint8 values (QDQ models) into the
        integer product it stands for, ``MatMulInteger`` then the product of the scales
        (``frontend/qdq.py``): the same values with the sum exact. ``compile`` does it for the cpu
        target (``optimization_config["int8_qdq"]``).
    routed_experts
        Compute every mixture of experts (onnxruntime's ``MoE``) on each token's chosen experts only
        (``ExpertMatMul``), whatever the token count; without it, only while the chosen experts are
        at most twice as many as all of them (decoding), the dense form otherwise. ``compile`` sets
        it for the cpu target, whose grouped template is ahead of the dense form at every measured
        size (``rfcs/0006``).
    dim_sizes
        Sizes of the inputs' named dynamic dims (``dim_param``), by name, e.g. ``{"batch_size": 1,
        "sequence_length": 128}``: every input whose dynamic dims all have names given here (or
        sized by the inputs in ``input_shapes`` / ``input_values``) takes them. An input given in
        ``input_shapes`` or ``input_values`` must agree with them.

    Returns
    -------
    FlowGraph
        The graph, with static shapes everywhere.

    Raises
    ------
    ModelFormatError
        The file is not a valid ONNX model.
    UnsupportedOperatorError
        Some operators or attributes are not supported (all are listed).
    ShapeError
        A dynamic dim has no size (every such input is named), ``input_shapes`` or ``input_values`` names
        a non-input, ``dim_sizes`` names a dim no input has or contradicts a given input, or a value's
        shape is not one the model allows.
    DtypeError
        A value in ``input_values`` does not have (or fit) the input's declared element type.
    """
    from .frontend import import_onnx
    from .passes import simplify as run_passes

    graph = import_onnx(model, input_shapes, input_values, int8_qdq=int8_qdq, routed_experts=routed_experts,
                        dim_sizes=dim_sizes)
    if simplify:
        graph = run_passes(graph, instruments)
    else:
        graph.validate()
    return graph


def supported_ops() -> dict[str, list[tuple[int, int | None]]]:
    """Every ONNX op type the importer handles, with its accepted opset ranges ``(since, until)``."""
    from .frontend import registry

    return registry.supported_ops()
