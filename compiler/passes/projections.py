"""Projections of one activation merged into one product: ``x @ Wq``, ``x @ Wk``, ``x @ Wv``
(each maybe ``+ b``) become ``x @ [Wq | Wk | Wv] (+ [bq | bk | bv])`` and three slices.

Most exporters (BERT, Llama, T5, ViT...) write the attention's projections as separate MatMuls of
one activation with constant weights. On a GPU each is a GEMM of its own, and at the sizes of one
transformer layer (``N`` = the hidden size) few of them fill the multiprocessors: GPT-2, whose
export has one QKV projection, runs one GEMM with three times the columns instead. The cuda
driver runs this pass on each rank's graph (after the plan, so the search and the partitioner
see the separate ops and each rank merges its own shards) before
:class:`~.precision.HalfPrecisionContractions`, which then rounds the merged product's output
once where every slice is read as a rounded operand (BERT's Q, K, V: the GEMM writes half values
for the attention). Each output column is the same sum of products as before (the merged
product's columns are independent), so the values equal the separate products' up to the
summation order a GEMM implementation picks for a shape.

Matched: two or more ``MatMul(x, W_i)`` reading the same non-constant ``x`` as their first
operand, each ``W_i`` a constant 2-D ``[K, N_i]`` of one dtype; when every one of them is read
only by ``Add(., b_i)`` with a constant ``b_i`` of shape ``[N_i]``, the biases are merged too.
Every merged result must go only to head splits (reshapes, transposes, casts); the others of the
activation's products stay apart: Llama's gate and up projections meet in ``SiLU(gate) * up``,
which the up projection's GEMM computes in its epilogue from the gate's output (merged, that
product would need a kernel of its own), and the blocks of Phi and GPT-J run their MLP's first
product on the attention's input (its GELU is that GEMM's epilogue). The 4-bit parts
:class:`SplitProjections` made of one ``MatMulNBits`` are merged back too (their codes, scales and
zero points stacked by rows), on every target.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from ..ir.spill import concatenate
from .base import GraphPass, splice

__all__ = ["MergeProjections", "SplitProjections", "PART"]

log = logging.getLogger(__name__)

#: what reads a merged projection's output: the attention's head split (reshapes, transposes, casts)
_HEAD_SPLIT = frozenset({"Reshape", "Transpose", "Cast", "Slice", "Squeeze", "Unsqueeze", "Flatten", "Split"})


#: what :class:`SplitProjections` appends to a product's name, before the part's number
PART = "#part"


class MergeProjections(GraphPass):
    """Merge the constant-weight MatMuls of one activation (and their constant biases).
    ``parts_only``: only the parts :class:`SplitProjections` made of one product (the cpu
    target's: it computes the other models' projections apart, as before). ``cache``: the compile's
    :class:`~shardflow.compiler.passes.prepack.PackCache`: ranks holding the parts whole share one merged
    weight (made once; their packs then too)."""

    def __init__(self, parts_only: bool = False, cache=None):
        self.parts_only = parts_only
        self.cache = cache

    def _concatenate(self, arrays: list, axis: int):
        from .prepack import cached

        return cached(self.cache, ("concatenate", axis), tuple(arrays), lambda: concatenate(arrays, axis=axis))

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.elementwise import Binary
        from ..ops.linalg import MatMul
        from ..ops.transform import Slice

        consumers = graph.consumers()
        outputs = {id(t) for t in graph.outputs}
        by_input: dict[tuple[int, str], list[Operator]] = {}
        for op in graph.nodes:
            if (op.op_type == "MatMul" and len(op.inputs) == 2 and not op.inputs[0].is_constant
                    and op.inputs[1].is_constant and op.inputs[1].ndim == 2 and op.inputs[0].ndim >= 2
                    and op.inputs[0] is not op.inputs[1]):
                by_input.setdefault((id(op.inputs[0]), "MatMul"), []).append(op)
            elif (op.op_type == "MatMulNBits" and PART in op.name and not op.inputs[0].is_constant
                  and all(t.is_constant for t in op.inputs[1:])):  # (4-bit parts: merged back on every target)
                by_input.setdefault((id(op.inputs[0]), "MatMulNBits"), []).append(op)
        insert: dict[int, list[Operator]] = {}  # id(first member) -> the merged ops
        replace: dict[int, Tensor] = {}  # old output -> its slice
        for (_, kind), members in by_input.items():
            nbits = kind == "MatMulNBits"
            if self.parts_only or nbits:  # (the parts of one product: one name before the part's number)
                members = [m for m in members if PART in m.name]
                members = [m for m in members if m.name.rsplit(PART, 1)[0] == members[0].name.rsplit(PART, 1)[0]]
                if len(members) < 2:
                    continue
            if nbits:
                members = [m for m in members if m.attrs == members[0].attrs
                           and len(m.inputs) == len(members[0].inputs)]
            else:
                w_dtype = members[0].inputs[1].dtype
                members = [m for m in members if m.inputs[1].dtype == w_dtype and m.outputs[0].dtype == w_dtype]
            if len(members) < 2:
                continue
            # those whose result (past its bias) goes to head splits alone: not Llama's gate and up,
            # which meet in SiLU(gate) * up, nor the MLP's first product that Phi and GPT-J compute
            # from the attention's input (parallel blocks)
            kept = []
            for m in members:
                b = self._bias(m, consumers, outputs)
                if self._to_heads(b[0].outputs[0] if b else m.outputs[0], consumers):
                    kept.append((m, b))
            # (merged with their biases, or all without one: the larger set)
            biased, bare = [k for k in kept if k[1] is not None], [k for k in kept if k[1] is None]
            with_bias = len(biased) >= len(bare)
            kept = biased if with_bias else bare
            if len(kept) < 2:
                continue
            members, biases = [m for m, _ in kept], [b for _, b in kept]
            ends = [b[0].outputs[0] if with_bias else m.outputs[0] for m, b in kept]
            x = members[0].inputs[0]
            if nbits:  # (the columns of a 4-bit weight: the rows of its codes, scales and zero points)
                consts = [const_tensor(self._concatenate([np.asarray(m.inputs[j].value) for m in members], 0),
                                       f"{members[0].name}.merged_{j}") for j in range(1, len(members[0].inputs))]
                mm = type(members[0])([x, *consts], name=f"{members[0].name}.merged", **members[0].attrs)
            else:
                w = const_tensor(self._concatenate([np.asarray(m.inputs[1].value) for m in members], 1),
                                 f"{members[0].name}.merged_w")
                mm = MatMul([x, w], name=f"{members[0].name}.merged")
            new_ops: list[Operator] = [mm]
            y = mm.outputs[0]
            if with_bias:
                b = const_tensor(self._concatenate([np.asarray(a.inputs[k].value).reshape(-1) for a, k in biases], 0),
                                 f"{members[0].name}.merged_b")
                add = Binary([y, b], name=f"{members[0].name}.merged_bias", fn="add")
                new_ops.append(add)
                y = add.outputs[0]
            start = 0
            for m, old in zip(members, ends):  # (the same leading dims: x's, and the bias Add keeps them)
                width = m.outputs[0].shape[-1]
                sl = Slice([y], name=f"{old.name}.slice", starts=(0,) * (y.ndim - 1) + (start,),
                           steps=(1,) * y.ndim, sizes=y.shape[:-1] + (width,))
                new_ops.append(sl)
                replace[id(old)] = sl.outputs[0]
                start += width
            insert[id(members[0])] = new_ops  # after the first member: before any reader of the others
        if insert:
            log.info("projections: %d groups of products of one activation merged", len(insert))
        return splice(graph, insert, replace)

    @staticmethod
    def _to_heads(t: Tensor, consumers) -> bool:
        """Whether ``t`` is read, and by head splits alone."""
        return bool(consumers.get(id(t))) and all(c.op_type in _HEAD_SPLIT for c in consumers[id(t)])

    @staticmethod
    def _bias(mm: Operator, consumers, outputs) -> tuple[Operator, int] | None:
        """``(add, k)`` when ``mm``'s output is read only by ``Add`` with a constant ``[N]`` bias
        at input ``k`` (and is not a graph output)."""
        out = mm.outputs[0]
        rs = consumers.get(id(out), [])
        if len(rs) != 1 or id(out) in outputs or rs[0].op_type != "Binary" or rs[0].attrs.get("fn") != "add":
            return None
        add = rs[0]
        if len(add.inputs) != 2 or sum(1 for t in add.inputs if t is out) != 1:
            return None
        k = 1 if add.inputs[0] is out else 0
        b = add.inputs[k]
        if not b.is_constant or b.dtype != out.dtype or b.size != out.shape[-1] or b.ndim > 1 and \
                b.shape != (1,) * (b.ndim - 1) + (out.shape[-1],) or add.outputs[0].shape != out.shape:
            return None
        return add, k


class SplitProjections(GraphPass):
    """A product of one activation by a constant weight whose result is only ever read in parts
    (a fused QKV projection: GPT-2's ``c_attn``, Phi-3's ``qkv_proj``, GPT-BigCode's) becomes one
    product per part, each with its columns of the weight and bias: ``split(x @ W + b)`` ->
    ``x @ W[:, q] + b[q]``, ``x @ W[:, k] + b[k]``, ...

    Run on the whole graph before the plan, when the mesh has more than one device. The sharding
    rules split a tensor's dim into contiguous blocks; GPT-2's QKV output is ``[Q | K | V]``, so
    its blocks over 4 ranks cut across Q, K and V, and the heads each rank needs are in other
    ranks' blocks (an all-to-all per part, and the keys gathered whole, in every layer of
    Megatron's plan). Apart, each part is split by heads like separate Q, K and V projections
    (Megatron's column-parallel QKV). Each rank's parts are merged back into one product by
    :class:`MergeProjections` after the plan.

    Matched: ``MatMul(x, W)`` or ``Gemm(x, W[, c])`` (no transposed ``x``, ``alpha = beta = 1``,
    ``c`` a bias of the columns) with ``W`` a constant ``[K, N]`` (``[N, K]`` when transposed), an
    optional ``Add`` of a constant ``[N]`` bias, reshapes and transposes that keep the rows apart
    from the columns (each dim made of rows' dims or of columns' dims) and each in their order (a
    transpose may interleave the rows' dims with the columns', not reorder either), and at the end
    of these views only ``Slice`` ops that each take a range of one of the column dims, or
    ``AffineGather`` ops that each take one index of one and keep the other dims as they are
    (dropping that one, a ``select``, or keeping it of extent 1), the column dims after it whole,
    disjoint, two or more: GPT-2's ``[R, 3E]`` sliced, ``torch.nn.MultiheadAttention``'s viewed as
    ``[L, B, 3, E]``, moved to ``[3, L, B, E]`` and selected, Falcon's (dynamo export) viewed as
    ``[B, S, H + 2, d]``, its queries sliced, its key and value gathered past a transpose. Each
    part's product is laid out as its reader's output (a reshape to its rows' and columns' dims, a
    transpose where they interleave). Head-major layouts (GPT-NeoX's ``[heads, 3, d]``, BLOOM's)
    are already split by heads and do not match. A 4-bit ``MatMulNBits`` (onnxruntime-genai's
    packed QKV, read by ``GroupQueryAttention``) is split likewise: its columns are the rows of its
    codes, scales and zero points.
    """

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.elementwise import Binary
        from ..ops.linalg import MatMul

        consumers = graph.consumers()
        outputs = {id(t) for t in graph.outputs}
        insert: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        for op in graph.nodes:
            found = self._match(op, consumers, outputs)
            if found is None:
                continue
            w, bias, slices = found
            x = op.inputs[0]
            new_ops: list[Operator] = []
            for k, (sl, lo, hi, kinds) in enumerate(slices):
                name = f"{op.name}{PART}{k}"
                if w is None:  # (MatMulNBits: its columns are the rows of its codes, scales, zero points)
                    rows = [const_tensor(np.ascontiguousarray(np.asarray(t.value)[lo:hi]), f"{name}.{j}")
                            for j, t in enumerate(op.inputs[1:], 1)]
                    mm = type(op)([x, *rows], name=name, **op.attrs)
                else:
                    mm = MatMul([x, const_tensor(np.ascontiguousarray(w[:, lo:hi]), f"{name}.w")], name=name)
                new_ops.append(mm)
                y = mm.outputs[0]
                if bias is not None:
                    add = Binary([y, const_tensor(np.ascontiguousarray(bias[lo:hi]), f"{name}.b")],
                                 name=f"{name}.bias", fn="add")
                    new_ops.append(add)
                    y = add.outputs[0]
                for step in _laid_out(y, sl.outputs[0].shape, kinds, f"{name}.reshape"):
                    new_ops.append(step)
                    y = step.outputs[0]
                replace[id(sl.outputs[0])] = y
            insert[id(op)] = new_ops
        if insert:
            log.info("projections: %d products read in parts split into their parts", len(insert))
        return splice(graph, insert, replace)

    @staticmethod
    def _match(op: Operator, consumers, outputs):
        """``(W [K, N], bias [N] or None, [(reader, first column, end column, kinds)])`` of a product
        read in column parts (``kinds``: of the reader's output dims, :func:`_moved_kinds`), else None."""
        if op.op_type == "MatMulNBits":  # (its weight's columns: the rows of every constant input)
            if op.inputs[0].is_constant or op.inputs[0].ndim < 2 or any(
                    not t.is_constant or len(consumers.get(id(t), [])) != 1 for t in op.inputs[1:]):
                return None
            w = None
        elif op.op_type not in ("MatMul", "Gemm") or len(op.inputs) < 2 or op.inputs[0].is_constant \
                or not op.inputs[1].is_constant or op.inputs[1].ndim != 2 or op.inputs[0].ndim < 2 \
                or len(consumers.get(id(op.inputs[1]), [])) != 1:  # (a weight read elsewhere too: kept whole)
            return None
        else:
            w = np.asarray(op.inputs[1].value)
        bias = None
        if op.op_type == "Gemm":
            a = op.attrs
            if a.get("trans_a", False) or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
                return None
            w = w.T if a.get("trans_b", False) else w
            if len(op.inputs) > 2:
                c = op.inputs[2]
                if not c.is_constant or c.size != w.shape[1] or c.shape[-1] != w.shape[1]:
                    return None
                bias = np.asarray(c.value).reshape(-1)
        elif op.op_type == "MatMul" and len(op.inputs) != 2:
            return None
        y = op.outputs[0]
        t = y
        added = MergeProjections._bias(op, consumers, outputs) if bias is None else None
        if added is not None:  # (a MatMul's bias, added by an op of its own)
            add, k = added
            bias = np.asarray(add.inputs[k].value).reshape(-1)
            t = add.outputs[0]
        # the kind of each dim of t: "r" (of y's rows), "c" (of its columns) or "1" (extent 1)
        kinds = [_ONE if e == 1 else _ROW for e in y.shape[:-1]] + [_ONE if y.shape[-1] == 1 else _COL]
        parts, todo = [], [(t, kinds)]
        while todo:  # past reshapes and transposes that keep the rows apart from the columns, to the parts
            t, kinds = todo.pop()
            readers = consumers.get(id(t), [])
            if id(t) in outputs or not readers:
                return None
            for r in readers:
                if r.op_type in ("Reshape", "Transpose"):
                    moved = _moved_kinds(r, t.shape, kinds)
                    if moved is None:
                        return None
                    todo.append((r.outputs[0], moved))
                    continue
                d = _part_dim(r, t.shape)
                if d is None or kinds[d] != _COL:
                    return None
                cols = [e for e, k in zip(t.shape, kinds) if k == _COL]
                c = [i for i in range(t.ndim) if kinds[i] == _COL].index(d)
                inner = int(np.prod(cols[c + 1:], dtype=np.int64))
                if int(np.prod(cols[:c], dtype=np.int64)) != 1:  # (a range of a dim inside the columns)
                    return None
                start, size = _part_range(r, d)
                out = r.outputs[0].shape
                kept = [k if e > 1 else _ONE for k, e in zip([k for i, k in enumerate(kinds) if i != d
                                                              or len(out) == t.ndim], out)]
                parts.append((r, start * inner, (start + size) * inner, kept))
        if len(parts) < 2:
            return None
        spans = sorted((lo, hi) for _, lo, hi, _ in parts)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])) or any(hi <= lo for lo, hi in spans):
            return None
        return w, bias, parts


_ROW, _COL, _ONE = "r", "c", "1"


def _moved_kinds(op: Operator, shape: tuple[int, ...], kinds: list[str]) -> list[str] | None:
    """The kinds (``"r"``: of the product's rows, ``"c"``: of its columns, ``"1"``: extent 1) of
    the dims of the output of ``op`` (a reshape or a transpose of a tensor of ``shape`` whose dims
    are of ``kinds``), or None when it mixes rows with columns or reorders the rows or the columns
    among themselves (a part is then not one block of its product's columns in order)."""
    if op.op_type == "Transpose":
        moved = [kinds[p] for p in op.attrs["perm"]]
        order = [p for p in op.attrs["perm"] if kinds[p] != _ONE]
        for kind in (_ROW, _COL):
            dims = [p for p in order if kinds[p] == kind]
            if dims != sorted(dims):
                return None
        return moved
    out = op.outputs[0].shape
    src = [(e, k) for e, k in zip(shape, kinds) if k != _ONE]
    # suffix products: a reshape keeps the kinds apart when every change of kind in its input
    # falls where one of its output dims ends (the flat index's digits of each kind stay together)
    suffix_in = [math.prod(e for e, _ in src[i:]) for i in range(len(src) + 1)]
    suffix_out = {math.prod(out[j:]) for j in range(len(out) + 1)}
    if any(src[i - 1][1] != src[i][1] and suffix_in[i] not in suffix_out for i in range(1, len(src))):
        return None
    result = []
    for j, e in enumerate(out):
        if e == 1:
            result.append(_ONE)
            continue
        top = math.prod(out[j:])  # (the input dim that holds this output dim's highest digit)
        result.append(next(k for i, (_, k) in enumerate(src) if suffix_in[i + 1] < top <= suffix_in[i]))
    return result


def _part_dim(op: Operator, shape: tuple[int, ...]) -> int | None:
    """The dim of a tensor of ``shape`` of which ``op`` takes a range (a ``Slice`` of one dim, steps
    1) or one index (an ``AffineGather`` that keeps the other dims as they are and drops that one,
    ``torch.nn.MultiheadAttention``'s ``select`` of its packed Q, K and V, or keeps it of extent 1,
    the dynamo export's gather of Falcon's key), else None."""
    a = op.attrs
    if op.op_type == "Slice":
        cut = [d for d in range(len(shape)) if a["starts"][d] != 0 or a["sizes"][d] != shape[d]]
        return cut[0] if len(cut) == 1 and all(st == 1 for st in a["steps"]) else None
    out = tuple(a.get("shape", ()))
    if op.op_type != "AffineGather" or len(a["coefs"]) != len(shape) or len(out) not in (len(shape) - 1, len(shape)):
        return None
    fixed = [d for d, c in enumerate(a["coefs"]) if not any(k for k, e in zip(c, out) if e > 1)]
    fixed = [d for d in fixed if shape[d] > 1 or len(fixed) == 1]
    if len(fixed) != 1:
        return None
    d = fixed[0]
    dims = [i for i in range(len(shape)) if i != d or len(out) == len(shape)]  # (the output's dims' sources)
    ok = all(tuple(a["coefs"][i][:len(out)]) == tuple(int(j == n) for j in range(len(out))) and a["offsets"][i] == 0
             for n, i in enumerate(dims) if i != d)
    return d if ok and out == tuple(1 if i == d else shape[i] for i in dims) else None


def _part_range(op: Operator, d: int) -> tuple[int, int]:
    """``(start, size)`` along dim ``d`` of what :func:`_part_dim`'s ``op`` takes."""
    if op.op_type == "Slice":
        return op.attrs["starts"][d], op.attrs["sizes"][d]
    return op.attrs["offsets"][d], 1


def _laid_out(y: Tensor, shape: tuple[int, ...], kinds: list[str], name: str) -> list[Operator]:
    """The ops that give a part's product ``y`` (``[*rows, columns]``) the layout of the reader it
    replaces (``shape``, its dims of ``kinds``): a reshape to its rows' and columns' dims in order,
    a transpose to their places, a reshape for its dims of extent 1 (each only where needed)."""
    from ..ops.transform import Reshape, Transpose

    dims = [d for d, k in enumerate(kinds) if k != _ONE]
    order = [d for d in dims if kinds[d] == _ROW] + [d for d in dims if kinds[d] == _COL]
    ops: list[Operator] = []
    if order != dims:  # (rows and columns interleaved: grouped in order, then transposed to their places)
        grouped = tuple(shape[d] for d in order)
        if y.shape != grouped:
            ops.append(Reshape([y], name=name, shape=grouped))
            y = ops[-1].outputs[0]
        ops.append(Transpose([y], name=f"{name}.t", perm=tuple(order.index(d) for d in dims)))
        y = ops[-1].outputs[0]
    if y.shape != tuple(shape):
        ops.append(Reshape([y], name=f"{name}.1" if ops else name, shape=tuple(shape)))
    return ops
