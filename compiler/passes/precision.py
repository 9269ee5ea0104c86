"""Lower-precision contractions: ``optimization_config["precision"]`` ``"float16"``/``"bfloat16"``.

:class:`HalfPrecisionContractions` rounds the operands of every float32 contraction (MatMul,
Gemm, Conv, ConvTranspose, Einsum, ExpertMatMul) to float16 or bfloat16 and leaves everything else in
float32:

* weights (constant operands) are converted once, at compile time, and stored in the half type
  (half the bytes); the contraction reads them through a ``Cast`` to float32;
* activations go through ``Cast(Cast(x, half), float32)``; when ``x`` is a reshape (a view, no
  kernel) read by the contraction alone, or a chain of slices, reshapes and transposes read
  only by rounded operands of batched products (the attention's Q, K, V), the rounding moves
  before those data-movement ops (they commute exactly), so that the producer's kernel writes the
  half values and the contraction reads them from memory;
* biases (Gemm's ``C``, Conv's ``B``) and the output stay float32; products are exact in float32
  and are accumulated in float32;
* tables that a ``Gather`` looks rows up in (a float32 constant ``[V, D]``: token and position
  embeddings) are stored in the half type too, the rows read back as float32 by a ``Cast`` after
  the gather (fused into it): the embeddings' bytes are halved, as a half model's are, and their
  values rounded as a weight's are. An output layer tied to the table (GPT-2's, exported as the
  table's transposed copy) and stored ``[N, K]`` for cuda (below) then holds the table's half
  bytes, which the program writer stores once (GPT-2 small's float16 cuda weights 402 -> 248 MB);
  one stored ``[K, N]`` (aligned rows) is read by the gather instead (:class:`TablesFromTiedWeights`);
* an ONNX ``Attention`` (opset 23+) reads its Q, K and V rounded, as the two batched products of
  an exported attention do: it becomes the mixed-precision form of the op (half Q, K, V, float32
  scores, softmax and output, the probabilities rounded to the half type before they weigh V;
  :class:`~shardflow.compiler.ops.linalg.Attention`), which the cuda target computes with its
  fused attention kernel. Masks stay float32 (or bool).

So the graph states exactly what a tensor-core GEMM with half operands and fp32 accumulation
computes; the cuda code generator fuses the casts into the GEMM's operand loads and recognises
half operands (:func:`shardflow.compiler.codegen.cuda._plan_gemm`), and the reference evaluator
and the cpu target compute the same values. Unlike ``torch.autocast`` no activation is stored in
half precision, so the error is only the operand rounding: about ``2**-11`` (float16) or
``2**-8`` (bfloat16) relative per operand; see ``rfcs/0004-precision-and-fusion.md`` for the
tolerances the tests use.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from ..errors import ShardflowError
from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from ..ir.expr import dtype_kind, numpy_type
from ..ir.spill import contiguous
from .base import GraphPass, splice, take_over

__all__ = ["HalfPrecisionContractions", "HALF_OPERANDS", "mixed_attention_attrs", "WidenHalfProducts", "WIDENED_OPS",
           "HalfModelInFloat32",
           "ReduceBfloat16InFloat32", "HalfWeightsKMajor", "Float32WeightsKMajor", "round_tf32",
           "TablesFromTiedWeights"]

log = logging.getLogger(__name__)

#: The operands (by input index) of each contraction that are rounded; the others (biases) stay.
HALF_OPERANDS = {"MatMul": (0, 1), "Gemm": (0, 1), "Conv": (0, 1), "ConvTranspose": (0, 1), "Einsum": None,
                 "ExpertMatMul": (0, 1)}


def mixed_attention_attrs(attrs: dict, half: str) -> dict:
    """The attributes of an ``Attention`` op's mixed-precision form (half Q, K, V; float32 scores,
    softmax and output; probabilities rounded to ``half``): the scale applied after the sum."""
    return {**attrs, "acc_dtype": "float32", "probs_dtype": half,
            "scale": attrs.get("scale", attrs.get("scale_sqrt", 1.0) ** 2)}


def _half_dtype(name: str):
    if name not in ("float16", "bfloat16"):
        raise ShardflowError(f"precision {name!r}: choose 'float16' or 'bfloat16'")
    return numpy_type(name)


class HalfPrecisionContractions(GraphPass):
    """Round the float32 operands of contractions to ``dtype`` (``"float16"`` or ``"bfloat16"``)."""

    def __init__(self, dtype: str, k_major_weights: bool = False,
                 k_major_ops: "Callable[[Operator], bool] | None" = None, cast_per_reader: bool = False):
        self.dtype = dtype
        self.np_dtype = _half_dtype(dtype)
        #: store a MatMul weight ``[K, N]`` whose rows are not 16-byte aligned (``N`` not a multiple
        #: of 8, e.g. GPT-2's 50257-word output projection) transposed, as ``[N, K]`` read through a
        #: Transpose: the cuda GEMM then copies it 16 bytes at a time (K-major) instead of falling
        #: back to element-wise loads
        self.k_major_weights = k_major_weights
        #: the MatMul / Gemm (without ``trans_b``) ops whose ``[K, N]`` weight is stored ``[N, K]``
        #: likewise, whatever ``N`` (the ops forced onto a cuda tile that needs a K-major B)
        self.k_major_ops = k_major_ops
        #: each contraction reads a weight through a Cast (and Transpose) of its own, which the
        #: cuda target fuses into its GEMM's loads (one shared by several readers is a kernel of
        #: its own there, writing the float32 values, and the GEMMs reading them take the float32
        #: template); the cpu target runs such casts as kernels: once for all readers when shared
        self.cast_per_reader = cast_per_reader
        #: the number of gather tables stored in the half type (after :meth:`run`)
        self.tables = 0

    def run(self, graph: FlowGraph) -> FlowGraph:
        nodes: list[Operator] = []
        weights: dict[tuple, Tensor] = {}  # (weight[, reader]) -> the float32 values that reader reads
        n_ops = 0
        consumers = graph.consumers()
        outputs = {id(t) for t in graph.outputs}
        producer = {id(t): op for op in graph.nodes for t in op.outputs}
        self._consumers, self._outputs, self._producer = consumers, outputs, producer
        self._halves: dict[int, Tensor] = {}  # tensor -> its rounded (half-typed) twin
        self._half_consts: dict[int, Tensor] = {}  # weight -> its values stored in the half type
        self._half_k_major: dict[int, Tensor] = {}  # weight -> likewise, stored [N, K]
        self._memo: dict[int, bool] = {}
        self.tables = 0
        dropped: set[int] = set()  # movement ops moved behind a rounding (re-created on the half values)
        for op in graph.nodes:
            if _table_lookup(op):
                self._table(op, nodes)
                continue
            if _half_attention(op):
                self._attention(op, nodes, dropped)
                n_ops += 1
                continue
            idx = _rounded(op)
            if not idx:
                nodes.append(op)
                continue
            inputs = list(op.inputs)
            for k in idx:
                t = inputs[k]
                if t.is_constant:
                    key = (id(t), id(op), k) if self.cast_per_reader else (id(t),)
                    if key not in weights:
                        weights[key] = self._weight(op, k, t, nodes)
                    inputs[k] = weights[key]
                else:
                    inputs[k] = self._activation(op, k, t, nodes, dropped)
            op.inputs = inputs  # same shapes and dtypes: the op's compute definition is unchanged
            nodes.append(op)
            n_ops += 1
        graph.nodes = [op for op in nodes if id(op) not in dropped]
        log.info("precision %s: %d contractions read %s operands (%d weights converted, %d gather tables)",
                 self.dtype, n_ops, self.dtype, len(self._half_consts) + len(self._half_k_major), self.tables)
        return graph

    def _table(self, op: Operator, nodes: list[Operator]) -> None:
        """A gather from a float32 table (:func:`_table_lookup`) as the same gather from the table
        stored in the half type, its rows read back as float32 by a ``Cast`` that takes over the
        gather's output (its readers unchanged)."""
        from ..ops.elementwise import CastOp

        half = self._half_const(op.inputs[0])
        gather = op.clone([half, *op.inputs[1:]])
        gather.outputs[0].name = f"{op.outputs[0].name}.{self.dtype}"
        back = CastOp([gather.outputs[0]], name=f"{op.name}.float32", to="float32")
        nodes += [gather, take_over(op, back, "gather from the half table")]
        self.tables += 1

    def _weight(self, op: Operator, k: int, t: Tensor, nodes: list[Operator]) -> Tensor:
        """Weight ``t`` converted once to the half type (stored once, whatever reads it: ALBERT's
        shared layers), read back as float32 by a ``Cast`` made for ``op``."""
        from ..ops.elementwise import CastOp

        if _stored_k_major(op, k, t, self.k_major_weights, self.k_major_ops):
            if id(t) not in self._half_k_major:
                self._half_k_major[id(t)] = const_tensor(
                    contiguous(np.asarray(t.value).T, self.np_dtype), f"{t.name}.{self.dtype}.T")
            half = _k_major(op, k, self._half_k_major[id(t)], nodes)
        else:
            half = self._half_const(t)
        back = CastOp([half], name=f"{op.name}.w{k}.{self.dtype}", to="float32")
        nodes.append(back)
        return back.outputs[0]

    def _half_const(self, t: Tensor) -> Tensor:
        """Weight ``t``'s values stored in the half type (one copy per weight)."""
        if id(t) not in self._half_consts:
            self._half_consts[id(t)] = const_tensor(contiguous(t.value, self.np_dtype), f"{t.name}.{self.dtype}")
        return self._half_consts[id(t)]

    def _attention(self, op: Operator, nodes: list[Operator], dropped: set[int]) -> None:
        """``op`` (a float32 ``Attention``) in its mixed-precision form on half Q, K, V. The new op
        takes over the old one's output tensors, so their readers are unchanged."""
        inputs = list(op.inputs)
        for k in range(3):
            t = inputs[k]
            inputs[k] = self._half_const(t) if t.is_constant else self._half(op, k, t, nodes, dropped)
        mixed = type(op)(inputs, name=op.name, **mixed_attention_attrs(op.attrs, self.dtype))
        nodes.append(take_over(op, mixed, "mixed-precision Attention"))

    def _activation(self, op: Operator, k: int, t: Tensor, nodes: list[Operator], dropped: set[int]) -> Tensor:
        """``Cast(Cast(t, half), float32)``; the rounding moves before the data-movement ops that
        lead to ``t`` where nothing else needs their values in float32 (:meth:`_half`), so that
        the producer's kernel writes the half values and the contraction reads them from memory."""
        from ..ops.elementwise import CastOp

        up = CastOp([self._half(op, k, t, nodes, dropped)], name=f"{op.name}.in{k}.float32", to="float32")
        nodes.append(up)
        return up.outputs[0]

    def _half(self, op: Operator, k: int, t: Tensor, nodes: list[Operator], dropped: set[int]) -> Tensor:
        """``t`` rounded to the half type, as a half-typed tensor (one per tensor, shared). When
        ``t`` comes out of a data-movement op whose input may be rounded instead (rounding and
        moving values commute exactly), that op is re-created on the rounded input: a reshape
        (a view) read by this contraction alone, or any movement (slice, transpose, reshape) whose
        input feeds only rounded operands of batched products (:meth:`_rounded_only`) -- the
        attention's Q, K and V slices of one QKV projection, whose GEMM then writes half values and
        whose batched products read them in place. (Plain 2-D products do not take a transpose
        that way: their operand would no longer be a dense strided read.)"""
        from ..ops.elementwise import CastOp

        if id(t) in self._halves:
            return self._halves[id(t)]
        p = self._producer.get(id(t))
        src = p.inputs[0] if p is not None and p.op_type in _MOVEMENT and p.inputs else None
        sole = len(self._consumers.get(id(t), ())) == 1 and id(t) not in self._outputs
        if src is not None and not src.is_constant and src.dtype == "float32" and len(p.outputs) == 1 and (
                (p.op_type == "Reshape" and sole) or self._rounded_only(src)):
            moved = p.clone([self._half(op, k, src, nodes, dropped), *p.inputs[1:]])
            nodes.append(moved)
            dropped.add(id(p))
            half = moved.outputs[0]
        else:
            down = CastOp([t], name=f"{op.name}.in{k}.{self.dtype}", to=self.dtype)
            nodes.append(down)
            half = down.outputs[0]
        self._halves[id(t)] = half
        return half

    def _rounded_only(self, t: Tensor) -> bool:
        """Whether every reader of ``t`` rounds it: a batched MatMul reading it only as a rounded
        operand, or a single-output movement op whose output is itself rounded only."""
        if id(t) in self._memo:
            return self._memo[id(t)]
        self._memo[id(t)] = False  # (no cycles in a graph; guards the recursion anyway)
        readers = self._consumers.get(id(t), ())
        ok = bool(readers) and id(t) not in self._outputs and t.dtype == "float32"
        for c in readers:
            if not ok:
                break
            if c.op_type in _MOVEMENT:
                ok = (len(c.outputs) == 1 and c.inputs[0] is t and all(x is not t for x in c.inputs[1:])
                      and self._rounded_only(c.outputs[0]))
            else:
                slots = [i for i, x in enumerate(c.inputs) if x is t]
                ok = ((c.op_type == "MatMul" and min(len(x.shape) for x in c.inputs) >= 3
                       and set(slots) <= set(_rounded(c))) or (_half_attention(c) and max(slots) < 3))
        self._memo[id(t)] = ok
        return ok


def _looked_up(op: Operator) -> Tensor | None:
    """The constant table ``[V, D]`` (an embedding) ``op`` looks rows up in, when it is a ``Gather``
    along axis 0 of one; else None."""
    if op.op_type != "Gather" or len(op.inputs) != 2 or op.attrs.get("axis", 0) != 0:
        return None
    t = op.inputs[0]
    return t if t.is_constant and t.ndim == 2 else None


def _table_lookup(op: Operator) -> bool:
    """Whether ``op`` looks rows up in a float32 constant table ``[V, D]`` (:func:`_looked_up`)."""
    t = _looked_up(op)
    return t is not None and t.dtype == "float32" and op.outputs[0].dtype == "float32"


#: ops that only move values (rounding before or after them gives the same values)
_MOVEMENT = frozenset({"Reshape", "Transpose", "Slice", "Squeeze", "Unsqueeze", "Flatten"})


def _stored_k_major(op: Operator, k: int, t: Tensor, unaligned: bool,
                    k_major_ops: "Callable[[Operator], bool] | None") -> bool:
    """Whether weight ``t`` (input ``k`` of ``op``), ``[K, N]``, is stored ``[N, K]``: a plain MatMul's
    (or Gemm's without ``trans_b``) with ``K % 8 == 0``, when its rows are not 16-byte aligned
    (``unaligned`` and ``N % 8``) or ``op`` is one of ``k_major_ops``."""
    plain = op.op_type == "MatMul" or (op.op_type == "Gemm" and not op.attrs.get("trans_b"))
    return k == 1 and t.ndim == 2 and t.shape[0] % 8 == 0 and plain and (
        (unaligned and op.op_type == "MatMul" and t.shape[1] % 8) or (k_major_ops is not None and k_major_ops(op)))


def _k_major(op: Operator, k: int, stored: Tensor, nodes: list[Operator]) -> Tensor:
    """A weight ``[K, N]`` ``stored`` ``[N, K]``, read by input ``k`` of ``op`` through a Transpose
    of its own, appended to ``nodes`` (one per reader: it fuses into the reader's kernel)."""
    from ..ops.transform import Transpose

    flip = Transpose([stored], name=f"{op.name}.w{k}.T", perm=(1, 0))
    nodes.append(flip)
    return flip.outputs[0]


class HalfWeightsKMajor(GraphPass):
    """A float16/bfloat16 model's own MatMul/Gemm weights stored ``[N, K]`` behind a Transpose (the
    cuda target), under :class:`HalfPrecisionContractions`' rule for the weights it rounds: those whose
    rows are not 16-byte aligned (GPT-2's 50257-word head; the wgmma GEMM then copies them 16 bytes at
    a time instead of taking the portable kernel) and those of ``k_major_ops``."""

    def __init__(self, k_major_ops: "Callable[[Operator], bool] | None" = None):
        self.k_major_ops = k_major_ops

    def run(self, graph: FlowGraph) -> FlowGraph:
        nodes: list[Operator] = []
        stored: dict[int, Tensor] = {}  # weight -> its values stored [N, K] (one copy, shared)
        n = 0
        for op in graph.nodes:
            t = op.inputs[1] if len(op.inputs) > 1 else None
            if t is not None and t.is_constant and t.dtype in ("float16", "bfloat16") \
                    and op.outputs[0].dtype == t.dtype and _stored_k_major(op, 1, t, True, self.k_major_ops):
                if id(t) not in stored:
                    stored[id(t)] = const_tensor(contiguous(np.asarray(t.value).T), f"{t.name}.T")
                op.inputs = [op.inputs[0], _k_major(op, 1, stored[id(t)], nodes), *op.inputs[2:]]
                n += 1
            nodes.append(op)
        graph.nodes = nodes
        if n:
            log.info("half model: %d weights stored [N, K]", n)
        return graph


class TablesFromTiedWeights(GraphPass):
    """An embedding table whose transpose holds the bits of another constant the graph reads (the
    output layer tied to it, exported as the table's transposed copy and kept ``[K, N]``) looked
    up through a ``Transpose`` of that constant, one per gather (it fuses into the gather's
    kernel): the table is no longer stored (cuda; Llama-3.2's and Qwen2.5's small models, Gemma:
    the vocabulary's table is a fifth to a third of their weights). A head stored ``[N, K]``
    already holds the table's bytes, which the program writer stores once. After :meth:`run`,
    ``shared`` counts the gathers changed."""

    def __init__(self):
        self.shared = 0

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.transform import Transpose

        by_shape: dict[tuple, dict[int, Tensor]] = {}
        for op in graph.nodes:
            for t in op.inputs:
                if t.is_constant and t.ndim == 2:
                    by_shape.setdefault((t.shape, t.dtype), {})[id(t)] = t
        nodes: list[Operator] = []
        self.shared = 0
        for op in graph.nodes:
            if (table := _looked_up(op)) is not None:
                tied = next((w for w in by_shape.get((table.shape[::-1], table.dtype), {}).values()
                             if w is not table and _transposed_bits(w.value, table.value)), None)
                if tied is not None:
                    flip = Transpose([tied], name=f"{op.name}.table", perm=(1, 0))
                    nodes.append(flip)
                    op.inputs = [flip.outputs[0], *op.inputs[1:]]
                    self.shared += 1
                    log.info("%s looks rows up in %s transposed (a tied output layer's weight): %s not stored",
                             op.name, tied.name, table.name)
            nodes.append(op)
        graph.nodes = nodes
        return graph


class TablesInTiedWeights(GraphPass):
    """The cpu target's :class:`TablesFromTiedWeights`: each ``Gather`` along axis 0 of a table ``[V, D]``
    whose rows are the columns of a constant the graph reads (an output layer tied to the token table,
    exported as the table's transposed copy: stored ``[D, V]`` as it is, or in a product's float32, float16
    or bfloat16 panels, ``passes/prepack.py``) becomes a :class:`~shardflow.compiler.ops.linalg.GatherColumns`
    reading the rows there, so that the table is not stored beside that weight (GPT-2 small: 154 MB of its
    649). The same values. In the panels a row's values are 16 (float32) or 32 (bfloat16) apart, a cache line
    each (GPT-2 small's 128 tokens: 0.045 -> 0.195 ms, in a 100 ms run); in a plain ``[D, V]`` weight a row
    apart. After :meth:`run`, ``shared`` counts the gathers changed. ``cache``: the compile's
    :class:`~shardflow.compiler.passes.prepack.PackCache`, in which the ranks holding the table and the
    panels whole find the comparison made once."""

    def __init__(self, cache=None):
        self.shared = 0
        self.cache = cache

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.linalg import GatherColumns

        # the candidates by (V, D, type): products' panels, and the 2-D constants [D, V] the graph reads
        panels: dict[tuple, dict[int, Tensor]] = {}
        plain: dict[tuple, dict[int, Tensor]] = {}
        for op in graph.nodes:
            if op.op_type in ("PackedMatMul", "PackedMatMulBf16") and op.inputs[1].is_constant:
                bp = op.inputs[1]
                panels.setdefault((int(op.attrs["n"]), int(op.inputs[0].shape[-1]), bp.dtype), {})[id(bp)] = bp
            for t in op.inputs:
                if t.is_constant and t.ndim == 2:
                    plain.setdefault((t.shape[1], t.shape[0], t.dtype), {})[id(t)] = t
        after: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        self.shared = 0
        for op in graph.nodes:
            table = _looked_up(op)
            if table is None:
                continue
            key = (int(table.shape[0]), int(table.shape[1]), table.dtype)
            rows = np.asarray(table.value)
            tied = next((bp for bp in panels.get(key, {}).values() if self._panel_bits(np.asarray(bp.value), rows)),
                        None) or next((w for w in plain.get(key, {}).values()
                                       if w is not table and _transposed_bits(w.value, rows)), None)
            if tied is None:
                continue
            attrs = {k: op.attrs[k] for k in ("start", "extent") if k in op.attrs}
            new = GatherColumns([tied, op.inputs[1]], name=op.name, n=key[0], d=key[1], **attrs)
            after[id(op)] = [new]
            replace[id(op.outputs[0])] = new.outputs[0]
            self.shared += 1
            log.info("%s looks rows up as the columns of %s (a tied output layer's weight): %s not stored",
                     op.name, tied.name, table.name)
        return splice(graph, after, replace)

    def _panel_bits(self, bp: np.ndarray, table: np.ndarray) -> bool:
        from .prepack import cached

        return cached(self.cache, ("panel_bits",), (bp, table), lambda: _panel_bits(bp, table))


def _panel_bits(bp: np.ndarray, table: np.ndarray) -> bool:
    """Whether the panels ``bp`` (:func:`~shardflow.compiler.ops.linalg.unpack_panels`) hold the bits of
    ``table`` (``[V, D]``, same type) as their columns."""
    from ..ops.linalg import unpack_panels

    (v, d), bits = table.shape, np.dtype(f"u{table.dtype.itemsize}")
    first = min(v, 16)  # (the first panel's rows first: most candidates differ there)
    return np.array_equal(unpack_panels(bp[:1], first, d).view(bits), table[:first].view(bits)) and \
        np.array_equal(unpack_panels(bp, v, d).view(bits), table.view(bits))


def _transposed_bits(w: np.ndarray, table: np.ndarray) -> bool:
    """Whether ``w`` (``[D, V]``) transposed holds the bits of ``table`` (``[V, D]``, same type)."""
    w, table = np.asarray(w), np.asarray(table)
    bits = np.dtype(f"u{table.dtype.itemsize}")
    rows = min(4, table.shape[0])  # (a few rows first: most candidates differ there)
    return np.array_equal(w[:, :rows].T.view(bits), table[:rows].view(bits)) and \
        np.array_equal(w.T.view(bits), table.view(bits))


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 explicit mantissa bits; to nearest, ties away from zero:
    ``cvt.rna.tf32.f32``), still stored as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    finite = (u & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    return np.where(finite, (u + np.uint32(0x1000)) & np.uint32(0xFFFFE000), u).view(np.float32)


class Float32WeightsKMajor(GraphPass):
    """Float32 products on Hopper's wgmma template (the cuda target, ``sm_90``): the float32 weights
    of MatMul and Gemm stored ``[N, K]`` (read through a Transpose, as :class:`HalfWeightsKMajor`
    does), the layout the template copies (:mod:`~shardflow.compiler.codegen.cuda_wgmma`): its TF32
    instruction takes K-major operands only.

    ``tf32`` (``precision="tf32"``): every such weight, rounded to TF32 once, here. The instruction
    reads a float32 with its low 13 mantissa bits ignored, so the weight is rounded to nearest, as
    the portable TF32 template rounds it; the activation, which the copy engine loads as it is,
    loses those bits by truncation (relative error under ``2**-10``). Otherwise (``precision=
    "float32"``: 3xTF32, which splits the exact values in the kernel) unrounded; a Gemm's
    ``trans_b`` weight is then already in place. ``only``: the ops whose weights are stored so
    (those forced onto a wgmma tile; None: every one, ``wgmma_fp32``). A weight whose ``K`` breaks
    16-byte alignment (not a multiple of 4) is left as it is (the product then takes the portable
    kernel)."""

    def __init__(self, tf32: bool, only: "Callable[[Operator], bool] | None" = None):
        self.tf32 = tf32
        self.only = only

    def run(self, graph: FlowGraph) -> FlowGraph:
        nodes: list[Operator] = []
        stored: dict[tuple[int, bool], Tensor] = {}  # (weight, transposed in the model) -> its [N, K] copy
        # (each reader of a copy stored transposed reads it through a Transpose of its own, which
        # fuses into its GEMM: one shared would be a kernel writing the [K, N] values)
        for op in graph.nodes:
            t = op.inputs[1] if len(op.inputs) > 1 and op.op_type in ("MatMul", "Gemm") else None
            trans_b = op.op_type == "Gemm" and bool(op.attrs.get("trans_b"))
            if t is not None and t.is_constant and t.ndim == 2 and t.dtype == "float32" \
                    and op.outputs[0].dtype == "float32" and t.shape[1 if trans_b else 0] % 4 == 0 \
                    and (self.tf32 or not trans_b) and (self.only is None or self.only(op)):
                key = (id(t), trans_b)
                if key not in stored:
                    value = np.asarray(t.value, np.float32)
                    if trans_b:  # already [N, K]: the rounded values in its place
                        stored[key] = const_tensor(round_tf32(value), f"{t.name}.tf32")
                    else:
                        stored[key] = const_tensor(contiguous((round_tf32(value) if self.tf32 else value).T),
                                                   f"{t.name}.tf32.T" if self.tf32 else f"{t.name}.T")
                w = stored[key] if trans_b else _k_major(op, 1, stored[key], nodes)
                op.inputs = [op.inputs[0], w, *op.inputs[2:]]
            nodes.append(op)
        graph.nodes = nodes
        if stored:
            log.info("float32 products on wgmma: %d weights stored [N, K]%s", len(stored),
                     " and rounded to TF32" if self.tf32 else "")
        return graph


def _half_attention(op: Operator) -> bool:
    """Whether ``op`` is a float32 ``Attention`` that the pass gives half Q, K and V: one output
    (no ``qk_matmul_output``), no ``softmax_precision``, not already mixed."""
    a = op.attrs
    return (op.op_type == "Attention" and len(op.outputs) == 1 and op.outputs[0].dtype == "float32"
            and all(t.dtype == "float32" for t in op.inputs[:3]) and not a.get("acc_dtype")
            and not a.get("softmax_dtype") and a.get("qk_mode") is None)


def _rounded(op: Operator) -> list[int]:
    """The inputs of ``op`` that the pass rounds (float32 operands of a float32 contraction)."""
    which = HALF_OPERANDS.get(op.op_type, ())
    if which is None:
        which = tuple(range(len(op.inputs)))
    if not op.outputs or op.outputs[0].dtype != "float32":
        return []
    return [k for k in which if k < len(op.inputs) and op.inputs[k].dtype == "float32"]


#: The ops :class:`WidenHalfProducts` computes in float32 on the cpu target (the cpu templates take
#: float32 only; a half product through the generic kernel is 60-70x slower).
WIDENED_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Attention")


class WidenHalfProducts(GraphPass):
    """A float16 or bfloat16 model's contractions (and ``Attention`` ops) computed in float32, for
    the cpu target: each such op whose floating-point inputs and outputs are all of one half type
    reads them widened (exactly; constant operands converted once, here, and stored in float32)
    and its outputs are rounded back to the half type once. These are the values the generic
    kernel computes on half storage (float32 products and sums, one rounding of each output), at
    the speed of the float32 templates (blocked GEMM, direct and packed convolutions, fused
    attention). The widened weights take twice the bytes of the model's."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        def half(op: Operator) -> str | None:
            floats = {t.dtype for t in list(op.inputs) + list(op.outputs) if dtype_kind(t.dtype) == "f"}
            if op.op_type in WIDENED_OPS and len(floats) == 1 and floats <= {"float16", "bfloat16"}:
                return floats.pop()
            return None

        return _in_float32(graph, half, "half model: %d ops computed by the float32 cpu templates")


#: A half constant of more elements than this that an op other than a product reads (a table a
#: ``Gather`` looks rows up in) keeps the op on half values (:class:`HalfModelInFloat32`): the table
#: stays half, and the rows read are widened by a ``Cast`` the gather's kernel fuses.
HALF_TABLE_ELEMENTS = 4096

_CONVS = ("Conv", "ConvTranspose")


def exact_on_values(op: Operator) -> bool:
    """Whether each output element of ``op`` is one of its inputs' elements or a constant (data
    movement, max, min, negation, abs, selects): no floating-point arithmetic that could round."""
    from ..ir.expr import BinOp, Cast, Reduce, UnaryOp, infer_dtype, walk
    from ..ir.task import GridCompute

    for o in op.task.outputs:
        if not isinstance(o, GridCompute):
            return False
        for e in walk(o.value):
            if isinstance(e, (BinOp, UnaryOp, Cast, Reduce)) and dtype_kind(infer_dtype(e) or "int64") == "f":
                if isinstance(e, BinOp) and e.op in ("max", "min"):
                    continue
                if isinstance(e, UnaryOp) and e.op in ("neg", "abs"):
                    continue
                if isinstance(e, Reduce) and e.op in ("max", "min"):
                    continue
                if isinstance(e, Cast) and infer_dtype(e.a) == e.dtype:
                    continue
                return False
    return True


def _attention_scores(graph: FlowGraph, producer: dict[int, Operator], readers: dict, half: str) -> set[int]:
    """The ``half`` tensors of each attention written as ``MatMul -> (scalings, additive biases, selects) ->
    Softmax -> MatMul`` on 4-D heads, each read by the next op alone: the scores (the product and what
    follows it) and the probabilities, which :class:`HalfModelInFloat32` leaves unrounded, so that
    ``FuseAttention`` takes the chain as it takes a float32 model's (its kernel keeps scores and
    probabilities in float32, writing neither)."""
    def single(t: Tensor) -> bool:
        return len(readers.get(id(t), [])) == 1

    def path(t: Tensor, depth: int) -> list[Tensor] | None:
        """``t`` and the tensors back to a 4-D product of ``half`` values, or None."""
        p = producer.get(id(t))
        if p is None or depth == 0 or not single(t) or t.dtype != half or t.ndim != 4:
            return None
        if p.op_type == "MatMul":
            return [t]
        sides = p.inputs[1:2] if p.op_type == "Where" else p.inputs \
            if p.op_type == "Binary" and p.attrs.get("fn") in ("add", "sub", "mul", "div") else []
        for u in sides:
            if tuple(u.shape) == tuple(t.shape) and not u.is_constant:
                rest = path(u, depth - 1)
                if rest is not None:
                    return [t] + rest
        return None

    found: set[int] = set()
    for sm in graph.nodes:
        y = sm.outputs[0] if sm.op_type == "Softmax" and len(sm.outputs) == 1 else None
        if y is None or y.dtype != half or not single(y):
            continue
        (mm,) = readers[id(y)]
        if mm.op_type == "MatMul" and mm.inputs[0] is y and y.ndim == 4:
            back = path(sm.inputs[0], 8)
            if back is not None:
                found.update(id(t) for t in [y] + back)
    return found


class HalfModelInFloat32(GraphPass):
    """A float16 or bfloat16 model computed in float32 on the cpu target, its values rounded to the half type
    where a kernel on half storage would store them.

    Every op whose floating-point inputs and outputs are all of the ``half`` type (float16 or bfloat16) is
    computed on its inputs widened to float32, and each half output is rounded back to ``half``'s
    values by a :class:`~shardflow.compiler.ops.elementwise.RoundHalf`: not inside a chain of
    element-wise ops (the chain is one kernel, rounded where it ends), not on an attention's scores
    and probabilities (:func:`_attention_scores`: its fused kernel writes neither), and not after an
    op that computes nothing (:func:`exact_on_values`: reshapes, slices, max pools) on rounded
    values. The tensors between such ops are float32 holding half values: the values a half kernel
    stores (computed in float32, rounded once where stored), with every float32 template behind them
    (pools, LayerNorm, softmax, the conv epilogues, which take the rounding as one more element-wise op)
    where the generic kernels on half storage ran before. ``Cast``s to and from ``half`` become roundings and nothing; those
    of ``optimization_config["precision"]`` too (whose weights stay float16, read through their
    ``Cast``s). A half model's weights: a conv's become float32 constants (of half values), which
    ``PrepackWeights`` packs or transforms in float32 (twice the model's bytes, as
    :class:`WidenHalfProducts` stored them), or, bfloat16, as the bfloat16 GEMM's rows; a product's stay
    half, read through a ``Cast`` (``PrepackWeights`` stores them as float16 or bfloat16 panels); small
    constants (biases, norms' scales) are widened here. A bfloat16 product or conv then reads a bfloat16
    copy of its operand (``PrepackWeights``: the rounding becomes that cast).

    Collectives, opaque ops (top-k, sort), lookups in a constant table (an embedding's ``Gather``),
    other ops that read a half constant of more than :data:`HALF_TABLE_ELEMENTS` elements (not a
    product: its weights are widened) and ops that only move values some of which no op computed in
    float32 (a KV cache's update, written over the cache's bytes) stay on half values: their inputs
    are rounded float32 values cast to ``half`` (exactly), their outputs widened (the gather's kernel
    fuses that). Activations take twice the bytes of the half model's."""

    def __init__(self, half: str = "float16"):
        _half_dtype(half)
        self.half = half

    def _convertible(self, op: Operator) -> bool:
        from ..parallel.comm_ops import Collective

        half = self.half
        if op.op_type == "Cast" and ((op.inputs[0].dtype == "float32" and op.outputs[0].dtype == half)
                                     or (op.inputs[0].dtype == half and op.outputs[0].dtype in (half, "float32"))):
            return True  # (a rounding; nothing)
        floats = {t.dtype for t in list(op.inputs) + list(op.outputs) if dtype_kind(t.dtype) == "f"}
        if floats != {half} or not any(t.dtype == half for t in op.inputs) or isinstance(op, Collective) \
                or op.task.is_extern:
            return False
        if _looked_up(op) is not None or (op.op_type not in WIDENED_OPS and any(
                t.is_constant and t.dtype == half and t.size > HALF_TABLE_ELEMENTS for t in op.inputs)):
            return False
        if op.op_type == "Cast":
            return True
        # the op on float32 values must give float32 where it gave half, the rest unchanged (not an op whose
        # output type is an attribute); small constants with their values (a scalar exponent shapes a
        # compute definition), a weight's not converted for this
        try:
            wide = op.clone([Tensor(t.name, t.shape, "float32", None, np.asarray(t.value, np.float32)
                                    if t.value is not None and t.size <= HALF_TABLE_ELEMENTS else None)
                             if t.dtype == half else t for t in op.inputs])
        except (ShardflowError, ValueError, TypeError):
            return False
        return [(t.shape, "float32" if t.dtype == half else t.dtype) for t in op.outputs] == \
            [(t.shape, t.dtype) for t in wide.outputs]

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.elementwise import CastOp, RoundHalf

        half = self.half
        producer = {id(t): op for op in graph.nodes for t in op.outputs}
        convertible = {id(op): self._convertible(op) for op in graph.nodes}
        moves = {id(op): convertible[id(op)] and op.op_type != "Cast" and exact_on_values(op) for op in graph.nodes}
        # the half tensors an op computing in float32 reads (widened anyway)
        computed_on = {id(t) for op in graph.nodes if convertible[id(op)] and not moves[id(op)] for t in op.inputs}
        converted: set[int] = set()
        for op in graph.nodes:
            # an op that only moves half values (exact_on_values), some of which neither an op computed in float32
            # nor one computing in float32 reads, stays half: a state's update (a KV cache written in place)
            if convertible[id(op)] and (not moves[id(op)] or all(
                    t.is_constant or id(producer.get(id(t))) in converted or id(t) in computed_on
                    for t in op.inputs if t.dtype == half)):
                converted.add(id(op))
        if not converted:
            return graph
        readers = graph.consumers()
        graph_outputs = {id(t) for t in graph.outputs}
        wide: dict[int, Tensor] = {}  # id(half tensor) -> the float32 tensor of its values
        wide_constants: dict[int, Tensor] = {}  # id(half constant) -> its float32 values, a constant
        first: list[Operator] = []  # the widenings of half graph inputs and constants
        after: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}

        def widened(t: Tensor, reader: Operator | None = None) -> Tensor:
            """The float32 values of ``t`` for ``reader``: a constant widened here when it is small or a
            conv's weight (packed or transformed in float32 by PrepackWeights anyway), else a Cast (of a
            constant: computed when the program is loaded; a product's weight stays float16 in the file,
            and PrepackWeights stores the product's float16 panels)."""
            if t.is_constant and (t.size <= HALF_TABLE_ELEMENTS or (reader is not None and reader.op_type in _CONVS)):
                if id(t) not in wide_constants:
                    wide_constants[id(t)] = const_tensor(contiguous(t.value, np.float32), f"{t.name}.float32")
                return wide_constants[id(t)]
            if id(t) not in wide:
                c = CastOp([t], name=f"{t.name}.float32", to="float32")
                p = producer.get(id(t))
                (after.setdefault(id(p), []) if p is not None else first).append(c)
                wide[id(t)] = c.outputs[0]
            return wide[id(t)]

        unrounded: set[int] = set()  # the float32 outputs left unrounded inside element-wise chains
        scores = _attention_scores(graph, producer, readers, half)

        def within_chain(op: Operator, old: Tensor) -> bool:
            """Whether the half output ``old`` of the element-wise ``op`` is read only by element-wise ops
            computed in float32 (not casts): its value is not rounded (the chain, one kernel, rounds
            where it ends, as the generic kernels on half storage round at stores only)."""
            rs = readers.get(id(old), [])
            return type(op).injective and id(old) not in graph_outputs and bool(rs) and all(
                id(r) in converted and type(r).injective and r.op_type != "Cast" for r in rs)

        def as_half(old: Tensor, value: Tensor, new: list[Operator]) -> None:
            """``value`` (float32) stands for the half ``old``: cast back for its other readers."""
            wide[id(old)] = value
            if id(old) in graph_outputs or any(id(r) not in converted for r in readers.get(id(old), [])):
                new.append(CastOp([value], name=f"{old.name}.{half}", to=half))
                replace[id(old)] = new[-1].outputs[0]

        for op in graph.nodes:
            if id(op) not in converted:
                continue
            new: list[Operator] = []
            x, y = op.inputs[0], op.outputs[0]
            # (an input another rewrite replaced: new ops read the replacement, splice redirects only old ones)
            if op.op_type == "Cast" and x.dtype == "float32":  # a rounding
                new.append(RoundHalf([replace.get(id(x), x)], name=f"{y.name}.round", to=half))
                as_half(y, new[-1].outputs[0], new)
            elif op.op_type == "Cast" and x.dtype == half and y.dtype in (half, "float32"):
                if y.dtype == "float32":  # nothing: its readers read the float32 values
                    if id(x) in wide:
                        replace[id(y)] = wide[id(x)]
                    elif x.is_constant or id(producer.get(id(x))) not in converted:
                        wide[id(x)] = y  # (this cast is the input's widening)
                        continue
                    else:
                        replace[id(y)] = widened(x)
                else:
                    as_half(y, widened(x), new)
            else:
                inputs = [widened(t, op) if t.dtype == half else replace.get(id(t), t) for t in op.inputs]
                clone = op.clone(inputs)
                new.append(clone)
                # exact: the values of its inputs, when those are half values
                exact = moves[id(op)] and not any(id(t) in unrounded for t in inputs)
                for old, out in zip(op.outputs, clone.outputs):
                    if old.dtype != half:
                        replace[id(old)] = out
                        continue
                    if not exact and (within_chain(op, old) or id(old) in scores):
                        unrounded.add(id(out))
                    elif not exact:
                        new.append(RoundHalf([out], name=f"{old.name}.round", to=half))
                        out = new[-1].outputs[0]
                    as_half(old, out, new)
            after[id(op)] = new
        graph.nodes = first + graph.nodes
        log.info("%s model: %d ops computed in float32", half, len(converted))
        return splice(graph, after, replace)


def _in_float32(graph: FlowGraph, half_of: "Callable[[Operator], str | None]", what: str) -> FlowGraph:
    """Each op for which ``half_of`` names a half type computed on its inputs of that type widened to
    float32 (exactly; a constant converted once, here; one widened copy per tensor, shared by its
    readers) and its outputs rounded back to that type once; ``what`` (with the count) is logged."""
    from ..ops.elementwise import CastOp
    from .base import splice

    after: dict[int, list[Operator]] = {}
    replace: dict[int, Tensor] = {}
    widened: dict[int, Tensor] = {}
    for op in graph.nodes:
        half = half_of(op)
        if half is None:
            continue
        new: list[Operator] = []
        inputs = []
        for t in op.inputs:
            t = replace.get(id(t), t)  # (the half output of an op widened before)
            if t.dtype == half and id(t) not in widened:
                if t.is_constant:
                    widened[id(t)] = const_tensor(contiguous(t.value, np.float32), f"{t.name}.float32")
                else:
                    new.append(CastOp([t], name=f"{t.name}.float32", to="float32"))
                    widened[id(t)] = new[-1].outputs[0]
            inputs.append(widened.get(id(t), t) if t.dtype == half else t)
        wide = op.clone(inputs)
        new.append(wide)
        for k, (old, out) in enumerate(zip(op.outputs, wide.outputs)):  # (one name per output: Attention's
            # scores output beside Y)
            new.append(CastOp([out], name=f"{op.name}.{half}" if k == 0 else f"{op.name}.out{k}.{half}", to=half))
            replace[id(old)] = new[-1].outputs[0]
        after[id(op)] = new
    if after:
        log.info(what, len(after))
    return splice(graph, after, replace)


class ReduceBfloat16InFloat32(GraphPass):
    """The all-reduces and reduce-scatters of bfloat16 tensors (a bfloat16 model's partial sums)
    carried in float32: widened before, rounded back after, so that the members' values are summed
    in float32 and rounded once, whatever the backend (the runtime holds bfloat16 as 16-bit
    patterns on a GPU, which no backend may sum as integers). Twice the bytes on those collectives;
    the other collectives move bfloat16 bytes as they are."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        def half(op: Operator) -> str | None:
            reduces = getattr(op, "collective", "") in ("all_reduce", "reduce_scatter")
            return "bfloat16" if reduces and op.inputs[0].dtype == "bfloat16" else None

        return _in_float32(graph, half, "bfloat16: %d reductions over ranks carried in float32")
