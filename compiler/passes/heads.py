"""Attention heads padded to a multiple of the tensor-parallel ranks (for the Megatron baseline).

Megatron's tensor parallelism gives each rank whole heads: the Q, K and V projections split by
columns, the attention by heads, the output projection by rows. When the heads do not divide over
the ranks (GPT-2 XL's 25 on 2; Qwen2-0.5B's 14 on 4), a torch.chunk split of the projections'
columns cuts a head in two and the heads' reshape has to gather it back; the baseline then keeps
those projections whole (``search._unmatched_column_splits``). Megatron-LM and vLLM refuse such a
model. This pass pads the heads instead: ``H`` heads become ``H' = ceil(H / n) * n``, each of the
``H' - H`` new heads a copy of head 0 (its projection columns, its bias, any per-head constant),
and the output projection's rows for them zero, so they add exactly zero to its sums (a copy of a
real head computes finite values wherever the model does; zero-filled heads could divide zero by
zero in a norm). The program computes ``H' / H`` of the attention's work and the model's outputs
are the unpadded ones up to the order of the sums.

Matched: a product by a constant 2-D weight (``search._is_weight_matmul``) whose output, maybe past
element-wise ops with constants (a bias; OPT's, Whisper's and XGLM's scaling of the queries before
their view) and reshapes that regroup its rows, is reshaped into heads (its last dim ``N`` into
``[H, N / H]``, or ``[H, ..]``: BLOOM's head-major ``[H, 3, d]``); every such product with the same
``H`` is padded together (a model's Q, K and V). From them the pass follows the heads to the
products that contract over them: each op on the way must have a sharding rule
(``rules.op_strategies`` on a mesh of ``H`` ranks: one head each) that splits its padded inputs
along their heads' dims and its output along one dim (the op keeps heads apart), and each
contracting op must be a product by a constant weight whose rule gives a partial sum (the output
projection). An activation the rule splits that is not padded (T5's relative position bias, one per
head, computed once for all layers) is gathered to ``H'`` heads, the new ones head 0's; a split
constant is padded likewise. Every op is rebuilt on the padded inputs (``Operator.localize``, as
the partitioner builds a rank's op on its shards, with the shapes ``H'`` heads give). So every
tensor along the heads holds in each new head a copy of head 0's values. Nothing is padded (the
group is left as it was) when an op mixes the heads otherwise, or when a rebuilt op does not give
the shapes expected. Padded heads that reach a graph output (a KV cache's presents) are taken back
to the model's heads there by a gather (:meth:`_Padding._unpad_outputs`): the model's outputs keep
their shapes; a program that keeps such a present as the next run's past (``compile(state=...)``)
keeps it on the padded heads instead, split as the attention is (:func:`keep_state_padded`).

Grouped key/value heads (``Hkv`` of them, each read by ``G = H / Hkv`` query heads) are repeated
for the queries by transformers' ``repeat_kv``: ``[.., Hkv, 1, ..]`` expanded to ``[.., Hkv, G,
..]`` and reshaped to ``H`` heads. Padded, query head ``h < H`` still reads key/value head
``h // G`` and a new one head 0's (it is a copy of query head 0): the expand and reshape become a
gather of those ``H'`` heads (constant indices), and the key and value projections stay as they
are (the baseline keeps them whole when their ``Hkv`` heads do not divide either). An
``Attention`` op that reads grouped heads itself (onnxruntime's GroupQueryAttention, 4-D) is
rebuilt on keys and values gathered likewise (one gather each, from the keys and values it read);
with queries padded by key/value group (below) it is rebuilt on the padded queries and the same
keys and values (:meth:`_Padding._regroup_attention`), and it ends a replication of those as a
``repeat_kv`` does (:meth:`_Padding._unrepeat_attention`). With queries padded at the end whose
blocks of ``G`` each read one key/value head, it is rebuilt on them and the key/value heads
gathered to one a block (:meth:`_Padding._regather_attention`), an end of their replication or
padding as well.
The groups with the most heads are padded first (the queries before their key/value heads).

Fewer key/value heads than ranks, with queries that split evenly (``n % Hkv == 0`` and ``H % n
== 0``: Llama-3-8B's 8 for 32 queries on 16 ranks) are replicated instead, as Megatron-LM does:
``Hkv`` heads become ``n``, new head ``j`` a copy of head ``j // (n / Hkv)`` (the same machinery
as padding, with that map in place of "then head 0"), so each rank computes the one key/value
head its ``H / n`` queries read; their ``repeat_kv`` then expands each of the ``n`` heads to
``H / n`` query heads, and gives the tensor it gave before. Without it the group was padded like
any other and the plan kept the key projections whole and moved the scores with all-to-alls.
Query heads that do not divide, whose key/value heads divide the ranks (``n % Hkv == 0``:
Qwen2.5-7B's 28 for 4 on 8), are padded by key/value group: each group's ``G`` queries, then
copies of its first, to ``G'`` a multiple of ``n / Hkv`` (so each rank's queries are of one
group; ``H' = Hkv G'`` is ``ceil(H / n) n`` as before), and the key/value heads are then
replicated as above, the gather that repeats them for the padded queries being the end rebuilt.
Whatever the padding, key/value heads are replicated wherever each rank's queries read one of them
(``_one_a_rank``: 4 queries for 2 padded to 6 on 3 ranks read ``[0, 1, 0]``, the last rank's
queries copies of query 0); else the gather reads them whole on every rank. Key/value heads that
neither divide over the ranks nor divide them (Phi-3-medium's 10 for 40 queries on 4 or 8 ranks;
3 for 9 on 2) are padded at the end to ``Hkv'``, the next multiple of the ranks, and their queries
by whole groups to ``Hkv' G`` (:func:`_whole_groups`; a new query a copy of query 0 and its new
key/value head a copy of head 0, so it computes what query 0 does): the gather that repeats the
key/value heads for those queries then ends as a ``repeat_kv`` expand of the padded heads
(:func:`_ends_padding`), and each rank holds the ``Hkv' / n`` heads its ``H' / n`` queries read.
Before, the key/value heads were padded alone and the queries of a rank read heads of another:
the key projection (on 2 ranks the value projection too) stayed whole.
The dynamo exporter's keys whose ``repeat_kv`` merges the batch with the heads (``[B * H, S, d]``,
transposed, split back to ``[B, H, d, S]``), and its other heads merged with the batch for a
transpose, are rewritten per head by :class:`UnmergeHeads`, which ``driver.plan_passes`` runs
before this pass (after ``AttentionOnHeads``, which writes attention computed on ``[B * H, ..]``
tensors, XGLM's and DeBERTa's, on its ``[B, H, ..]`` views), as it does the views of
``torch.nn.MultiheadAttention``'s time-major heads merged with the batch (``[L, B * H, d]``
transposed to ``[B * H, L, d]``; its key padding mask ``[B * H, 1, L]``; the heads merged back,
:func:`_unmerge_views`).
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..errors import ShapeError, ShardflowError
from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from ..ir.spill import concatenate
from ..parallel.placement import Partial, Replicate, Shard
from ..parallel.rules import op_strategies
from .base import GraphPass, take_over

__all__ = ["PadHeads", "UnmergeHeads"]

log = logging.getLogger(__name__)


class PadHeads(GraphPass):
    """Pad attention heads to a multiple of ``ranks`` (see the module's docstring). After
    :meth:`run`, ``padded`` lists ``(heads, padded heads, number of products padded)`` per group."""

    def __init__(self, ranks: int):
        self.ranks = int(ranks)
        self.padded: list[tuple[int, int, int]] = []
        #: ``(key/value heads, ranks, number of products)`` per group replicated to one head a rank
        self.replicated: list[tuple[int, int, int]] = []
        #: ``{heads: (key/value heads, G, G')}`` for groups of query heads padded by key/value group
        self.grouped: dict[int, tuple[int, int, int]] = {}
        self.products: list[str] = []  # the names of the products padded, in graph order

    def run(self, graph: FlowGraph) -> FlowGraph:
        if self.ranks <= 1:
            return graph
        n = self.ranks
        consumers = graph.consumers()
        groups: dict[int, list[Operator]] = {}
        divided: dict[int, list[Operator]] = {}  # (groups whose heads divide over the ranks)
        repeats: dict[int, list[Operator]] = {}  # by the heads they repeat the key/value heads to
        kv_repeats: dict[int, list[Operator]] = {}  # by the key/value heads they repeat
        for op in graph.nodes:
            h = _heads_of(op, consumers)
            if h is not None:
                (groups if h % n else divided).setdefault(h, []).append(op)
            if (r := _repeated_heads(op)) is not None:
                repeats.setdefault(r[0] * r[1], []).append(op)
                kv_repeats.setdefault(r[0], []).append(op)
            elif (r := _grouped_attention_heads(op)) is not None:  # (an attention that repeats them itself)
                repeats.setdefault(r[1], []).append(op)
                kv_repeats.setdefault(r[0], []).append(op)
        # queries whose key/value heads neither divide over the ranks nor divide them (Phi-3-medium's
        # 40 for 10 on 4 ranks) padded by whole key/value groups: to H' = Hkv' G, Hkv' a multiple of
        # the ranks, so that each rank's queries read the key/value heads it holds once those are
        # padded to Hkv' (:func:`_whole_groups`)
        targets: dict[int, int] = {}
        for h, reps in repeats.items():
            if (h2 := _whole_groups(reps, h, n)) is not None and (h in groups or h in divided):
                targets[h] = h2
                groups.setdefault(h, divided.get(h, []))
        # (most heads first: a model's queries before its grouped key/value heads, which are
        # then repeated by a gather and left whole, or replicated; padded first, the keys would
        # make the query projection a whole product gathered per rank)
        for h, seeds in sorted(groups.items(), reverse=True):
            live = {id(op) for op in graph.nodes}
            ends = [op for op in kv_repeats.get(h, []) if id(op) in live]
            if (src := _one_a_rank(ends, n)) is not None:
                # key/value heads of which each rank's queries read one (the queries split evenly,
                # maybe once padded): that one a rank, the heads replicated
                pad = _Padding(graph, h, n, seeds, [], consumers, src=src, ends=ends)
                if (done := pad.apply()):
                    self.replicated.append((h, n, done))
                    self.products += pad.products
                    consumers = graph.consumers()
                    log.info("heads: %d key/value heads replicated to %d (%d products), one a rank", h, n, done)
                    continue  # (else padded, as any group)
            padded = targets.get(h, -(-h // n) * n)
            reps = [op for op in repeats.get(h, []) if id(op) in live]
            src, pads, grouped = (None, None, None) if h in targets else _grouped_padding(reps, h, n)
            # key/value heads padded at the end whose queries were padded by whole groups: their
            # gathers for those queries end as repeat_kv expands of the padded heads
            ends = [op for op in kv_repeats.get(h, []) if id(op) in live and _ends_padding(op, h, padded)]
            pad = _Padding(graph, h, padded, seeds, reps, consumers, src=src, pads=pads, grouped=grouped,
                           ends=ends)
            done = pad.apply()
            if done:
                self.padded.append((h, padded, done))
                self.products += pad.products
                if grouped:
                    self.grouped[h] = grouped
                for op in pad.repeated:  # (their gathers of the key/value heads: ends of a replication of those)
                    kv_repeats.setdefault(_kv_end(op)[0], []).append(op)
                consumers = graph.consumers()
                log.info("heads: %d heads padded to %d (%d products) to split over %d ranks%s",
                         h, padded, done, self.ranks,
                         " (by key/value group: %d -> %d query heads each)" % grouped[1:] if grouped else "")
        return graph


class UnmergeHeads(GraphPass):
    """Views of heads merged with the batch rewritten per head (:func:`_unmerge_views`; the dynamo
    exporter's ``repeat_kv`` merged with the batch split first, :func:`_unmerge_heads`); after
    :meth:`run`, ``rewritten`` counts the views rewritten."""

    rewritten = 0

    def run(self, graph: FlowGraph) -> FlowGraph:
        _unmerge_heads(graph)
        self.rewritten = _unmerge_views(graph)
        return graph


def _unmerge_heads(graph: FlowGraph) -> int:
    """Split the dynamo exporter's merge of a ``repeat_kv`` with the batch (``[B, Hkv, G, S, d]``,
    expanded from ``[B, Hkv, 1, S, d]``, reshaped to ``[B * H, S, d]``) into the ``repeat_kv``'s own
    reshape (``[B, H, S, d]``, the form :func:`_repeated_heads` matches) and a merge of ``[B, H]``,
    which :func:`_unmerge_views` then rewrites per head with the transpose and split that follow
    (``[B, H, d, S]``). The same values. The number split."""
    from ..ops.transform import Reshape

    consumers, done = graph.consumers(), 0

    def only_reader(t: Tensor, kind: str) -> Operator | None:
        readers = consumers.get(id(t), [])
        return readers[0] if len(readers) == 1 and readers[0].op_type == kind else None

    for op in list(graph.nodes):
        x = op.inputs[0] if op.op_type == "Reshape" else None
        if x is None or x.ndim < 4 or x.producer is None or x.producer.op_type != "Expand" \
                or x.producer.inputs[0].shape[2] != 1 or x.shape[2] == 1 \
                or op.outputs[0].shape != (math.prod(x.shape[:3]),) + x.shape[3:] \
                or (t := only_reader(op.outputs[0], "Transpose")) is None \
                or only_reader(t.outputs[0], "Reshape") is None:
            continue  # (only where a transpose and a split follow, which _unmerge_views rewrites)
        heads = Reshape([x], name=f"{op.name}.repeat_kv", shape=(x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])
        # (a new op on the 4-D view: an op's compute definition is built from its inputs' shapes, so
        # one whose input were swapped in place would keep the 5-D one, and its sharding rules too)
        merged = take_over(op, op.clone([heads.outputs[0]]), "merge of the repeat_kv's heads with the batch")
        at = graph.nodes.index(op)
        graph.nodes[at:at + 1] = [heads, merged]
        done += 1
    return done


def _refined(a: tuple[int, ...], b: tuple[int, ...]) -> list[list[int]] | None:
    """The dims of ``b`` (a reshape of a tensor of shape ``a``) each as the list of the dims of the
    coarsest shape that both ``a`` and ``b`` merge (an extent 1 as ``[1]``), or None when a dim of
    one cuts across dims of the other."""
    cuts = sorted({math.prod(a[:i]) for i in range(len(a) + 1)} | {math.prod(b[:i]) for i in range(len(b) + 1)})
    groups, at = [], 1
    for e in b:
        if e == 1:
            groups.append([1])
            continue
        end, dims = at * e, []
        for c in cuts:
            if at < c <= end:
                if c % at:
                    return None
                dims.append(c // at)
                at = c
        groups.append(dims)
    return groups


def _unmerge_views(graph: FlowGraph) -> int:
    """Rewrite views that merge heads with other dims in between two reshapes: a reshape (``x`` to
    ``y``) whose output merges dims that ``x`` had apart, a chain of transposes and element-wise
    ops with constants (each the only reader of the one before), and a reshape (to ``z``): torch's
    ``nn.MultiheadAttention`` splits its time-major ``[L, B, E]`` queries into ``[L, B * H, d]``
    and transposes them to ``[B * H, L, d]``, which ``AttentionOnHeads`` views as ``[B, H, L, d]``,
    and merges its heads back likewise; its key padding mask is expanded to ``[B, H, 1, L]``
    merged into ``[B * H, 1, L]``. The chain is rebuilt on the dims that ``x`` and ``y`` both
    merge (``[L, B, H, d]``; the transpose moves each of ``y``'s dims as the group of those it
    merges, a constant is reshaped likewise), ending in ``z`` (a reshape to it only where it
    merges those dims): the same values, each head a block of the dims the plan splits. Only where
    ``z`` is those dims, or merges neighbours of them. The number rewritten."""
    from ..ops.transform import Reshape, Transpose

    consumers, done = graph.consumers(), 0
    outputs = {id(t) for t in graph.outputs}
    # (a chain's last reshape may start another: once rewritten, its rebuilt reshape is looked at instead)
    gone: set[int] = set()
    work = list(graph.nodes)
    for op in work:
        if op.op_type != "Reshape" or id(op.outputs[0]) in outputs or id(op) in gone:
            continue
        x, y = op.inputs[0], op.outputs[0]
        groups = _refined(x.shape, y.shape)
        if groups is None or sum(len(g) for g in groups) <= len(y.shape):
            continue  # (y merges nothing that x had apart)
        chain, t = [], y
        while True:
            readers = consumers.get(id(t), [])
            if len(readers) != 1 or id(t) in outputs:
                break
            r = readers[0]
            if r.op_type not in ("Reshape", "Transpose") and not _on_constants(r, t):
                break
            chain.append(r)
            t = r.outputs[0]
            if r.op_type == "Reshape":
                break
        if len(chain) < 2 or chain[-1].op_type != "Reshape":
            continue
        new, cur, gs = [], x, [list(g) for g in groups]
        if _dims(gs) != x.shape:
            new.append(Reshape([x], name=op.name, shape=_dims(gs)))
            cur = new[-1].outputs[0]
        prev = y  # (the chain's tensor the next op reads)
        for r in chain[:-1]:
            if r.op_type == "Transpose":
                starts = np.cumsum([0] + [len(g) for g in gs])
                perm = tuple(int(starts[p]) + i for p in r.attrs["perm"] for i in range(len(gs[p])))
                gs = [gs[p] for p in r.attrs["perm"]]
                new.append(Transpose([cur], name=r.name, perm=perm))
            else:
                gs = _broadcast_groups(r, prev, gs)
                if gs is None:
                    break
                ins = [cur if u is prev else u if u.ndim == 0 else
                       const_tensor(np.asarray(u.value).reshape(_dims(_const_groups(u, gs))), f"{u.name}.unmerged")
                       for u in r.inputs]
                new.append(type(r)(ins, name=r.name, **r.attrs))
            cur, prev = new[-1].outputs[0], r.outputs[0]
        z = chain[-1].outputs[0].shape
        if gs is None or cur.shape != _dims(gs) or (merged := _refined(cur.shape, z)) is None \
                or [e for g in merged for e in g if e != 1] != [e for e in cur.shape if e != 1]:
            continue  # (an op this does not rebuild, or z splits a dim of the rebuilt chain's: no gain)
        if cur.shape != z:
            new.append(Reshape([cur], name=chain[-1].name, shape=z))
        take_over(chain[-1], new[-1], "chain of views without merging the heads")
        at = graph.nodes.index(chain[-1])
        graph.nodes[at:at + 1] = new
        for r in [op] + chain[:-1]:
            graph.nodes.remove(r)
        gone.update(id(r) for r in [op] + chain)
        if new[-1].op_type == "Reshape":
            work.append(new[-1])
        consumers = graph.consumers()
        done += 1
    if done:
        log.info("heads: %d views of heads merged with other dims rewritten per head", done)
    return done


def _dims(groups: list[list[int]]) -> tuple[int, ...]:
    """The shape of a tensor whose dims are ``groups`` (:func:`_unmerge_views`)."""
    return tuple(e for g in groups for e in g)


def _broadcast_groups(op: Operator, t: Tensor, groups: list[list[int]]) -> list[list[int]] | None:
    """The groups (:func:`_unmerge_views`) of the dims of the output of ``op``, an element-wise op
    reading ``t`` (whose dims are ``groups``) and constants: a dim of extent 1 broadcast to a
    constant's extent is one dim of it; None when ``op`` changes the rank or a constant's dim is
    neither 1 nor the output's."""
    out = op.outputs[0].shape

    def fits(u: Tensor) -> bool:
        return u.ndim <= len(out) and all(c in (1, e) for c, e in zip(u.shape[::-1], out[::-1]))

    if len(out) != len(groups) or not all(fits(u) for u in op.inputs if u is not t):
        return None
    grown = []
    for g, e in zip(groups, out):
        if math.prod(g) == e:
            grown.append(g)
        elif all(v == 1 for v in g):
            grown.append([1] * (len(g) - 1) + [e])
        else:
            return None
    return grown


def _const_groups(u: Tensor, groups: list[list[int]]) -> list[list[int]]:
    """The groups of a constant ``u`` read by an op whose output's dims are ``groups``: each of its
    dims (aligned from the last) as that dim's group, or as ones where it is broadcast."""
    lead = len(groups) - u.ndim
    return [g if c != 1 else [1] * len(g) for c, g in zip(u.shape, groups[lead:])]


def _one_a_rank(ends: list[Operator], n: int) -> np.ndarray | None:
    """The key/value head each of ``n`` ranks reads when the queries that ``ends`` (reshapes of
    :func:`_kv_end`) give split evenly over the ranks and each rank's read one key/value head,
    the same for every end; else None. (Llama-3-8B's 32 queries for 8 on 16 ranks: ``j // 2``;
    4 queries for 2 padded to 6 on 3: ``[0, 1, 0]``, the last rank's copies of query 0.)"""
    src = None
    for op in ends:
        hkv, heads, _, idx = _kv_end(op)
        if heads % n:
            return None
        rows = (np.arange(heads) // (heads // hkv) if idx is None else np.asarray(idx)).reshape(n, -1)
        if (rows != rows[:, :1]).any() or src is not None and not np.array_equal(src, rows[:, 0]):
            return None
        src = rows[:, 0]
    return src


def _grouped_padding(repeats: list[Operator], h: int, n: int):
    """``(src, pads, (Hkv, G, G'))`` for ``h`` query heads read as ``Hkv`` groups of ``G`` (their
    ``repeat_kv`` ops: ``repeats``) padded over ``n`` ranks that ``Hkv`` divides: each group padded
    to ``G'`` heads (its ``G``, then copies of its first), ``G'`` a multiple of ``n / Hkv``, so
    each rank's queries are of one group (and read one key/value head, which a replication of
    those heads then gives each rank); ``H' = Hkv G'`` is ``ceil(H / n) n`` as when padded at the
    end. ``(None, None, None)`` (padded at the end) for any other heads."""
    kinds = {(e[0], e[1] // e[0]) for e in map(_kv_end, repeats)}
    if len(kinds) != 1:
        return None, None, None
    hkv, g = kinds.pop()
    if hkv == 1 or n % hkv:  # (one key/value head: the same as padded at the end)
        return None, None, None
    per = n // hkv
    g2 = -(-g // per) * per
    i = np.arange(g2)
    src = (np.arange(hkv)[:, None] * g + np.where(i < g, i, 0)[None, :]).reshape(-1)
    return src, np.tile(i >= g, hkv), (hkv, g, g2)


def _whole_groups(repeats: list[Operator], h: int, n: int) -> int | None:
    """``H' = Hkv' G`` for ``h`` query heads read as ``Hkv`` groups of ``G`` (their ``repeat_kv``
    ops: ``repeats``) when ``Hkv`` neither divides over ``n`` ranks nor divides them (so the
    key/value heads are neither split as they are nor replicated one a rank): ``Hkv'`` the next
    multiple of ``n``, the queries padded at the end to whole groups of the padded key/value heads
    (Phi-3-medium's 40 for 10 on 4: 48 for 12, each rank 3 key/value heads and their 12 queries).
    None otherwise."""
    kinds = {e[:2] for e in map(_kv_end, repeats)}
    if len(kinds) != 1:
        return None
    hkv, heads = kinds.pop()
    if heads != h or hkv <= 1 or hkv % n == 0 or n % hkv == 0:
        return None
    return -(-hkv // n) * n * (h // hkv)


def _ends_padding(op: Operator, hkv: int, padded: int) -> bool:
    """Whether ``op``, a gather of query heads from ``hkv`` key/value heads (:func:`_kv_end`), is a
    ``repeat_kv`` of those heads padded at the end to ``padded``: its ``H`` queries (a multiple of
    ``padded``) read ``p // (H / padded)``, a new head (a copy of head 0) reading head 0."""
    end = _kv_end(op)
    if end is None or end[3] is None or end[0] != hkv or end[1] % padded:
        return False
    src = _padded_at_the_end(hkv, padded)
    return np.array_equal(end[3], src[np.arange(end[1]) // (end[1] // padded)])


def _padded_at_the_end(h: int, padded: int) -> np.ndarray:
    """The head each of ``padded`` heads copies when ``h`` heads are padded at the end: its own,
    then head 0."""
    return np.concatenate([np.arange(h), np.zeros(padded - h, np.int64)])


def _heads_of(op: Operator, consumers) -> int | None:
    """``H`` when ``op`` is a product by a constant 2-D weight whose output (past element-wise ops
    with constants, :func:`_elementwise_of`, and reshapes that regroup its rows) is reshaped into
    ``[..., H, N / H]`` heads, ``H > 1``; else None."""
    from ..parallel.search import _is_weight_matmul

    if _is_weight_matmul(op) is None or not op.outputs or op.outputs[0].ndim < 2:
        return None
    y = op.outputs[0]
    n, rows = y.shape[-1], math.prod(y.shape[:-1])
    readers = consumers.get(id(y), [])
    while readers:
        r = readers[0]
        if len(readers) == 1 and _elementwise_of(r, y):  # (a bias, the queries' scaling, a cast)
            y = r.outputs[0]
            readers = consumers.get(id(y), [])
            continue
        if len(readers) != 1 or r.op_type != "Reshape":
            return None
        s = r.outputs[0].shape
        if s[-1] == n:  # (the rows regrouped: [B*L, N] -> [B, L, N])
            readers = consumers.get(id(r.outputs[0]), [])
            continue
        # [*rows, H, *head]: a head's columns, maybe in dims of their own (BLOOM's head-major
        # [B, S, H, 3, d], its Q, K and V inside each head)
        k = next((k for k in range(len(s)) if math.prod(s[:k]) == rows and s[k] > 1), None)
        if k is not None and len(s) - k >= 2 and math.prod(s[k:]) == n and 1 < s[k] < n:
            return int(s[k])
        return None
    return None


def _on_constants(op: Operator, y: Tensor) -> bool:
    """Whether ``op`` computes element by element on ``y`` (read once), any other operand a constant."""
    return op.op_type in _ELEMENTWISE and sum(1 for t in op.inputs if t is y) == 1 \
        and all(t is y or t.is_constant for t in op.inputs)


def _elementwise_of(op: Operator, y: Tensor) -> bool:
    """:func:`_on_constants`, giving ``y``'s shape: the bias added to a projection, the queries'
    scaling (OPT's, Whisper's), a cast."""
    return _on_constants(op, y) and op.outputs[0].shape == y.shape


_ELEMENTWISE = frozenset({"Binary", "Unary", "Cast", "Activation", "Clip", "Identity"})


def _repeated_heads(op: Operator) -> tuple[int, int, int] | None:
    """``(Hkv, G, axis)`` when ``op`` is the reshape that ends a ``repeat_kv`` (transformers' grouped
    key/value heads: ``[.., Hkv, 1, ..]`` expanded to ``[.., Hkv, G, ..]``, then the two dims merged
    into ``Hkv * G`` heads at ``axis``); else None."""
    if op.op_type != "Reshape" or op.inputs[0].producer is None or op.inputs[0].producer.op_type != "Expand":
        return None
    x, e = op.inputs[0].producer.inputs[0], op.inputs[0]
    out = op.outputs[0].shape
    for a in range(x.ndim - 1):
        if x.shape[a + 1] == 1 and e.shape[a + 1] > 1 and x.shape[:a + 1] == e.shape[:a + 1] \
                and x.shape[a + 2:] == e.shape[a + 2:] \
                and out == e.shape[:a] + (e.shape[a] * e.shape[a + 1],) + e.shape[a + 2:]:
            return int(x.shape[a]), int(e.shape[a + 1]), a
    return None


def _kv_end(op: Operator) -> tuple[int, int, int, np.ndarray | None] | None:
    """``(Hkv, H, axis, indices)`` when ``op`` is a reshape that gives ``H`` query heads at ``axis``
    from ``Hkv`` key/value heads: a ``repeat_kv`` (:func:`_repeated_heads`; indices None), or one
    :meth:`_Padding._repeat` made (``[.., Hkv, 1, ..]`` gathered to ``[.., H, 1, ..]`` by the
    constant ``indices``, then reshaped); else None."""
    if (r := _repeated_heads(op)) is not None:
        return r[0], r[0] * r[1], r[2], None
    if (r := _gathered_attention_heads(op)) is not None:
        return r
    if (r := _grouped_attention_heads(op)) is not None:
        return r[0], r[1], 1, None
    g = op.inputs[0].producer if op.op_type == "Reshape" else None
    if g is None or g.op_type != "Gather" or len(g.inputs) != 2 or not g.inputs[1].is_constant:
        return None
    x, a, out = g.inputs[0], g.attrs.get("axis", 0), op.outputs[0].shape
    idx = np.asarray(g.inputs[1].value).reshape(-1)
    if a < 0 or a + 1 >= x.ndim or x.shape[a + 1] != 1 or out != x.shape[:a] + (len(idx),) + x.shape[a + 2:]:
        return None
    return int(x.shape[a]), len(idx), a, idx


def _grouped_attention_heads(op: Operator) -> tuple[int, int] | None:
    """``(Hkv, H)`` when ``op`` is an ``Attention`` op whose ``H`` query heads read ``Hkv < H``
    key/value heads itself (keys and values 4-D, ``[B, Hkv, L, D]``: onnxruntime's
    GroupQueryAttention as imported); else None."""
    if op.op_type != "Attention" or len(op.inputs) < 3:
        return None
    q, k, v = op.inputs[:3]
    h = q.shape[1] if q.ndim == 4 else op.attrs.get("q_heads")
    if k.ndim != 4 or v.ndim != 4 or not h or k.shape[1] >= h or h % k.shape[1]:
        return None
    return int(k.shape[1]), int(h)


def _gathered_attention_heads(op: Operator) -> tuple[int, int, int, np.ndarray] | None:
    """``(Hkv, H, 1, indices)`` when ``op`` is an ``Attention`` op reading grouped key/value heads
    (:func:`_grouped_attention_heads`) that are gathers, by the same constant indices along dim 1,
    of ``Hkv`` heads (:meth:`_Padding._regather_attention` makes them): ``indices`` the key/value
    head each of its ``H`` query heads reads; else None."""
    if (r := _grouped_attention_heads(op)) is None:
        return None
    k, v = op.inputs[1:3]
    gathers = [t.producer for t in (k, v)]
    if any(g is None or g.op_type != "Gather" or g.attrs.get("axis", 0) != 1 or not g.inputs[1].is_constant
           for g in gathers):
        return None
    idx = [np.asarray(g.inputs[1].value).reshape(-1) for g in gathers]
    if not np.array_equal(idx[0], idx[1]) or gathers[0].inputs[0].shape[1] != gathers[1].inputs[0].shape[1]:
        return None
    hkv, h = r
    return int(gathers[0].inputs[0].shape[1]), h, 1, idx[0][np.arange(h) // (h // hkv)]


def _take_runs(value: np.ndarray, idx: np.ndarray, dim: int) -> np.ndarray:
    """``np.take(value, idx, axis=dim)`` as a concatenation of the slices of ``idx``'s runs of
    consecutive indices (whole heads): a weight's heads copied slice by slice, several times
    faster than an element-wise take along a wide dim (Qwen2.5-7B's 112 padded or replicated
    weights: 2.4 s with the take)."""
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    parts = []
    for run in np.split(idx, cuts):
        index = [slice(None)] * value.ndim
        index[dim] = slice(int(run[0]), int(run[-1]) + 1)
        parts.append(value[tuple(index)])
    return concatenate(parts, axis=dim)


def _gather(x: Tensor, idx: np.ndarray, axis: int, name: str) -> Operator:
    """A gather of ``x``'s slices ``idx`` (constant indices) along ``axis``."""
    from ..ops.transform import Gather

    return Gather([x, const_tensor(np.asarray(idx, np.int64), f"{name}_idx")], name=name, axis=axis)


class _Padding:
    """One group's padding: the ops rebuilt, checked, then put in the graph (or nothing)."""

    def __init__(self, graph: FlowGraph, heads: int, padded: int, seeds: list[Operator], repeats: list[Operator],
                 consumers, src: np.ndarray | None = None, ends: list[Operator] = (), pads: np.ndarray | None = None,
                 grouped: tuple[int, int, int] | None = None):
        self.graph, self.h, self.h2, self.consumers = graph, heads, padded, consumers
        #: ``(Hkv, G, G')`` when the queries are padded by key/value group (:func:`_grouped_padding`)
        self.grouped = grouped
        #: the head each of the ``H'`` new heads copies: the ``H`` heads, then head 0 (padding; or
        #: ``src`` with ``pads``, padding by key/value group), or each head ``H' / H`` times (``src``
        #: alone: key/value heads replicated, with ``ends``)
        if src is None:
            src = _padded_at_the_end(heads, padded)
            pads = np.arange(padded) >= heads
        self.src = np.asarray(src, np.int64)
        #: which of the ``H'`` heads are new ones (their rows zero where the heads are summed); None: replicated
        self.pads = None if pads is None else np.asarray(pads, bool)
        self.seeds = {id(op) for op in seeds}
        self.repeats = {id(op) for op in repeats}
        # repeat_kv reshapes that end a replication (their outputs unchanged), and their expands
        self.ends = {id(op): op for op in ends}
        self.end_expands = {id(op.inputs[0].producer) for op in ends if op.op_type != "Attention"}
        self.end_expands |= {id(t.producer) for op in ends if _gathered_attention_heads(op) is not None
                             for t in op.inputs[1:3]}
        self.axis: dict[int, int] = {}  # id(old tensor) -> its heads' dim
        self.new: dict[int, Tensor] = {}  # id(old tensor) -> the padded one
        self.rebuilt: dict[int, list[Operator]] = {}  # id(old op) -> the ops on padded inputs in its place
        self.contracting: list[Operator] = []  # rebuilt ops that sum the heads (outputs unchanged)
        self.gathered: dict[tuple[int, int], Tensor] = {}  # (id(activation), dim) -> its padded gather
        self.padded_constants: dict[tuple[int, int, bool], Tensor] = {}  # (id(constant), dim, zero) -> padded
        # gathers of a grouped attention's keys and values not in the graph: id(output) -> (op, source, indices)
        self.virtual: dict[int, tuple[Operator, Tensor, np.ndarray]] = {}
        self.products: list[str] = []  # (once applied) the names of the products padded, in graph order
        # the reshapes ending the gathers that replaced ``repeats`` (and attentions on queries padded by group)
        self.repeated: list[Operator] = []

    def apply(self) -> int:
        """Pad the group; the number of products padded (0: nothing changed)."""
        try:
            for op in self.graph.nodes:
                if id(op) in self.repeats:
                    self._repeat(op)
                elif id(op) in self.ends:
                    self._unrepeat(op)
                elif id(op) in self.end_expands:
                    continue  # (rebuilt with its reshape)
                elif id(op) in self.seeds or any(id(t) in self.axis for t in op.inputs):
                    self._rebuild(self._grouped_attention(op), orig=op)
            self._check_readers()
            unpadded = self._unpad_outputs()
        except _Refused as why:
            log.info("heads: %d heads not padded to %d: %s", self.h, self.h2, why)
            return 0
        except Exception as exc:  # (an op this pass could not rebuild: a bug to report, not a failed compile;
            # nothing is in the graph yet, so it stays as it was and the plan keeps such heads whole)
            log.warning("heads: %d heads not padded to %d: %s: %s (please report this)", self.h, self.h2,
                        type(exc).__name__, exc)
            return 0
        contracting = {id(op) for op in self.contracting}
        summing = set()  # (the old ops the contracting ones replace)
        for old in self.graph.nodes:
            new = self.rebuilt.get(id(old))
            if new and id(new[-1]) in contracting:
                take_over(old, new[-1], "padding of its heads")
                summing.add(id(old))
            elif id(old) in self.ends:
                take_over(old, new[-1], "replication of its key/value heads")
        self.products = [op.name for op in self.graph.nodes if id(op) in self.seeds or id(op) in summing]
        self.graph.nodes = [n for op in self.graph.nodes for n in self.rebuilt.get(id(op), [op])]
        for k, t in enumerate(self.graph.outputs):  # (the model's own outputs: its heads, not the padded ones)
            if id(t) in unpadded:
                self.graph.outputs[k] = unpadded[id(t)]
        if self.repeats:  # (the expands the gathers replaced)
            from .simplify import EliminateDeadCode

            EliminateDeadCode().run(self.graph)
        return len(self.seeds) + len(self.contracting)

    def _repeat(self, op: Operator) -> None:
        """A ``repeat_kv`` (:func:`_repeated_heads`) as a gather of its ``H'`` heads from the
        key/value heads: query head ``h < H`` reads ``h // G``, a new one head 0's (as its query
        is head 0's), so the new heads stay copies of head 0."""
        from ..ops.transform import Reshape

        if op.op_type == "Attention":  # (an attention reading grouped key/value heads itself)
            if not any(id(t) in self.axis for t in op.inputs):
                return
            if self.grouped is not None:
                return self._regroup_attention(op)
            if self._regather_attention(op):
                return
            return self._rebuild(self._grouped_attention(op), orig=op)
        hkv, g, a = _repeated_heads(op)
        x = op.inputs[0].producer.inputs[0]
        gather = _gather(x, self.src // g, a, f"{op.name}.heads{self.h2}")
        shape = op.outputs[0].shape[:a] + (self.h2,) + op.outputs[0].shape[a + 1:]
        reshape = Reshape([gather.outputs[0]], name=op.name, shape=shape)
        reshape.outputs[0].name = op.outputs[0].name
        self.rebuilt[id(op)] = [gather, reshape]
        self.repeated.append(reshape)
        self.axis[id(op.outputs[0])] = a
        self.new[id(op.outputs[0])] = reshape.outputs[0]

    def _unrepeat(self, op: Operator) -> None:
        """A ``repeat_kv`` that ends a replication: the ``H'`` key/value heads (one a rank) each
        expanded to the ``H / H'`` query heads that read it, giving the same tensor as before."""
        from ..ops.transform import Expand, Reshape

        if op.op_type == "Attention":
            return self._unrepeat_attention(op)
        hkv, heads, a, idx = _kv_end(op)
        expand = op.inputs[0].producer
        x = expand.inputs[0]
        if id(x) not in self.axis or self.axis[id(x)] != a or len(self.consumers.get(id(expand.outputs[0]), ())) != 1:
            raise _Refused(f"{op.name} repeats heads this group did not pad, or its expand has other readers")
        if idx is not None and not np.array_equal(idx, self.src[np.arange(heads) // (heads // self.h2)]):
            raise _Refused(f"{op.name} gathers key/value heads in another order than one a rank")
        shape = x.shape[:a] + (self.h2, heads // self.h2) + x.shape[a + 2:]
        new_expand = Expand([self.new[id(x)]], name=expand.name, shape=shape)
        reshape = Reshape([new_expand.outputs[0]], name=op.name, shape=op.outputs[0].shape)
        self.rebuilt[id(expand)] = []
        self.rebuilt[id(op)] = [new_expand, reshape]

    def _regroup_attention(self, op: Operator) -> None:
        """An attention reading grouped key/value heads itself, its queries padded by key/value group
        (``G'`` a group, :func:`_grouped_padding`): the same op on the padded queries and the same
        keys and values (padded query ``p`` reads key/value head ``p // G'``, its group's), its
        sinks (one per query head) padded alike; its output holds the padded heads."""
        hkv, g, g2 = self.grouped
        q, k, v = op.inputs[:3]
        if self.axis.get(id(q)) != (1 if q.ndim == 4 else 2) or id(k) in self.axis or id(v) in self.axis \
                or k.shape[1] != hkv or len(op.outputs) != 1:
            raise _Refused(f"{op.name} reads other padded heads than its queries, or has several outputs")
        for t in op.inputs[3:]:
            if id(t) in self.axis or t.ndim == 4 and t.shape[1] == self.h:
                raise _Refused(f"{op.name} reads {t.name} per query head")
        attrs = dict(op.attrs, **({"q_heads": self.h2} if "q_heads" in op.attrs else {}))
        new = self._on_padded_queries(op, k, v, attrs)
        if new is None:
            raise _Refused(f"{op.name} does not take {self.h2} query heads")
        self.rebuilt[id(op)] = [new]

    def _on_padded_queries(self, op: Operator, k: Tensor, v: Tensor, attrs: dict) -> Operator | None:
        """``op`` (an attention grouping its key/value heads itself) on the padded queries and keys
        ``k`` and values ``v``, its sinks (constants, one per query head) padded as the queries; its
        output the padded heads (recorded as this group's). None when it cannot be so built."""
        rest = [self._pad_constant(t, 0, zero=False) if t.is_constant and t.shape == (self.h,) else t
                for t in op.inputs[3:]]
        out, dim = op.outputs[0], 1 if op.outputs[0].ndim == 4 else 2
        try:
            new = type(op)([self.new[id(op.inputs[0])], k, v, *rest], name=op.name, **attrs)
        except (ShapeError, ShardflowError, ValueError):
            return None
        if new.outputs[0].shape != self._grown(out, dim):
            return None
        new.outputs[0].name = out.name
        self.repeated.append(new)
        self.axis[id(out)] = dim
        self.new[id(out)] = new.outputs[0]
        return new

    def _regather_attention(self, op: Operator) -> bool:
        """An attention reading grouped key/value heads itself (``G`` queries a head), its queries
        padded at the end, where each block of ``G`` padded queries reads one key/value head (4 for
        2 padded to 6: ``[0, 1, 0]``): the same op on the padded queries and the key/value heads
        gathered to ``H' / G`` (one a block), so it still groups them, and the gathers end a
        replication or padding of those heads (:func:`_gathered_attention_heads`). False (nothing
        done) where a block reads two."""
        hkv, h = _grouped_attention_heads(op)
        q, k, v = op.inputs[:3]
        g = h // hkv
        kv = self.src // g  # (the key/value head each padded query reads: a new one head 0's)
        if self.h2 % g or (kv.reshape(-1, g) != kv[::g, None]).any() or self.axis.get(id(q)) != 1 \
                or any(id(t) in self.axis for t in (k, v, *op.inputs[3:])) or len(op.outputs) != 1 \
                or any(t.ndim == 4 and t.shape[1] == h for t in op.inputs[3:]):
            return False
        gathers = [_gather(t, kv[::g], 1, f"{t.name}.heads{self.h2 // g}") for t in (k, v)]
        attrs = dict(op.attrs, **{a: n for a, n in (("q_heads", self.h2), ("kv_heads", self.h2 // g))
                                  if a in op.attrs})
        new = self._on_padded_queries(op, *(x.outputs[0] for x in gathers), attrs)
        if new is None:
            return False
        self.rebuilt[id(op)] = [*gathers, new]
        return True

    def _unrepeat_attention(self, op: Operator) -> None:
        """An ``Attention`` op that reads grouped key/value heads itself (:func:`_grouped_attention_heads`;
        directly, or through gathers, :func:`_gathered_attention_heads`) ending a replication or
        padding: the same op on the ``H'`` keys and values of this group, query head ``h`` reading
        head ``h // (H / H')``, a copy of the one it read (so its output is unchanged); the gathers
        are dropped."""
        q, k, v = op.inputs[:3]
        hkv, heads, _, idx = _kv_end(op)
        gathered = idx is not None
        srcs = [t.producer.inputs[0] for t in (k, v)] if gathered else [k, v]
        read = idx if gathered else np.arange(heads) // (heads // hkv)
        if any(self.axis.get(id(t)) != 1 for t in srcs) or any(id(t) in self.axis for t in (q, *op.inputs[3:])):
            raise _Refused(f"{op.name} reads heads this group did not replicate, or others along with them")
        if not np.array_equal(self.src[np.arange(heads) // (heads // self.h2)], read):
            raise _Refused(f"{op.name}'s query heads read their key/value heads in another order than this group's")
        attrs = dict(op.attrs, **({"kv_heads": self.h2} if "kv_heads" in op.attrs else {}))
        new = type(op)([q, *(self.new[id(t)] for t in srcs), *op.inputs[3:]], name=op.name, **attrs)
        if [t.shape for t in new.outputs] != [t.shape for t in op.outputs]:
            raise _Refused(f"{op.name} on {self.h2} key/value heads gives {[t.shape for t in new.outputs]}")
        if gathered:
            for t in (k, v):
                self.rebuilt[id(t.producer)] = []
        self.rebuilt[id(op)] = [new]

    def _grouped_attention(self, op: Operator) -> Operator:
        """An ``Attention`` op with grouped key/value heads (4-D, ``Hkv`` of them for the ``H`` padded
        query heads: onnxruntime's GroupQueryAttention) as the same op on keys and values gathered
        to one head per query head (query head ``h`` reads ``h // G``, as before); the gathers are
        not in the graph: :meth:`_pad_activation` pads them into one gather from the keys and
        values themselves. Any other op as it is."""
        if op.op_type != "Attention" or len(op.inputs) < 3 or id(op.inputs[0]) not in self.axis:
            return op
        q, k, v = op.inputs[:3]
        if self.axis[id(q)] != 1 or q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or id(k) in self.axis \
                or id(v) in self.axis or q.shape[1] != self.h or k.shape[1] >= self.h or self.h % k.shape[1]:
            return op
        idx = np.arange(self.h) // (self.h // k.shape[1])
        ins = []
        for t in (k, v):
            g = _gather(t, idx, 1, f"{t.name}.heads{self.h}")
            self.virtual[id(g.outputs[0])] = (g, t, idx)
            ins.append(g.outputs[0])
        return type(op)([q, *ins, *op.inputs[3:]], name=op.name, **op.attrs)

    def _rebuild(self, op: Operator, orig: Operator | None = None) -> None:
        """``op`` (``orig``, or the form :meth:`_grouped_attention` gave it) rebuilt on padded inputs,
        in ``orig``'s place."""
        if id(op) in self.seeds and any(id(t) in self.axis for t in op.inputs):
            raise _Refused(f"the projection {op.name} reads padded heads")
        if op.positional:
            raise _Refused(f"{op.name} ({op.op_type}) draws values by position, which padded heads would move")
        ins, outs, contracting = self._strategy(op)
        # pad the strategy's split constants (copies of head 0; zero rows where the heads are
        # summed) and activations that are not padded yet (a gather: copies of head 0's slice)
        inputs, gathers = [], []
        for t, p in zip(op.inputs, ins):
            if id(t) in self.axis:
                inputs.append(self.new[id(t)])
            elif t.is_constant and isinstance(p, Shard):
                inputs.append(self._pad_constant(t, p.dim, zero=contracting))
            elif isinstance(p, Shard):
                inputs.append(self._pad_activation(t, p.dim, gathers))
            else:
                inputs.append(t)
        if contracting:
            shapes = [t.shape for t in op.outputs]
        else:
            shapes = [self._grown(t, p.dim) for t, p in zip(op.outputs, outs)]
        try:
            new = op.localize(inputs, shapes)
        except (ShapeError, ShardflowError, ValueError) as exc:
            raise _Refused(f"{op.name} ({op.op_type}) on {self.h2} heads: {exc}") from None
        for t in inputs:  # (a gather of :meth:`_grouped_attention` that was not padded: put in as it is)
            if id(t) in self.virtual:
                gathers.insert(0, self.virtual.pop(id(t))[0])
        orig = orig or op
        self.rebuilt[id(orig)] = gathers + [new]
        if contracting:
            self.contracting.append(new)
            return
        for t, lt, p in zip(orig.outputs, new.outputs, outs):
            lt.name = t.name
            self.axis[id(t)] = p.dim
            self.new[id(t)] = lt

    def _strategy(self, op: Operator):
        """``(input placements, output placements, contracting)`` of the sharding rule (on a mesh
        of ``H`` ranks) that splits ``op``'s padded inputs along their heads' dims and its output
        along one dim, or sums over the heads (a product by a constant weight); of those, the one
        that splits the fewest activations not padded yet."""
        from ..parallel.search import _is_weight_matmul

        try:
            cands = op_strategies(op, (self.h,))
        except ShardflowError as exc:
            raise _Refused(f"{op.name} ({op.op_type}) has no rules: {exc}") from None
        found = []
        for c in cands:
            if c.assignment[0] is None:
                continue
            ins = [sp.placements[0] for sp in c.input_specs]
            outs = [sp.placements[0] for sp in c.output_specs]
            contracting = all(isinstance(p, Partial) and p.op == "sum" for p in outs)
            ok = contracting or all(isinstance(p, Shard) for p in outs)
            for t, p in zip(op.inputs, ins):
                if id(t) in self.axis:
                    ok &= p == Shard(self.axis[id(t)])
                elif not t.is_constant:
                    ok &= isinstance(p, (Replicate, Shard)) and not contracting
                else:  # (a bias added to the sum is partial too: kept as it is)
                    ok &= isinstance(p, (Replicate, Shard)) or contracting and p == Partial("sum")
            if id(op) in self.seeds:
                ok &= outs == [Shard(op.outputs[0].ndim - 1)]
            if contracting and ok:
                w = _is_weight_matmul(op)
                ok &= w is not None and isinstance(ins[w], Shard) and \
                    sum(1 for t in op.inputs if id(t) in self.axis) == 1
            if ok:
                gathered = sum(1 for t, p in zip(op.inputs, ins)
                               if isinstance(p, Shard) and not t.is_constant and id(t) not in self.axis)
                found.append((gathered, len(found), ins, outs, contracting))
        if not found:
            raise _Refused(f"{op.name} ({op.op_type}) does not keep the heads apart")
        _, _, ins, outs, contracting = min(found)
        return ins, outs, contracting

    def _index(self, t: Tensor, dim: int) -> np.ndarray:
        """The indices along ``dim`` of ``t`` (``H`` heads of ``unit`` elements) that the ``H'`` new
        heads copy (``src``: with padding, ``t``'s own and then head 0's once per new head)."""
        e = t.shape[dim]
        if e % self.h:
            raise _Refused(f"{t.name}'s dim {dim} ({e}) is not a whole number of heads")
        unit = e // self.h
        return (self.src[:, None] * unit + np.arange(unit)).reshape(-1)

    def _pad_activation(self, t: Tensor, dim: int, gathers: list[Operator]) -> Tensor:
        """``t`` gathered to ``H'`` heads along ``dim`` (the new ones copies of ``src``'s slices),
        once per tensor and dim; a new gather op is appended to ``gathers``."""
        key = (id(t), dim)
        if key not in self.gathered:
            idx = self._index(t, dim)
            if id(t) in self.virtual and dim == 1:  # (a grouped attention's gather: one gather of both)
                _, t, first = self.virtual.pop(id(t))
                idx = first[idx]
            g = _gather(t, idx, dim, f"{t.name}.heads{self.h2}")
            gathers.append(g)
            self.gathered[key] = g.outputs[0]
        return self.gathered[key]

    def _grown(self, t: Tensor, dim: int) -> tuple[int, ...]:
        return t.shape[:dim] + (len(self._index(t, dim)),) + t.shape[dim + 1:]

    def _pad_constant(self, t: Tensor, dim: int, zero: bool) -> Tensor:
        """``t`` with ``H' - H`` heads more along ``dim``: zeros, or copies of head 0 (once per
        constant: layers that share their weights, ALBERT's, share the padded ones)."""
        key = (id(t), dim, zero)
        if key not in self.padded_constants:
            self.padded_constants[key] = self._padded_constant(t, dim, zero)
        return self.padded_constants[key]

    def _padded_constant(self, t: Tensor, dim: int, zero: bool) -> Tensor:
        """``t`` along ``dim`` as the ``H'`` heads ``src`` names (with ``zero``, padding: the new
        heads' slices zero, where the heads are summed)."""
        value, idx = np.asarray(t.value), self._index(t, dim)
        name = f"{t.name}.heads{self.h2}" + "_zero" * zero
        if self.pads is None and zero:  # (replicated key/value heads end at their repeat_kv, not in a sum over them)
            raise _Refused(f"the replicated heads are summed with {t.name}")
        out = _take_runs(value, idx, dim)
        if zero:  # (the new heads' slices, at the end or between the old ones)
            index = [slice(None)] * out.ndim
            index[dim] = np.repeat(self.pads, len(idx) // self.h2)
            out[tuple(index)] = 0
        return const_tensor(out, name)

    def _unpad_outputs(self) -> dict[int, Tensor]:
        """Graph outputs of padded (or replicated) heads (a KV cache) taken back to the model's
        ``H`` heads: ``{id(old output): a gather of the padded tensor}``, each gather put after the
        op that writes the padded one (head ``h`` read where the first new head that is not a pad
        copies it). The gather takes the output's name, the padded tensor ``.heads<H'>`` after it."""
        first = {}
        for p, h in enumerate(self.src):
            if self.pads is None or not self.pads[p]:
                first.setdefault(int(h), p)
        keep = np.array([first[h] for h in range(self.h)], np.int64)
        res = {}
        for t in self.graph.outputs:
            if id(t) not in self.axis or id(t) in res:
                continue
            padded, dim = self.new[id(t)], self.axis[id(t)]
            unit = padded.shape[dim] // self.h2
            gather = _gather(padded, (keep[:, None] * unit + np.arange(unit)).reshape(-1), dim, f"{t.name}.unpad")
            padded.name = f"{t.name}.heads{self.h2}"
            gather.outputs[0].name = t.name
            if gather.outputs[0].shape != t.shape:
                raise _Refused(f"the output {t.name} taken back to {self.h} heads is {gather.outputs[0].shape}, "
                               f"not {t.shape}")
            self.rebuilt[id(t.producer)].append(gather)
            res[id(t)] = gather.outputs[0]
        return res

    def _check_readers(self) -> None:
        for tid in self.axis:
            for r in self.consumers.get(tid, ()):
                if id(r) not in self.rebuilt and id(r) not in self.repeats and id(r) not in self.end_expands:
                    raise _Refused(f"{r.name} ({r.op_type}) reads padded heads")


class _Refused(Exception):
    """Why a group is not padded."""


def keep_state_padded(graph: FlowGraph, state: dict[str, str]) -> dict[str, dict]:
    """State pairs (``compile(state=...)``: a KV cache's present kept as the next run's past) whose
    heads :class:`PadHeads` padded or replicated, kept in that layout: the present output is the
    padded tensor itself (not its gather back to the model's heads) and the past input takes the
    padded shape (its gather to the padded heads removed, its readers reading it), so the plan can
    split the cache by heads as it splits the attention (each rank keeping its heads' part, never
    gathered) where a gather back would leave it whole on every rank and reduce it each run.
    Matched: the output a gather (constant indices, along one dim) whose input is of the padded
    shape, the input read only by gathers along that dim with the same indices, which the output's
    undo (``pad[keep]`` is every index in order). Rewrites ``graph``; returns ``{input name:
    {"axis", "index", "shape"}}`` for the pairs rewritten: the padded input's element ``i`` along
    ``axis`` is element ``index[i]`` of the model's input, of shape ``shape``."""
    outputs = dict(zip(graph.output_names, range(len(graph.outputs))))
    inputs = {t.name: t for t in graph.inputs}
    consumers = graph.consumers()
    done: dict[str, dict] = {}
    for out, name in state.items():
        k, x = outputs.get(out), inputs.get(name)
        if k is None or x is None:
            continue
        unpad = graph.outputs[k].producer
        readers = consumers.get(id(x), [])
        keep = _gather_index(unpad)
        pads = [_gather_index(r) for r in readers]
        if keep is None or not readers or any(p is None for p in pads) or consumers.get(id(graph.outputs[k])):
            continue
        axis, pad, padded = unpad.attrs.get("axis", 0), pads[0], unpad.inputs[0]
        if any(r.attrs.get("axis", 0) != axis or not np.array_equal(p, pad) for r, p in zip(readers, pads)) \
                or readers[0].outputs[0].shape != padded.shape \
                or not np.array_equal(pad[keep], np.arange(x.shape[axis])):
            continue
        new = Tensor(x.name, padded.shape, x.dtype)
        graph.inputs = [new if t is x else t for t in graph.inputs]
        gone = {id(r) for r in readers} | {id(unpad)}
        for r in readers:
            for op in consumers.get(id(r.outputs[0]), []):
                op.inputs = [new if t is r.outputs[0] else t for t in op.inputs]
        graph.nodes = [op for op in graph.nodes if id(op) not in gone]
        graph.outputs[k] = padded
        done[name] = {"axis": int(axis), "index": [int(i) for i in pad], "shape": list(x.shape)}
        log.info("heads: state %s -> %s kept on %s heads (%s)", out, name, padded.shape[axis], list(padded.shape))
    return done


def _gather_index(op: Operator | None) -> np.ndarray | None:
    """The indices of ``op`` when it is a ``Gather`` by constant 1-D indices; else None."""
    if op is None or op.op_type != "Gather" or len(op.inputs) != 2 or not op.inputs[1].is_constant:
        return None
    idx = np.asarray(op.inputs[1].value)
    return idx if idx.ndim == 1 else None
