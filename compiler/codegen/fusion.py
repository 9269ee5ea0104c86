"""Operator fusion for the code generators: prologue and epilogue fusion of injective ops.

:func:`fuse` groups the ops of one rank's program; each group of two or more ops becomes one
:class:`FusedOp` whose compute definition chains its members' definitions (a grid compute reading
another grid compute, which both code generators inline), so the group is one kernel and its
inner tensors are never written to memory.

Rules (``ops`` in topological order; a tensor is *inner* when every reader is in the same group
and it is not in ``keep``):

* **Epilogue**: an injective op (elementwise, cast, transpose, broadcast...) joins the group that
  produces one of its inputs ``t`` when it is ``t``'s only reader. After a group that reduces
  (a contraction, softmax, a normalization), it must read ``t`` element-wise, exactly at its own
  output index (``y[i] = f(t[i], ...)``), so each reduced value is computed once; or, after a
  group that is not a contraction, read ``t`` as one value per row of its output (``t`` of shape
  ``[..., 1]``, reduced with ``keepdims``: ``y[i, j] = f(x[i, j], t[i, 0])``, as in a decomposed
  RMSNorm or softmax), which the row kernels compute once per row before the row's elements.
* **Prologue**: any op joins the group that produces its input ``t`` (its only reader) when that
  group has no reduction, and, for contractions (:data:`CONTRACTIONS`, which read each operand
  element many times), when it is only data movement and casts (:data:`CHEAP`): a residual add
  before a LayerNorm, or a transpose or cast before a matmul, is computed while loading.
* A group whose output is read several times joins the group holding all its readers, under the
  same conditions (GELU written as ``x * f(x)`` after a GEMM: one kernel).
* An op may join the groups of several inputs (a weight's cast and an activation's cast before a
  matmul), at most one of which reduces; the groups merge. Ops with several outputs,
  extern outputs (sorting) or random values, and the ops in ``barriers`` (the cpu target's
  GEMM/convolution templates) are never fused.
* A group has at most :data:`MAX_GROUP_OPS` members. The test models' groups have a dozen at most;
  an unrolled ``Scan`` or ``Loop`` of element-wise steps would otherwise fuse whole, each stacked
  step output read in a branch that recomputes the chain of states before it (a 206-op group of a
  random control program was 471 KB of C++ and 60 s of g++; capped, 2 s; rfcs/0004).

The fused op computes exactly what its members compute one after another (its ``numpy`` runs
them in order); tests compare both on every op example.
"""
from __future__ import annotations

import logging
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from ..ir.expr import Cast, Const, Expr, Reduce, TensorElement, affine_form, infer_dtype, walk
from ..ir.graph import Operator, Tensor
from ..ir.task import GridCompute, Task, TensorInput
from .lower import substitute, transform

__all__ = ["FusedOp", "fuse", "CHEAP", "CONTRACTIONS", "MAX_GROUP_OPS", "reads_only_at_own_index",
           "aliased_inputs"]

log = logging.getLogger(__name__)

#: Most ops in one fused group (see the module docstring).
MAX_GROUP_OPS = 64
#: Op types cheap enough to be recomputed while an operand is loaded (data movement and casts).
CHEAP = frozenset({"Cast", "Transpose", "Reshape", "Expand", "Identity", "Slice", "AffineGather", "LocalSlice"})
#: Ops that read each operand element many times (a fused prologue is recomputed on every read):
#: only :data:`CHEAP` prologues join them.
CONTRACTIONS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention", "MatMulInteger"})
#: Ops that compute each output element alone from a window of their input (pools, resizes): like
#: contractions, they may store their output in another layout (``fuse``'s ``permuted_epilogue``).
WINDOWED = frozenset({"Pool", "Resize"})


def _remap(value: Expr, mapping: dict[int, object]) -> Expr:
    """``value`` with reads of the tensors in ``mapping`` (by id) redirected, indices kept."""
    def fn(old, new):
        if isinstance(new, TensorElement) and id(new.tensor) in mapping:
            return TensorElement(mapping[id(new.tensor)], new.indices)
        return None
    return transform(value, fn)


class FusedOp(Operator):
    """Several ops computed as one kernel (see :mod:`.fusion`).

    ``members`` are the original ops in order; the last one's output is the fused op's output.
    Inputs are the members' inputs that no member produces, in order of first use.
    """

    op_type = "Fused"

    def __init__(self, members: Sequence[Operator], name: str | None = None):
        members = list(members)
        produced = {id(op.outputs[0]) for op in members}
        inputs: list[Tensor] = []
        for op in members:
            for t in op.inputs:
                if id(t) not in produced and all(t is not u for u in inputs):
                    inputs.append(t)
        self.members = members
        super().__init__(inputs, name=name or members[-1].name,
                         fused=" + ".join(f"{op.op_type}({op.name})" for op in members))
        self.outputs[0].name = members[-1].outputs[0].name  # the tensor the group writes

    def compute(self, *placeholders: TensorInput) -> Task:
        env = chain(self.members, self.inputs, placeholders)
        return Task("Fused", list(placeholders), [env[id(self.members[-1].outputs[0])]], {})

    def numpy(self, *arrays: np.ndarray) -> list[np.ndarray]:
        env = {id(t): a for t, a in zip(self.inputs, arrays)}
        out = None
        for op in self.members:
            out = op.run(*[env[id(t)] for t in op.inputs])[0]
            env[id(op.outputs[0])] = out
        return [out]

    def clone(self, inputs=None) -> "FusedOp":
        raise NotImplementedError("a FusedOp exists only inside code generation; clone its members")


#: Element-wise ops (numpy broadcasting, one output) whose kernels :func:`coalesce_elementwise` may
#: compute over fewer, longer dims.
_ELEMENTWISE = frozenset({"Unary", "Binary", "Cast", "Where", "Clip", "Identity", "Activation"})


#: Bytes from which a concatenation that can be written in place by its inputs' producers takes none of them
#: into its kernel (:func:`in_place_concat`).
IN_PLACE_CONCAT_MIN_BYTES = 1 << 16


def in_place_concat(op: Operator) -> bool:
    """Whether ``op`` is a Concat that the program may make in place (``driver._concatenate_in_place``: every
    dim before its axis 1, each input computed (no graph input, no constant), once, starting 64-byte aligned),
    of :data:`IN_PLACE_CONCAT_MIN_BYTES` or more. The cpu target fuses no producer into it: a producer fused
    into the concatenation's kernel (YOLOv8's last bottleneck's SiLU) kept it a copy of all its parts, where
    alone the producer writes its part in place and the concatenation costs nothing."""
    from shardflow.runtime.artifact import ALIGNMENT

    if op.op_type != "Concat" or len(op.outputs) != 1:
        return False
    y, axis = op.outputs[0], int(op.attrs["axis"])
    if y.nbytes < IN_PLACE_CONCAT_MIN_BYTES or int(np.prod(y.shape[:axis], dtype=np.int64)) != 1:
        return False
    off = 0
    for t in op.inputs:
        if t.is_constant or t.producer is None or off % ALIGNMENT or sum(u is t for u in op.inputs) != 1:
            return False
        off += t.nbytes
    return True


def coalesce_elementwise(op: Operator, max_inner: int = 512) -> Operator:
    """``op`` (an element-wise op, or a FusedOp of them) over its output's trailing dims merged into one,
    as long as every tensor it reads or writes spans both dims fully or neither (size 1: broadcast) and
    the merged dim stays under ``max_inner`` before the merge, else ``op`` itself: the same bytes in the
    same order, one longer innermost loop (a [1, 256, 28, 28] chain's loops of 28 left 12 of every 28
    values to scalar code). Only for lowering its kernel: the copy shares nothing with the graph."""
    members = list(op.members) if isinstance(op, FusedOp) else [op]
    if any(m.op_type not in _ELEMENTWISE or len(m.outputs) != 1 for m in members):
        return op
    out = tuple(op.outputs[0].shape)
    n = len(out)
    tensors = {id(t): t for m in members for t in list(m.inputs) + list(m.outputs)}
    if n < 2 or any(t.ndim > n for t in tensors.values()):
        return op
    padded = {k: (1,) * (n - t.ndim) + tuple(t.shape) for k, t in tensors.items()}
    groups = [[d] for d in range(n)]
    while len(groups) >= 2 and int(np.prod([out[d] for d in groups[-1]])) < max_inner:
        dims = groups[-2] + groups[-1]
        if not all(all(s[d] == out[d] for d in dims) or all(s[d] == 1 for d in dims) for s in padded.values()):
            break
        groups[-2:] = [dims]
    if len(groups) == n:
        return op

    def reshaped(t: Tensor) -> Tensor:
        if t.ndim == 0:
            return t
        shape = tuple(int(np.prod([padded[id(t)][d] for d in g])) for g in groups)
        return Tensor(t.name, shape, t.dtype, None, None if t.value is None else np.asarray(t.value).reshape(shape))
    mapping = {id(t): reshaped(t) for t in op.inputs}
    new_members = []
    for m in members:
        c = m.clone([mapping[id(t)] for t in m.inputs])
        mapping[id(m.outputs[0])] = c.outputs[0]
        new_members.append(c)
    return FusedOp(new_members, name=op.name) if isinstance(op, FusedOp) else new_members[0]


def chain(members: Sequence[Operator], inputs: Sequence[Tensor], placeholders: Sequence[object],
          given: dict[int, object] | None = None) -> dict[int, object]:
    """``id(tensor)`` -> its definition in a group: ``inputs`` are ``placeholders``, each member's
    output a grid compute reading the earlier ones (cast to the member's output dtype, as its
    kernel would store it); the outputs in ``given`` (by id) take the value there instead (a code
    generator's own computation of that member)."""
    env: dict[int, object] = {id(t): p for t, p in zip(inputs, placeholders)}
    for op in members:
        out = op.outputs[0]
        if given and id(out) in given:
            env[id(out)] = given[id(out)]
            continue
        gc = op.task.outputs[0]
        value = _remap(gc.value, {id(ph): env[id(t)] for ph, t in zip(op.task.inputs, op.inputs)})
        if gc.dtype is not None and infer_dtype(value) != gc.dtype:
            value = Cast(value, gc.dtype)
        env[id(out)] = GridCompute(f"{op.name}:0", gc.shape, gc.axes, value, gc.dtype)
    return env


def reads_only_at_own_index(members: Sequence[Operator], x: Tensor, y: Tensor, limit: int = 20000) -> bool:
    """Whether the kernel computing ``y`` by ``members`` (ops in order, the last one writing ``y``;
    the tensors they read that none of them writes are the kernel's inputs) reads ``x`` only at
    ``y``'s own index and reduces nothing: ``y[i] = f(x[i], ...)``. Such a kernel may write ``y``
    over ``x``'s bytes (each ``x[i]`` is read, for ``y[i]`` only, before ``y[i]`` is stored), which
    the program builder does for a state carried from ``y`` to ``x`` (``compile(state=...)``).
    ``False`` for extern or multi-output members, a broadcast or shifted read, or a composed
    expression of more than ``limit`` nodes (no answer is a no)."""
    if not members or members[-1].outputs[0] is not y or not all(_single(op) for op in members):
        return False
    produced = {id(op.outputs[0]) for op in members}
    inputs: list[Tensor] = []
    for op in members:
        inputs += [t for t in op.inputs if id(t) not in produced and all(t is not u for u in inputs)]
    placeholders = [TensorInput(t.name, t.shape, t.dtype) for t in inputs]
    if not any(t is x for t in inputs):
        return False
    target = placeholders[next(k for k, t in enumerate(inputs) if t is x)]
    gc = chain(members, inputs, placeholders)[id(y)]
    nodes = 0

    def inline(value: Expr) -> Expr:
        def fn(old, new):
            nonlocal nodes
            nodes += 1
            if nodes > limit:
                raise OverflowError
            if isinstance(new, TensorElement) and isinstance(new.tensor, GridCompute):
                inner = new.tensor
                return inline(substitute(inner.value, dict(zip(inner.axes, new.indices))))
            return None
        return transform(value, fn)

    try:
        value = inline(gc.value)
    except OverflowError:
        return False
    reads = []
    for n in walk(value):
        if isinstance(n, Reduce):
            return False
        if isinstance(n, TensorElement) and n.tensor is target:
            reads.append(n)
    return all(len(n.indices) == len(gc.axes) and all(i is a for i, a in zip(n.indices, gc.axes)) for n in reads)


def _single(op: Operator) -> bool:
    return (len(op.outputs) == 1 and not op.task.is_extern and not op.data_dependent_values
            and not getattr(type(op), "collective", "") and isinstance(op.task.outputs[0], GridCompute))


def _has_reduce(op: Operator) -> bool:
    return any(isinstance(n, Reduce) for n in walk(op.task.outputs[0].value))


def _read_prefix(op: Operator, k: int) -> int | None:
    """``r`` when op reads its input ``k`` only as ``t[i_0, .., i_{r-1}, c, ..]``: the first ``r``
    axes of its own output index, then constants for ``t``'s trailing dims of extent 1 where the
    output's are not (a per-row value, broadcast along the row); None for any other read."""
    gc = op.task.outputs[0]
    ph = op.task.inputs[k]
    out, shp = tuple(gc.shape), tuple(ph.shape)
    if len(shp) != len(out):
        return None
    r = len(shp)
    while r > 0 and shp[r - 1] == 1 and out[r - 1] != 1:
        r -= 1
    if shp[:r] != out[:r]:
        return None
    reads = [n for n in walk(gc.value) if isinstance(n, TensorElement) and n.tensor is ph]
    ok = bool(reads) and all(len(n.indices) == len(out) and all(i is v for i, v in zip(n.indices[:r], gc.axes))
                             and all(isinstance(i, Const) for i in n.indices[r:]) for n in reads)
    return r if ok else None


def _reads_elementwise(op: Operator, k: int) -> bool:
    """Op reads its input ``k`` only at its own output index (same shape, no broadcast)."""
    return _read_prefix(op, k) == len(op.task.outputs[0].shape)


def _reads_row_statistic(op: Operator, k: int) -> bool:
    """Op reads its input ``k``, one value per row (a statistic reduced with ``keepdims``, like
    RMSNorm's ``1 / sqrt(mean(x^2) + eps)``), broadcast along the row."""
    r = _read_prefix(op, k)
    return r is not None and r < len(op.task.outputs[0].shape)


def fuse(ops: Sequence[Operator], *, keep: Collection[str] = (),
         barriers: Callable[[Operator], bool] = lambda op: False,
         no_prologue: Callable[[Operator], bool] = lambda op: False,
         epilogue_after_reduce: bool = True,
         accept: Callable[["FusedOp"], bool] = lambda group: True,
         materialize: Callable[[Operator], bool] = lambda op: False,
         views: Collection[str] = (),
         permuted_epilogue: Callable[[Operator], bool] = lambda op: False) -> list[Operator]:
    """Group ``ops`` (one rank's compute ops, in topological order) into kernels.

    Parameters
    ----------
    ops
        The ops to compile; tensors they read that none of them produces are kernel inputs.
    keep
        Names of tensors that must be materialized although only fused ops read them (graph
        outputs, inputs of collectives and of ops compiled elsewhere).
    barriers
        Ops that must stay alone (e.g. the cpu target's GEMM templates).
    no_prologue
        Ops that start their own group but may take epilogues (the cpu conv template).
    epilogue_after_reduce
        Whether element-wise consumers may join a group that reduces (the cuda GEMM template
        applies them in its epilogue).
    accept
        Called on every fused group; a group it refuses is split into its longest prefix it takes
        (a conv template and the element-wise ops it applies as its epilogue) or else its first op,
        and the rest, which is tried again.
    materialize
        Ops whose output is written for its readers: they may join their producers' groups, but
        no reader joins theirs (the cuda target on Hopper: casts to float16/bfloat16, so that a
        GEMM reads its half-precision operand from memory, 16 bytes at a time).
    permuted_epilogue
        Transposes that may join a contraction's (or a pool's or resize's, :data:`WINDOWED`) group
        as its epilogue although they do not read its output at their own index (the cuda GEMM
        templates store any output layout, each element of the product still computed once: a conv
        writing its output channels-last for the convs that read it, ``passes/channels_last.py``).
    views
        Names of the ops among ``ops`` that the runtime can run as views (a reshape whose output
        aliases its input's bytes; no kernel). One whose input index is affine in its output
        index (it only splits dims, e.g. ``[B*S, N] -> [B, S, N]``) may be fused like any
        injective op, also as a GEMM's epilogue (the product then sees the split dims as a
        composite M or N); the others, and any left alone, are returned as they are and must not
        be compiled: :func:`drop_views` leaves them out.

    Returns
    -------
    list[Operator]
        The ops to compile, in order: original ops and :class:`FusedOp` groups.
    """
    views = set(views)
    fusable_view = {op.name for op in ops if op.name in views and _affine_view(op)}
    frozen = views - fusable_view  # views that stay views: nothing joins them, they join nothing
    readers: dict[int, list[Operator]] = {}
    for op in ops:
        for t in {id(t): t for t in op.inputs}.values():
            readers.setdefault(id(t), []).append(op)
    keep = set(keep)
    groups: list[list[Operator]] = []
    group_of: dict[int, int] = {}  # id(tensor) -> index of the group whose last output it is
    pos = {id(op): i for i, op in enumerate(ops)}

    # phase 1, in program order: an op joins the groups of inputs it is the only reader of
    for op in ops:
        take: list[int] = []  # the groups this op joins (their last outputs are inner tensors then)
        if op.name in frozen:
            groups.append([op])
            continue
        if _single(op) and not barriers(op) and not no_prologue(op):
            reducing = False
            for k, t in enumerate(op.inputs):
                g = group_of.get(id(t))
                if g is None or g in take or len(readers.get(id(t), ())) != 1 or t.name in keep:
                    continue
                if materialize(groups[g][-1]):
                    continue
                if sum(1 for u in op.inputs if u is t) != 1:
                    continue
                members = groups[g]
                if sum(len(groups[h]) for h in take) + len(members) + 1 > MAX_GROUP_OPS:
                    continue
                reduces = any(_has_reduce(m) for m in members)
                if reduces:  # only as an element-wise epilogue (or a GEMM's split view), of one reducing group,
                    # or reading a row statistic that group computes (not a contraction's: its template
                    # has no such epilogue), which the row kernel then computes once per row
                    contraction = any(m.op_type in CONTRACTIONS for m in members)
                    split = op.name in fusable_view and contraction
                    row = not contraction and _reads_row_statistic(op, k)
                    permuted = (contraction or any(m.op_type in WINDOWED for m in members)) and permuted_epilogue(op)
                    if reducing or not (type(op).injective and epilogue_after_reduce
                                        and (_reads_elementwise(op, k) or split or row or permuted)):
                        continue
                    reducing = True
                elif op.op_type in CONTRACTIONS and not all(m.op_type in CHEAP for m in members):
                    continue
                take.append(g)
        if take:
            joined = take[0]
            merged = sorted((m for g in take for m in groups[g]), key=lambda m: pos[id(m)])
            for g in take[1:]:
                groups[g] = []
            groups[joined] = merged + [op]
            for t in op.inputs:
                if group_of.get(id(t)) in take:
                    del group_of[id(t)]
        else:
            groups.append([op])
            joined = len(groups) - 1
        if _single(op) and not barriers(op):
            group_of[id(op.outputs[0])] = joined

    # phase 2: a group whose output is read several times, all inside one other group, joins it
    # (x -> GELU written as x * f(x): the GEMM producing x becomes the element-wise chain's prologue);
    # until no group joins another: a join can bring the readers of an earlier group's output
    # together (a rotary embedding's heads, read by the slices of its rotated and passed parts,
    # which meet only once each slice's own readers have joined the rotation's group)
    owner = {id(m): gi for gi, g in enumerate(groups) for m in g}
    joined_any = True
    while joined_any:
        joined_any = False
        for gi in sorted(range(len(groups)), key=lambda i: pos[id(groups[i][-1])] if groups[i] else -1):
            a = groups[gi]
            if not a or not _single(a[-1]) or barriers(a[-1]) or a[-1].name in frozen or materialize(a[-1]):
                continue
            t = a[-1].outputs[0]
            rs = readers.get(id(t), [])
            homes = {owner[id(r)] for r in rs}
            if len(rs) < 2 or len(homes) != 1 or t.name in keep or gi in homes:
                continue
            hi = homes.pop()
            home = groups[hi]
            if len(a) + len(home) > MAX_GROUP_OPS:
                continue
            if any(barriers(m) or not _single(m) or m.name in frozen for m in home) or no_prologue(home[0]):
                continue
            if any(_has_reduce(m) for m in a):
                if not epilogue_after_reduce or any(_has_reduce(m) for m in home):
                    continue
                if not all(type(r).injective and all(_reads_elementwise(r, k) for k, u in enumerate(r.inputs)
                                                     if u is t) for r in rs):
                    continue
            elif any(r.op_type in CONTRACTIONS for r in rs) and not all(m.op_type in CHEAP for m in a):
                continue
            groups[hi] = sorted(a + home, key=lambda m: pos[id(m)])
            groups[gi] = []
            for m in a:
                owner[id(m)] = hi
            joined_any = True

    # a group of views alone would be a copy kernel: they stay views
    groups = [[m] for g in groups if g and all(m.name in views for m in g) for m in g] + \
        [g for g in groups if g and not all(m.name in views for m in g)]
    res: list[Operator] = []
    for members in sorted(groups, key=lambda g: pos[id(g[-1])]):  # a group runs where its last member ran
        while len(members) > 1:
            group = FusedOp(members)
            if accept(group):
                res.append(group)
                break
            k = _accepted_prefix(members, accept)
            res.append(FusedOp(members[:k]) if k > 1 else members[0])
            members = members[k:]
        else:
            res.append(members[0])
    n_fused = sum(len(g) for g in groups if len(g) > 1)
    log.debug("fusion: %d ops -> %d kernels (%d ops in %d fused groups)", len(ops), len(res), n_fused,
              sum(1 for g in groups if len(g) > 1))
    return res


def _accepted_prefix(members: list[Operator], accept: Callable[["FusedOp"], bool]) -> int:
    """The length of the longest proper prefix of a refused group that ``accept`` takes and
    whose inner tensors the rest does not read (a conv with its element-wise epilogue, before the
    reshape that ended its group: that one then runs as a view or on its own); 1 when none."""
    for k in range(len(members) - 1, 1, -1):
        inner = {id(m.outputs[0]) for m in members[:k - 1]}
        if any(id(t) in inner for m in members[k:] for t in m.inputs):
            continue
        if accept(FusedOp(members[:k])):
            return k
    return 1


def _affine_view(op: Operator) -> bool:
    """A reshape-like op whose input index is affine in its output index."""
    if not _single(op) or len(op.inputs) != 1:
        return False
    gc = op.task.outputs[0]
    v = gc.value
    if isinstance(v, Cast):
        v = v.a
    return isinstance(v, TensorElement) and all(affine_form(i) is not None for i in v.indices)


def drop_views(groups: Sequence[Operator], views: Collection[str]) -> list[Operator]:
    """``groups`` (ops or :func:`fuse`'s result) without the view ops left alone: those run as
    views and get no kernel."""
    views = set(views)
    return [g for g in groups if isinstance(g, FusedOp) or g.name not in views]


def kernel_entries(groups: Sequence[Operator], built: dict) -> dict:
    """What a code generator returns per original op name, from what it ``built`` per group name:
    a fused group's entry, with the group's kernel inputs and outputs named, goes to its last
    member (where it runs); the other members map to ``None`` (no kernel of their own)."""
    res: dict = {}
    for g in groups:
        if g.name not in built:
            continue
        if not isinstance(g, FusedOp):
            res[g.name] = built[g.name]
            continue
        for m in g.members[:-1]:
            res[m.name] = None
        res[g.name] = {"symbol": built[g.name], "inputs": [t.name for t in g.inputs],
                       "outputs": [t.name for t in g.outputs]}
    return res


def aliased_inputs(groups: Sequence[Operator], in_place: Mapping[str, str] | None) -> dict[str, int]:
    """``{kernel (group) name: input index}`` for the kernels whose one output the program writes
    over one of their inputs, given ``in_place`` as the builders take it (``{output tensor name:
    input tensor name}``)."""
    aliased = {}
    for g in groups if in_place else ():
        name = in_place.get(g.outputs[0].name) if len(g.outputs) == 1 else None
        ks = [k for k, t in enumerate(g.inputs) if name is not None and t.name == name]
        if len(ks) == 1:
            aliased[g.name] = ks[0]
    return aliased
