"""Pipeline stages: the graph cut into contiguous runs of ops, each compiled for its own ranks.

With ``distributed_config["pipeline_stages"] = P`` the first mesh axis (of size ``P``) holds the
stages and the other axes each stage's ranks: on ``mesh_shape = [P, *rest]`` stage ``s`` runs on the
global ranks ``s * W ... s * W + W - 1`` (``W = prod(rest)``), sharded over ``rest`` by the stage's own
plan. :func:`split_stages` cuts the graph's topological order into ``P`` runs whose modeled compute
times are as even as a cut allows (each within :data:`BALANCE_TOLERANCE` of an even share when it
can be), and among those cuts takes the one with the fewest bytes crossing it: in a transformer,
between two layers, where only the residual stream (and the masks every layer reads) cross.

A stage's graph takes the graph inputs its ops read and the tensors earlier stages produce for it
(its *receives*), and returns the tensors later stages read (its *sends*) and the graph outputs it
makes. Each is compiled as any graph is (plan, partition, codegen) into ``out_dir/stage{s}``; the
runtime (:class:`~shardflow.runtime.pipeline.PipelineProgram`) moves the crossing tensors between
the ranks of one position of ``rest`` (rank ``(s, c)`` sends to ``(t, c)``, whole tensors: a stage's
inputs and outputs are replicated over its ranks) in one global order (:attr:`Pipeline.transfers`).
A graph output stays on the ranks of the stage that makes it (what a run returns there); a
launcher that wants them all on rank 0 gathers them once (``shardflow run --outputs``: the
transfers of kind ``output``), not in every run. The stages save memory (each rank holds its
stage's weights) and replace the collectives a split over the first axis would run in every layer
by one send per cut; with ``pipeline_microbatches`` (:func:`microbatch_graph`) a run's batch passes
through them in parts, so that they work at once (rfcs/0001 "Pipeline stages").
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import ShardflowError
from ..ir.graph import FlowGraph, Operator, Tensor
from .cost import H100, DeviceProfile, total_bytes

__all__ = ["Stage", "Pipeline", "split_stages", "op_times", "microbatch_graph", "BALANCE_TOLERANCE"]

log = logging.getLogger(__name__)

#: How far (a fraction of an even share of the modeled time) a cut may move from the even split to
#: find one that fewer bytes cross.
BALANCE_TOLERANCE = 0.1


@dataclass
class Stage:
    """One stage: its graph and what crosses into and out of it.

    Attributes
    ----------
    index
        The stage's position (0 first).
    graph
        Its ops as a graph: inputs are the graph inputs it reads (by their names) then its receives;
        outputs its sends then the graph outputs it makes (by their output names).
    graph_inputs
        Names of the model's inputs the stage reads.
    receives
        ``(name, stage)``: each tensor an earlier stage sends it.
    sends
        ``(name, [stages])``: each tensor it makes that later stages read.
    outputs
        Names of the model's outputs it makes.
    time_s
        Modeled compute time of its ops on one device (the cut's balance).
    ops
        How many of the graph's ops it holds (its part of the node order).
    first_op, last_op
        The names of its first and last op in the graph's order (a saved cut is checked against them).
    remade
        Names of the ops computed from constants alone that an earlier stage holds and this one makes
        again (at its load) instead of receiving their outputs every run: a mask, a fill.
    state
        ``{output name: input name}``: the states (``compile``'s ``state``) whose ops it holds.
    """

    index: int
    graph: FlowGraph
    graph_inputs: list[str]
    receives: list[tuple[str, int]]
    sends: list[tuple[str, list[int]]]
    outputs: list[str]
    time_s: float
    ops: int = 0
    state: dict[str, str] = field(default_factory=dict)
    remade: list[str] = field(default_factory=list)
    first_op: str = ""
    last_op: str = ""


@dataclass
class Pipeline:
    """The stages of a graph and the transfers between them.

    ``transfers``: ``(name, from stage, to stage, kind)`` in the one order every rank performs its
    part of them (a rank receives, runs, then sends): the crossing tensors by sending stage, then by
    the order that stage makes them, then by receiving stage (kind ``cut``). Each rank's own
    transfers are a subsequence of this one order, so blocking sends and receives cannot deadlock.
    Then, apart (the gather of the outputs on rank 0, when a launcher asks for it), each graph
    output a stage other than rank 0's makes, from that stage to rank 0's (stage 0 unless a
    ``rank_map`` places rank 0 elsewhere: :meth:`gather_on`), in the model's output order (kind
    ``output``).
    """

    stages: list[Stage]
    transfers: list[tuple[str, int, int, str]] = field(default_factory=list)
    #: Shape and dtype of every crossing tensor and graph output, by name.
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    #: Shape and dtype of the model's inputs, by name, in its order.
    inputs: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    #: How the cut was chosen, when more than one was weighed (``pipeline_balance`` ``"measured"``).
    note: str | None = None
    #: ``(name, stage making it)`` of each output a run returns (states excepted), in the model's order.
    returned: list[tuple[str, int]] = field(default_factory=list)

    def gather_on(self, stage: int) -> None:
        """The ``output`` transfers: each returned output a stage other than ``stage`` makes, to ``stage``
        (the one holding global rank 0, which gathers them: stage 0 unless a ``rank_map`` puts it elsewhere),
        after the cuts' transfers, in the model's output order."""
        self.transfers = [t for t in self.transfers if t[3] != "output"] + [
            (name, s, stage, "output") for name, s in self.returned if s != stage]

    def transfer_seconds(self, bandwidth_GBps: float | None = None, latency_us: float | None = None,
                         kinds: tuple[str, ...] = ("cut", "output"), from_stage: int | None = None) -> float:
        """Modeled time of the transfers of ``kinds``, one after another, each a message of the
        tensor's bytes over a link of the stages' mesh axis (α + bytes / β; the defaults
        :data:`~.cost.DEFAULT_BANDWIDTH_GBPS` and :data:`~.cost.DEFAULT_LATENCY_US`). Every rank
        of a stage sends its own copy at once, over its own link, so the ranks' count does not enter.
        ``from_stage``: only the transfers that stage sends."""
        from .cost import DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US

        bw = (bandwidth_GBps or DEFAULT_BANDWIDTH_GBPS) * 1e9
        lat = (DEFAULT_LATENCY_US if latency_us is None else latency_us) * 1e-6
        return math.fsum(lat + total_bytes(*self.tensors[n]) / bw for n, a, _, k in self.transfers
                         if k in kinds and from_stage in (None, a))

    def to_dict(self) -> dict:
        """The JSON form written to ``pipeline.json`` (without the graphs)."""
        return {
            "stages": [{"dir": f"stage{st.index}", "graph_inputs": st.graph_inputs,
                        "receives": [{"name": n, "from": s} for n, s in st.receives],
                        "sends": [{"name": n, "to": to} for n, to in st.sends],
                        "outputs": st.outputs, "modeled_time_s": st.time_s, "ops": st.ops,
                        "state": [{"output": o, "input": i} for o, i in st.state.items()],
                        "first_op": st.first_op, "last_op": st.last_op,
                        **({"remade": st.remade} if st.remade else {})}
                       for st in self.stages],
            "transfers": [{"name": n, "from": a, "to": b, "kind": k, "shape": list(self.tensors[n][0]),
                           "dtype": self.tensors[n][1]} for n, a, b, k in self.transfers],
            **({"balance_note": self.note} if self.note else {}),
        }


def constant_ops(nodes) -> set[int]:
    """The ``id`` of each op computed from constants alone (no graph input upstream: fills, ranges, masks
    of constant shape that constant folding left in the graph, and ops reading only them; not a random
    draw, whose values change each run), which a compiled program runs once at load
    (``optimization_config["precompute"]``; ``driver._steps_at_load_first``), not in every run."""
    made: set[int] = set()
    for op in nodes:
        if not op.data_dependent_values and all(
                t.producer is None and t.is_constant or t.producer is not None and id(t.producer) in made
                for t in op.inputs):
            made.add(id(op))
    return made


def constants_beside_readers(graph: FlowGraph) -> FlowGraph:
    """``graph`` with its ops reordered (in place; still topological) so that each op computed from
    constants alone (:func:`constant_ops`) comes right before the first op reading it: a cut between
    contiguous runs of the order then leaves it in its reader's stage, rather than in the first stage
    with its output sent across every cut to the stage reading it in every run (onnx's light VGG-19
    fills its 411 MB weight with a ``ConstantOfShape`` at the top of the graph: 481 MB crossed the cut
    each run). Ops of that kind that no op reads (a graph output) stay where they were."""
    const = constant_ops(graph.nodes)
    if not const:
        return graph
    by_out = {id(t): op for op in graph.nodes for t in op.outputs}
    order, placed = [], set()

    def place(op):
        if id(op) in placed:
            return
        for t in op.inputs:  # (its constant-op producers first)
            p = by_out.get(id(t))
            if p is not None and id(p) in const:
                place(p)
        placed.add(id(op))
        order.append(op)

    readers = {id(t) for op in graph.nodes for t in op.inputs}
    for op in graph.nodes:
        if id(op) in const and any(id(t) in readers for t in op.outputs):
            continue  # (placed before its first reader)
        place(op)
    graph.nodes = order
    return graph


def op_times(graph: FlowGraph, device: DeviceProfile | None = None) -> list[float]:
    """Roofline time of each op of ``graph`` (in node order) on one ``device``: its arithmetic
    (:func:`~.search.op_flops`) against the bytes of its inputs and outputs; none for an op computed
    from constants alone (:func:`constant_ops`: run at load)."""
    from .search import op_flops

    device = device or H100
    const = constant_ops(graph.nodes)
    times = []
    for op in graph.nodes:
        if id(op) in const:
            times.append(0.0)
            continue
        nbytes = sum(total_bytes(t.shape, t.dtype) for t in op.inputs) + sum(
            total_bytes(t.shape, t.dtype) for t in op.outputs)
        times.append(max(op_flops(op) / device.peak_flops, nbytes / device.mem_bandwidth))
    return times


def _crossing_bytes(graph: FlowGraph, const: set[int] = frozenset()) -> list[int]:
    """``res[i]``: bytes of the op outputs made before node ``i`` and read at or after it (what a cut
    before node ``i`` sends; graph outputs are sent wherever they are made, so they do not count; nor do
    the outputs of the ops in ``const``, computed from constants, which a later stage makes again)."""
    n = len(graph.nodes)
    pos = {id(op): i for i, op in enumerate(graph.nodes)}
    last: dict[int, int] = {}
    for i, op in enumerate(graph.nodes):
        for t in op.inputs:
            if t.producer is not None and id(t.producer) in pos and id(t.producer) not in const:
                last[id(t)] = i
    diff = [0] * (n + 2)
    for op in graph.nodes:
        p = pos[id(op)]
        for t in op.outputs:
            end = last.get(id(t))
            if end is not None and end > p:
                b = total_bytes(t.shape, t.dtype)
                diff[p + 1] += b
                diff[end + 1] -= b
    res, acc = [], 0
    for i in range(n + 1):
        acc += diff[i]
        res.append(acc)
    return res


def _cuts(times: list[float], crossing: list[int], stages: int, tolerance: float,
          forbidden: frozenset = frozenset()) -> list[int]:
    """Where stages 1..``stages``-1 start (node indices, increasing, none in ``forbidden``): each cut
    near an even share of the time (within ``tolerance`` of a share), the fewest crossing bytes among
    those, then the nearest to the even split."""
    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    total = prefix[-1]
    share = total / stages
    cuts: list[int] = []
    for k in range(1, stages):
        lo, hi = (cuts[-1] + 1 if cuts else 1), n - (stages - k)  # at least one op per stage
        allowed = [i for i in range(lo, hi + 1) if i not in forbidden]
        if not allowed:
            raise ShardflowError(f"no place for pipeline cut {k} of {stages - 1}: the ops a state joins (its input's "
                                 "readers and its output's maker) leave too few places between them; use fewer stages")
        target = k * share
        window = [i for i in allowed if abs(prefix[i] - target) <= tolerance * share]
        if window:
            best = min(window, key=lambda i: (crossing[i], abs(prefix[i] - target), i))
        else:  # (one op holds more than the tolerance: the nearest cut)
            best = min(allowed, key=lambda i: (abs(prefix[i] - target), i))
        cuts.append(best)
    return cuts


def split_stages(graph: FlowGraph, stages: int, device: DeviceProfile | None = None,
                 tolerance: float = BALANCE_TOLERANCE, state: dict[str, str] | None = None,
                 times: list[float] | None = None, cuts: list[int] | None = None) -> Pipeline:
    """Cut ``graph`` into ``stages`` contiguous runs of its ops (see the module docstring).

    ``times``: each node's time to balance (default :func:`op_times` on ``device``). ``cuts``: where
    stages 1.. start (node indices, increasing), as a saved pipeline gives them, instead of balancing.

    ``state`` (``{output name: input name}``, ``compile``'s): no cut falls between an op reading a
    state's input and the op making its output, so that each state lives in one stage
    (:attr:`Stage.state`), which keeps it between runs as an unstaged program does.

    Raises
    ------
    ShardflowError
        Fewer ops than stages; a graph output that no op makes (a graph input or a constant
        returned as an output); a crossing tensor whose name is a graph input's.
    """
    nodes = graph.nodes
    if stages < 1:
        raise ShardflowError(f"pipeline_stages must be at least 1, got {stages}")
    if len(nodes) < stages:
        raise ShardflowError(f"graph {graph.name!r} has {len(nodes)} ops, fewer than the {stages} pipeline stages; "
                             "use fewer stages")
    in_graph = {id(op) for op in nodes}
    for name, t in zip(graph.output_names, graph.outputs):
        if t.producer is None or id(t.producer) not in in_graph:
            raise ShardflowError(f"graph output {name!r} is {'a constant' if t.is_constant else 'a graph input'}, "
                                 "made by no op: pipeline stages need every output made by an op of some stage")
    times = op_times(graph, device) if times is None else list(times)
    if len(times) != len(nodes):
        raise ShardflowError(f"split_stages: {len(times)} op times for {len(nodes)} ops")
    pos = {id(op): i for i, op in enumerate(nodes)}
    forbidden: set[int] = set()
    outputs_by_name = dict(zip(graph.output_names, graph.outputs))
    for out, name in (state or {}).items():
        at = [i for i, op in enumerate(nodes) if any(t.name == name and t.producer is None for t in op.inputs)]
        at.append(pos[id(outputs_by_name[out].producer)])
        forbidden.update(range(min(at) + 1, max(at) + 1))  # (a cut before node i parts i - 1 from i)
    # ops computed from constants alone (fills, masks) are made again in each later stage reading them,
    # at its load, rather than sent across the cuts every run (Stage.remade)
    const = constant_ops(nodes)
    if cuts is None:
        cuts = _cuts(times, _crossing_bytes(graph, const), stages, tolerance, frozenset(forbidden))
    elif len(cuts) != stages - 1 or not all(a < b for a, b in zip([0] + cuts, cuts + [len(nodes)])):
        raise ShardflowError(f"split_stages: cuts {cuts} do not cut {len(nodes)} ops into {stages} stages")
    elif forbidden.intersection(cuts):
        at = min(forbidden.intersection(cuts))
        raise ShardflowError(f"the cut before op {nodes[at].name!r} parts a state's input from its output (the ops "
                             "a state joins stay in one stage); cut elsewhere")
    bounds = list(zip([0] + cuts, cuts + [len(nodes)]))
    stage_of: dict[int, int] = {}
    for s, (a, b) in enumerate(bounds):
        for op in nodes[a:b]:
            stage_of[id(op)] = s
    # a crossing tensor is sent under the name the stage graphs know it by: its output name when it
    # is a graph output too, else its own
    out_name = {}
    for name, t in zip(graph.output_names, graph.outputs):
        out_name.setdefault(id(t), name)
    input_names = {t.name for t in graph.inputs}
    readers: dict[int, set[int]] = {}  # crossing tensor -> the later stages reading it
    for op in nodes:
        for t in op.inputs:
            if t.producer is not None and id(t.producer) in stage_of and stage_of[id(t.producer)] != stage_of[id(op)] \
                    and id(t.producer) not in const:
                readers.setdefault(id(t), set()).add(stage_of[id(op)])

    def wire_name(t: Tensor) -> str:
        name = out_name.get(id(t), t.name)
        if name in input_names:
            raise ShardflowError(f"tensor {name!r} crosses a pipeline cut but a graph input has its name; rename it")
        return name

    kept = set(state or ())
    crossing_kept = sorted(out_name.get(id(outputs_by_name[o]), o) for o in kept
                           if id(outputs_by_name[o]) in readers)
    if crossing_kept:
        raise ShardflowError(f"state output(s) {crossing_kept} are read by a later pipeline stage than the one making "
                             "them; a state stays in its stage: use fewer stages or no state")
    pipe = Pipeline(stages=[], inputs={t.name: (t.shape, t.dtype) for t in graph.inputs})
    produced_outputs: dict[int, list[str]] = {s: [] for s in range(stages)}
    for name, t in zip(graph.output_names, graph.outputs):
        produced_outputs[stage_of[id(t.producer)]].append(name)
    graph_inputs = {id(t) for t in graph.inputs}
    for s, (a, b) in enumerate(bounds):
        ops, needed = [], {id(t) for t in graph.outputs}
        for op in reversed(nodes[a:b]):  # (an op from constants that only later stages read: made there)
            if id(op) not in const or any(id(t) in needed for t in op.outputs):
                ops.append(op)
                needed.update(id(t) for t in op.inputs)
        ops.reverse()
        mapping: dict[int, Tensor] = {}
        recv_tensors: list[tuple[tuple[int, int, int], Tensor]] = []  # ((from stage, node, output), input)
        remade: list[Operator] = []  # (ops from constants an earlier stage holds, made again here first)

        def clone(op):
            new = op.clone([mapping[id(t)] for t in op.inputs])
            for old_t, new_t in zip(op.outputs, new.outputs):
                new_t.name, new_t.value = old_t.name, old_t.value
                mapping[id(old_t)] = new_t
            return new

        def remake(op):
            for t in op.inputs:
                if id(t) not in mapping:
                    if t.producer is None:
                        mapping[id(t)] = Tensor(t.name, t.shape, t.dtype, None, t.value)
                    else:
                        remake(t.producer)
            remade.append(clone(op))

        for op in ops:
            for t in op.inputs:
                if id(t) in mapping:
                    continue
                if t.producer is None and t.value is not None:  # a constant (shared with the model's graph)
                    mapping[id(t)] = Tensor(t.name, t.shape, t.dtype, None, t.value)
                elif t.producer is not None and id(t.producer) in const and stage_of[id(t.producer)] != s:
                    remake(t.producer)
                elif id(t) in graph_inputs:
                    mapping[id(t)] = Tensor(t.name, t.shape, t.dtype)
                elif t.producer is not None and stage_of.get(id(t.producer), s) != s:
                    name = wire_name(t)
                    mapping[id(t)] = Tensor(name, t.shape, t.dtype)
                    key = (stage_of[id(t.producer)], pos[id(t.producer)], t.producer.outputs.index(t))
                    recv_tensors.append((key, mapping[id(t)]))
                    pipe.tensors[name] = (t.shape, t.dtype)
        g_inputs = [mapping[id(t)] for t in graph.inputs if id(t) in mapping]
        recv_tensors.sort(key=lambda e: e[0])
        receives = [(x.name, key[0]) for key, x in recv_tensors]
        new_nodes: list[Operator] = remade + [clone(op) for op in ops]
        sends: list[tuple[str, list[int]]] = []
        outs: list[Tensor] = []
        names: list[str] = []
        for op in ops:
            for t in op.outputs:
                if id(t) in readers:
                    name = wire_name(t)
                    sends.append((name, sorted(readers[id(t)])))
                    outs.append(mapping[id(t)])
                    names.append(name)
        for name, t in zip(graph.output_names, graph.outputs):
            if stage_of[id(t.producer)] == s and name not in names:
                outs.append(mapping[id(t)])
                names.append(name)
            if stage_of[id(t.producer)] == s:
                pipe.tensors[name] = (t.shape, t.dtype)
        sg = FlowGraph(g_inputs + [x for _, x in recv_tensors], outs, new_nodes, names, name=f"{graph.name}.stage{s}")
        sg.meta = dict(graph.meta)
        sg.validate()
        pipe.stages.append(Stage(index=s, graph=sg, graph_inputs=[t.name for t in g_inputs], receives=receives,
                                 sends=sends, outputs=produced_outputs[s], time_s=math.fsum(times[a:b]),
                                 ops=b - a, remade=[op.name for op in remade], first_op=nodes[a].name,
                                 last_op=nodes[b - 1].name,
                                 state={o: i for o, i in (state or {}).items() if o in produced_outputs[s]}))
    for st in pipe.stages:
        for name, to in st.sends:
            pipe.transfers.extend((name, st.index, d, "cut") for d in to)
    pipe.returned = [(name, stage_of[id(t.producer)]) for name, t in zip(graph.output_names, graph.outputs)
                     if name not in kept]  # (a state stays in its stage's program)
    pipe.gather_on(0)
    log.info("pipeline: %d stages of %s ops, modeled %s ms; %d tensors cross the cuts (%s bytes)", stages,
             [st.ops for st in pipe.stages], [round(st.time_s * 1e3, 3) for st in pipe.stages],
             sum(len(st.sends) for st in pipe.stages),
             f"{sum(total_bytes(*pipe.tensors[n]) for st in pipe.stages for n, _ in st.sends):,}")
    return pipe


def _same_array(a, b) -> bool:
    """Equal arrays: the same memory (a whole weight every part reads), or the same bytes."""
    if a is b:
        return True
    ia, ib = a.__array_interface__, b.__array_interface__
    if (ia["data"], ia["strides"], a.shape, a.dtype) == (ib["data"], ib["strides"], b.shape, b.dtype):
        return True
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == \
        np.ascontiguousarray(b).tobytes()


def microbatch_graph(graph: FlowGraph, microbatches: int) -> FlowGraph:
    """The graph of one of ``microbatches`` equal parts of ``graph``'s batch: dim 0 of every input and
    output divided by ``microbatches``, the ops rebuilt for those shapes (reshape targets included).

    It is found as a sharding of ``graph`` over a mesh of ``microbatches`` positions whose inputs and
    outputs are split along dim 0 and which runs no collective (searched with communication priced
    out of reach), partitioned (:func:`~.partition.partition`): each position's graph computes its
    part of the outputs from its part of the inputs alone, exactly as a rank does. Every position's
    graph must then be the same graph (ops, attributes and constants), so that one compiled program
    runs every microbatch.

    Raises
    ------
    ShardflowError
        An input or output whose dim 0 does not divide by ``microbatches``; a graph whose samples
        are not computed apart (the collective the split would need, and where); positions whose
        graphs differ (a constant with a row per sample, an op that depends on where in the batch
        it is).
    """
    from ..passes.simplify import attr_key
    from .partition import partition_ranks
    from .search import search

    if microbatches == 1:
        return graph
    for name, t in [(t.name, t) for t in graph.inputs] + list(zip(graph.output_names, graph.outputs)):
        if not t.shape or t.shape[0] % microbatches:
            raise ShardflowError(f"pipeline_microbatches = {microbatches}: {name!r} has shape {list(t.shape)}, whose "
                                 f"dim 0 (the batch every input and output is split along) does not divide into "
                                 f"{microbatches} equal parts; use a count that divides it")
    cfg = {"mesh_shape": [microbatches], "alias_layers": True, "partial_sums": False,
           "input_placements": {t.name: "S(0)" for t in graph.inputs},
           "output_placements": {n: "S(0)" for n in graph.output_names},
           # any collective dearer than any plan without one: the search finds one if there is one
           "axis_bandwidth_GBps": 1e-9, "axis_latency_us": 1e12,
           "device": {"name": "microbatches", "peak_tflops": 1.0, "mem_bandwidth_GBps": 1.0}}
    plan = search(graph, cfg)
    if plan.collectives:
        c = plan.collectives[0]
        raise ShardflowError(f"pipeline_microbatches = {microbatches}: the model does not compute the samples of its "
                             f"batch (dim 0 of the inputs) apart: {c.consumer} reads {c.tensor!r} across the batch "
                             f"(the split would need {len(plan.collectives)} collective(s), the first: "
                             f"{c.kind.replace('_', '-')}); compile without microbatches")
    ranks = partition_ranks(graph, plan, sharded_inputs=[t.name for t in graph.inputs])  # (each its part)
    first = next(ranks)

    def same(a: FlowGraph, b: FlowGraph) -> str | None:
        """Where ``b`` differs from ``a`` (an op's name), or None."""
        if [(t.name, t.shape, t.dtype) for t in a.inputs] != [(t.name, t.shape, t.dtype) for t in b.inputs] \
                or [t.shape for t in a.outputs] != [t.shape for t in b.outputs] or len(a.nodes) != len(b.nodes):
            return "its inputs or outputs"
        for x, y in zip(a.nodes, b.nodes):
            if (x.op_type, x.name, [t.shape for t in x.outputs]) != (y.op_type, y.name, [t.shape for t in y.outputs]) \
                    or attr_key(x.attrs) != attr_key(y.attrs) or len(x.inputs) != len(y.inputs):
                return x.name
            for s, t in zip(x.inputs, y.inputs):
                cs, ct = s.is_constant and s.producer is None, t.is_constant and t.producer is None
                if cs != ct or (s.shape, s.dtype) != (t.shape, t.dtype):
                    return x.name
                if cs and not _same_array(s.value, t.value):
                    return x.name
        return None

    for j, g in enumerate(ranks, 1):
        where = same(first, g)
        if where is not None:
            raise ShardflowError(f"pipeline_microbatches = {microbatches}: microbatch {j}'s graph differs from "
                                 f"microbatch 0's at {where} (a constant with a row per sample, or an op that "
                                 "depends on where in the batch it is), so one program cannot run them all; compile "
                                 "without microbatches")
    first.meta = dict(graph.meta)
    first.name = f"{graph.name}.microbatch"
    log.info("pipeline: %d microbatches of %s", microbatches,
             ", ".join(f"{t.name} {list(t.shape)}" for t in first.inputs))
    return first
