"""ShardingPlan: the chosen spec of every op and tensor, the resharding between them, and costs.

``plan.json`` is written deterministically (graph order, sorted keys) so that two searches of
the same graph and config give byte-identical files; ``plan.txt`` is the readable form, one line
per op: its inputs' specs → its outputs' specs, and its cost terms.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError, ShardflowError
from ..ir.graph import FlowGraph
from .connect import connect
from .mesh import DeviceMesh
from .placement import TensorShardSpec
from .rules import OFFSET_ROWS, PARTIAL_SUMS, OpShardSpec

if TYPE_CHECKING:
    from .search import Problem

__all__ = ["ShardingPlan", "Collective", "Reshard", "PLAN_FORMAT"]

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Collective:
    """One communication the plan performs."""

    kind: str               # all_reduce | all_gather | reduce_scatter | all_to_all
    mesh_axes: tuple[int, ...]
    bytes: int
    tensor: str
    consumer: str           # op name, or "output:<name>"


@dataclass(frozen=True)
class Reshard:
    """Turning ``tensor`` from ``src`` into ``dst`` for input ``index`` of ``consumer``."""

    tensor: str
    consumer: str
    index: int
    src: TensorShardSpec
    dst: TensorShardSpec
    steps: tuple
    cost: float


class ShardingPlan:
    """A spec for every op and tensor of a graph on a mesh, with the modeled cost.

    Attributes
    ----------
    mesh : DeviceMesh
    algo : str
        ``ilp`` or the baseline that produced it.
    op_specs : dict[str, OpShardSpec]
        By op name, in graph order.
    tensor_specs : dict[str, TensorShardSpec]
        The spec every non-constant tensor is produced in.
    reshards : list[Reshard]
        Every input whose produced spec differs from the spec its consumer needs.
    cost, compute_cost, comm_cost : float
        Modeled seconds.
    params_bytes, peak_activation_bytes : int
        Per-rank memory estimate; ``memory_bytes`` is ``params_bytes + instances * peak_activation_bytes``
        (``instances``: the program's copies a rank holds, each with its own activations and the
        parameters shared; more than 1 for a pipeline stage keeping states with microbatches).
    """

    def __init__(self, mesh: DeviceMesh, algo: str, op_specs: dict[str, OpShardSpec],
                 tensor_specs: dict[str, TensorShardSpec], reshards: list[Reshard], cost: float,
                 compute_cost: float, comm_cost: float, params_bytes: int, peak_activation_bytes: int,
                 op_types: dict[str, str], output_specs: dict[str, TensorShardSpec],
                 input_specs: dict[str, TensorShardSpec], search_seconds: float = 0.0,
                 bandwidth: tuple | None = None, latency: tuple | None = None, device=None):
        from .cost import H100

        self.mesh = mesh
        self.algo = algo
        self.op_specs = op_specs
        self.tensor_specs = tensor_specs
        self.reshards = reshards
        self.cost = cost
        self.compute_cost = compute_cost
        self.comm_cost = comm_cost
        self.params_bytes = params_bytes
        self.peak_activation_bytes = peak_activation_bytes
        self.op_types = op_types
        self.output_specs = output_specs
        self.input_specs = input_specs
        self.search_seconds = search_seconds
        self.bandwidth = bandwidth
        self.latency = latency
        self.device = device or H100  # the cost model's DeviceProfile
        #: lines the search adds to plan.txt (what a baseline left whole, and why)
        self.notes: list[str] = []
        #: ``{op name: its pin}`` for the ops ``op_placements`` fixed (``pins.py``)
        self.pinned: dict[str, str] = {}
        #: the ranks the graph's attention heads were padded for before the plan (passes/heads.py;
        #: 1: not padded): a preloaded plan's graph is padded alike
        self.pad_heads = 1
        #: instances of the program a rank holds (``DistributedConfig.program_instances``)
        self.instances = 1

    def cost_model(self):
        """The cost model the plan was made with (connect orders multi-axis steps by it)."""
        from .cost import CostModel

        return CostModel(self.mesh, axis_bandwidth_GBps=self.bandwidth, axis_latency_us=self.latency,
                         device=self.device)

    @property
    def memory_bytes(self) -> int:
        return self.params_bytes + self.instances * self.peak_activation_bytes

    @property
    def collectives(self) -> list[Collective]:
        """Every collective the plan runs (local slices and local partials are not collectives)."""
        res = []
        for r in self.reshards:
            for st in r.steps:
                if st.kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                    res.append(Collective(st.kind, (st.mesh_axis,), int(st.bytes), r.tensor, r.consumer))
        return res

    # construction -------------------------------------------------------------------------
    @classmethod
    def from_assignment(cls, problem: "Problem", assign: dict[int, OpShardSpec], algo: str,
                        search_seconds: float = 0.0) -> "ShardingPlan":
        g = problem.graph
        total, comp, comm = problem.total_cost(assign)
        params, peak = problem.memory(assign)
        op_specs = {op.name: assign[id(op)] for op in g.nodes}
        tensor_specs: dict[str, TensorShardSpec] = {t.name: problem.input_specs[t.name] for t in g.inputs}
        for op in g.nodes:
            for t, sp in zip(op.outputs, assign[id(op)].output_specs):
                tensor_specs[t.name] = sp
        reshards = []
        for op in g.nodes:
            for k, (t, dst) in enumerate(zip(op.inputs, assign[id(op)].input_specs)):
                src = problem.source_spec(t, assign)
                if src is not None and src != dst:
                    reshards.append(_reshard(problem.mesh, problem.cost_model, t, op.name, k, src, dst))
        for name, t, dst in zip(g.output_names, g.outputs, problem.output_specs):
            src = problem.source_spec(t, assign)
            if src is not None and src != dst:
                reshards.append(_reshard(problem.mesh, problem.cost_model, t, f"output:{name}", 0, src, dst))
        plan = cls(problem.mesh, algo, op_specs, tensor_specs, reshards, total, comp, comm, params, peak,
                   {op.name: op.op_type for op in g.nodes},
                   dict(zip(g.output_names, problem.output_specs)), dict(problem.input_specs), search_seconds,
                   problem.cost_model.bandwidth_GBps, problem.cost_model.latency_us, problem.cost_model.device)
        plan.instances = problem.cfg.program_instances
        return plan

    # persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "algo": self.algo,
            "mesh": self.mesh.to_dict(),
            "axis_bandwidth_GBps": list(self.bandwidth) if self.bandwidth else None,
            "axis_latency_us": list(self.latency) if self.latency else None,
            "device": {"name": self.device.name, "peak_flops": self.device.peak_flops,
                       "mem_bandwidth": self.device.mem_bandwidth, "memory_bytes": self.device.memory_bytes},
            "cost_s": _num(self.cost),
            "compute_cost_s": _num(self.compute_cost),
            "comm_cost_s": _num(self.comm_cost),
            "params_bytes": int(self.params_bytes),
            "peak_activation_bytes": int(self.peak_activation_bytes),
            "inputs": {k: str(v) for k, v in self.input_specs.items()},
            "outputs": {k: str(v) for k, v in self.output_specs.items()},
            "ops": [
                {"name": name, "type": self.op_types[name],
                 "inputs": [str(s) for s in sp.input_specs], "outputs": [str(s) for s in sp.output_specs],
                 "reductions": [[list(r) for r in red] for red in sp.reductions],
                 "assignment": list(sp.assignment), "parallelism": sp.parallelism,
                 "compute_cost_s": _num(sp.compute_cost)}
                for name, sp in self.op_specs.items()
            ],
            "tensors": {k: str(v) for k, v in self.tensor_specs.items()},
            "notes": list(self.notes),
            **({"pinned": dict(self.pinned)} if self.pinned else {}),
            "pad_heads": int(self.pad_heads),
            **({"instances": int(self.instances)} if self.instances != 1 else {}),
            "reshards": [
                {"tensor": r.tensor, "consumer": r.consumer, "index": r.index, "src": str(r.src), "dst": str(r.dst),
                 "cost_s": _num(r.cost),
                 "steps": [{"kind": st.kind, "mesh_axis": st.mesh_axis, "bytes": int(st.bytes)} for st in r.steps]}
                for r in self.reshards
            ],
        }

    def save(self, directory: str | os.PathLike) -> tuple[str, str]:
        """Write ``plan.json`` and ``plan.txt`` into ``directory`` (atomically); return their paths."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        paths = []
        for name, text in (("plan.json", json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"),
                           ("plan.txt", self.to_text())):
            path = os.path.join(directory, name)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
            paths.append(path)
        return paths[0], paths[1]

    @classmethod
    def load(cls, path: str | os.PathLike, graph: FlowGraph | None = None) -> "ShardingPlan":
        """Read a ``plan.json`` (or a folder holding one). With ``graph``, check that the plan
        belongs to it: same op names and types, and every op spec one the rules allow."""
        path = plan_file(path)
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"preload_plan: {path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"preload_plan: {path} is not a readable plan.json ({exc})") from None
        if d.get("format") != PLAN_FORMAT:
            raise ConfigError(f"{path}: plan format {d.get('format')!r}, this Shardflow reads {PLAN_FORMAT}")
        try:
            mesh = DeviceMesh.from_dict(d["mesh"])
            parse = TensorShardSpec.parse
            op_specs, types = {}, {}
            for o in d["ops"]:
                op_specs[o["name"]] = OpShardSpec(
                    tuple(parse(s) for s in o["inputs"]), tuple(parse(s) for s in o["outputs"]),
                    tuple(tuple((int(m), str(op)) for m, op in red) for red in o["reductions"]),
                    tuple(o["assignment"]), int(o["parallelism"]), float(o["compute_cost_s"]))
                types[o["name"]] = o["type"]
            plan = cls(mesh, d["algo"], op_specs, {k: parse(v) for k, v in d["tensors"].items()}, [],
                       float(d["cost_s"]), float(d["compute_cost_s"]), float(d["comm_cost_s"]),
                       int(d["params_bytes"]), int(d["peak_activation_bytes"]), types,
                       {k: parse(v) for k, v in d["outputs"].items()}, {k: parse(v) for k, v in d["inputs"].items()},
                       0.0, d.get("axis_bandwidth_GBps"), d.get("axis_latency_us"), _device(d.get("device")))
            plan.notes = [str(n) for n in d.get("notes", ())]
            plan.pad_heads = int(d.get("pad_heads", 1))
            plan.instances = int(d.get("instances", 1))
            plan.pinned = {str(k): str(v) for k, v in d.get("pinned", {}).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: malformed plan.json ({type(exc).__name__}: {exc})") from None
        if graph is not None:
            plan._check_graph(graph, path)
            plan._find_reshards(graph)
        return plan

    def _find_reshards(self, graph: FlowGraph) -> None:
        """The reshardings of a loaded plan on ``graph`` (plan.json lists them, but the ops' and
        tensors' specs are what partition follows; so does plan.txt's list of collectives)."""
        cm = self.cost_model()
        produced = {id(t): self.tensor_specs.get(t.name) for op in graph.nodes for t in op.outputs}
        inputs = {id(t): self.input_specs.get(t.name) for t in graph.inputs}

        def add(t, consumer, k, dst):
            src = None if t.is_constant else produced.get(id(t), inputs.get(id(t)))
            if src is not None and src != dst:
                self.reshards.append(_reshard(self.mesh, cm, t, consumer, k, src, dst))

        self.reshards = []
        for op in graph.nodes:
            for k, (t, dst) in enumerate(zip(op.inputs, self.op_specs[op.name].input_specs)):
                add(t, op.name, k, dst)
        for name, t in zip(graph.output_names, graph.outputs):
            if name in self.output_specs:
                add(t, f"output:{name}", 0, self.output_specs[name])

    def _check_graph(self, graph: FlowGraph, path: str) -> None:
        from .rules import op_strategies

        names = [op.name for op in graph.nodes]
        if set(names) != set(self.op_specs):
            missing = sorted(set(names) - set(self.op_specs))[:5]
            extra = sorted(set(self.op_specs) - set(names))[:5]
            raise ConfigError(f"{path}: the plan is for another graph (ops missing from the plan: {missing}, "
                              f"ops not in the graph: {extra}); re-plan without preload_plan")
        for op in graph.nodes:
            sp = self.op_specs[op.name]
            allowed = {(s.input_specs, s.output_specs) for s in op_strategies(op, self.mesh.shape)}
            nd = len(self.mesh.shape)
            if all(p.__class__.__name__ == "Replicate" for s in sp.input_specs + sp.output_specs
                   for p in s.placements) and all(len(s.placements) == nd for s in sp.input_specs):
                continue
            if (sp.input_specs, sp.output_specs) not in allowed:
                raise ConfigError(f"{path}: op {op.name} ({op.op_type}) has spec {sp}, which its compute "
                                  "definition does not allow; the plan is stale")

    # reports ---------------------------------------------------------------------------
    def _links_text(self) -> str:
        """The links the plan was priced on, and whether they are the defaults (NVLink-like guesses)."""
        from .cost import DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US

        cm = self.cost_model()
        text = "links: " + ", ".join(f"{n} {bw:g} GB/s, {lat:g} us a step"
                                     for n, bw, lat in zip(self.mesh.axis_names, cm.bandwidth_GBps, cm.latency_us))
        if all(bw == DEFAULT_BANDWIDTH_GBPS for bw in cm.bandwidth_GBps) and \
                all(lat == DEFAULT_LATENCY_US for lat in cm.latency_us):
            text += (" (the defaults; axis_bandwidth_GBps and axis_latency_us, or `shardflow calibrate`, "
                     "give your machine's: the plan depends on them)")
        return text

    def to_text(self) -> str:
        lines = [
            f"# Shardflow plan ({self.algo}) on mesh {list(self.mesh.shape)} {list(self.mesh.axis_names)}",
            f"# modeled cost {self.cost * 1e6:.2f} us = compute {self.compute_cost * 1e6:.2f} us "
            f"+ communication {self.comm_cost * 1e6:.2f} us (device {self.device.name}: "
            f"{self.device.peak_flops / 1e12:g} TFLOP/s, {self.device.mem_bandwidth / 1e9:g} GB/s)",
            f"# memory per rank: {self.params_bytes:,} B parameters + "
            + (f"{self.instances} instances of the program (a pipeline stage keeping states, one a microbatch) x "
               if self.instances != 1 else "")
            + f"{self.peak_activation_bytes:,} B peak activations"
            + (f" (the device holds {self.device.memory_bytes:,.0f} B)" if self.device.memory_bytes else ""),
            "# collectives: " + (", ".join(f"{k}×{v}" for k, v in sorted(self._collective_counts().items()))
                                  or "none"),
        ]
        if self.mesh.size > 1:
            lines.append("# " + self._links_text())
        if self.algo.startswith("ilp") and self.mesh.size > 1 and all(
                v is None for sp in self.op_specs.values() for v in sp.assignment):
            lines.append("# every op runs whole on every rank: under the cost model, splitting any work would cost "
                         "more in collectives than it saves at these sizes; memory_budget_bytes bounds each "
                         "rank's memory, algo megatron splits the weight products")
        lines.extend(f"# {note}" for note in self.notes)
        incoming: dict[str, list[Reshard]] = {}
        for r in self.reshards:
            incoming.setdefault(r.consumer, []).append(r)
        width = max((len(n) for n in self.op_specs), default=4)
        for name, sp in self.op_specs.items():
            comm = sum(r.cost for r in incoming.get(name, []))
            steps = "; ".join(f"in{r.index}: {r.src}->{r.dst} via " + "+".join(_step_text(s) for s in r.steps)
                              for r in incoming.get(name, []))
            lines.append(f"{name:<{width}}  {self.op_types[name]:<14} {', '.join(map(str, sp.input_specs))} -> "
                         f"{', '.join(map(str, sp.output_specs))}  compute={sp.compute_cost * 1e6:.3f}us"
                         f" comm={comm * 1e6:.3f}us" + (f"  [{steps}]" if steps else ""))
        for name, spec in self.output_specs.items():
            for r in incoming.get(f"output:{name}", []):
                lines.append(f"output {name}: {r.src}->{r.dst} via " + "+".join(_step_text(s) for s in r.steps)
                             + f" comm={r.cost * 1e6:.3f}us")
        return "\n".join(lines) + "\n"

    def _collective_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for c in self.collectives:
            counts[c.kind] = counts.get(c.kind, 0) + 1
        return counts

    def explain(self, node: str) -> str:
        """Why ``node`` (an op name) runs as it does: its spec, what each mesh axis splits, its
        costs and the resharding of its inputs."""
        if node not in self.op_specs:
            close = [n for n in self.op_specs if node in n][:5]
            raise ShardflowError(f"no op named {node!r} in the plan" + (f"; similar: {close}" if close else ""))
        sp = self.op_specs[node]
        lines = [f"{node} ({self.op_types[node]}): {sp}"]
        if node in self.pinned:
            lines.append(f"  pinned by op_placements to {self.pinned[node]!r}: the search chose among the "
                         "strategies that run it so")
        for m, v in enumerate(sp.assignment):
            axis = self.mesh.axis_names[m]
            what = ("works on partial sums (a linear op: partial inputs, partial output)" if v == PARTIAL_SUMS
                    else "splits an input into row ranges read through data indices (partial output)"
                    if v == OFFSET_ROWS else f"splits loop variable {v}" if v else "work replicated")
            lines.append(f"  mesh axis {axis} (size {self.mesh.shape[m]}): {what}")
        for k, red in enumerate(sp.reductions):
            for m, op in red:
                lines.append(f"  output {k} is Partial({op}) over mesh axis {self.mesh.axis_names[m]}; "
                             "its consumers resolve it (all-reduce or reduce-scatter)")
        lines.append(f"  compute: {sp.compute_cost * 1e6:.3f} us (work split {sp.parallelism} ways)")
        for r in self.reshards:
            if r.consumer == node:
                lines.append(f"  input {r.index} ({r.tensor}): {r.src} -> {r.dst} costs {r.cost * 1e6:.3f} us: "
                             + ", ".join(_step_text(s) for s in r.steps))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ShardingPlan({self.algo}, mesh={list(self.mesh.shape)}, cost={self.cost * 1e6:.2f}us, "
                f"{len(self.collectives)} collectives, memory={self.memory_bytes:,}B)")


def plan_file(path: str | os.PathLike) -> str:
    """The ``plan.json`` that ``path`` names: the file, or the one in the folder."""
    path = os.fspath(path)
    return os.path.join(path, "plan.json") if os.path.isdir(path) else path


def _reshard(mesh, cost_model, t, consumer, index, src, dst) -> Reshard:
    r = connect(src, dst, t.shape, t.dtype, mesh, cost_model)
    return Reshard(t.name, consumer, index, src, dst, tuple(r.steps), float(r.cost))


def _step_text(st) -> str:
    return f"{st.kind}(axis {st.mesh_axis})"


def _num(x: float) -> float:
    return float(f"{x:.9g}")


def _device(d):
    """The DeviceProfile a plan.json records (None for plans written before it did: the H100)."""
    if d is None:
        return None
    from .cost import DeviceProfile

    mem = d.get("memory_bytes")  # (plans written before session 104 have none)
    return DeviceProfile(str(d["name"]), float(d["peak_flops"]), float(d["mem_bandwidth"]),
                         float(mem) if mem is not None else None)
