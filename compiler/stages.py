"""``compile`` with ``pipeline_stages``: the model cut into stages, each compiled for its own ranks.

``out_dir`` holds ``pipeline.json`` and one ordinary out_dir per stage, ``stage0``, ``stage1``, ...
(each with its ``mesh.json``, ``plan.json`` and ``rank{c}`` folders for the stage's ``W`` ranks);
global rank ``s * W + c`` runs ``stage{s}/rank{c}``. :func:`shardflow.runtime.load` of such an
out_dir returns a :class:`~shardflow.runtime.pipeline.PipelineProgram`. The cut is
:func:`~shardflow.compiler.parallel.pipeline.split_stages`'s; rfcs/0001 "Pipeline stages".
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from shardflow.runtime import __version__
from shardflow.runtime.artifact import atomic_output_dir, write_json
from shardflow.runtime.pipeline import PIPELINE_FILE, PIPELINE_FORMAT, PIPELINE_VERSION

from .errors import ConfigError, ShardflowError

__all__ = ["StagesResult", "compile_stages", "plan_stages", "choose_stages"]

log = logging.getLogger(__name__)


@dataclass
class StagesResult:
    """What :func:`~shardflow.compiler.compile` produced with ``pipeline_stages`` > 1.

    Attributes
    ----------
    out_dir
        The written out_dir (``pipeline.json`` and one folder per stage).
    stages
        Per stage, its :class:`~shardflow.compiler.CompileResult` (paths inside ``out_dir``; its
        ``plan`` is the stage's).
    pipeline
        ``pipeline.json``'s content.
    world_size, target, arch
        As compiled (``world_size``: all stages' ranks).
    timings
        Seconds: ``cut`` and the stages' own timings summed, ``total``.
    """

    out_dir: Path
    stages: list
    pipeline: dict
    world_size: int
    target: str
    arch: str | None
    timings: dict[str, float]

    @property
    def plan(self):
        """Not one plan: each stage has its own (:attr:`plans`)."""
        raise AttributeError("a pipeline's stages each have a plan: use .plans (or .stages[s].plan)")

    @property
    def plans(self) -> list:
        """Each stage's :class:`~shardflow.compiler.parallel.ShardingPlan`."""
        return [r.plan for r in self.stages]

    @property
    def rank_dirs(self) -> list[Path]:
        """The folder of every global rank, in rank order."""
        return [d for r in self.stages for d in r.rank_dirs]

    @property
    def ranks(self) -> list[dict]:
        """Per global rank: number of kernels, collectives, arena and weight bytes."""
        return [info for r in self.stages for info in r.ranks]

    def summary(self) -> str:
        """A few lines for humans."""
        m = self.pipeline["modeled_s"]
        micro = self.pipeline.get("microbatches", 1)
        lines = [f"compiled {len(self.stages)} pipeline stages for {self.world_size} rank(s) (target {self.target}"
                 f"{f', {micro} microbatches a run' if micro > 1 else ''}) into {self.out_dir}",
                 "  " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items()),
                 f"  modeled run {m['total'] * 1e6:.4g} us: the stages' plans "
                 f"{', '.join(f'{x * 1e6:.4g}' for x in m['stages'])} us a {'microbatch' if micro > 1 else 'run'}, "
                 f"cut transfers {m['cut_transfers'] * 1e6:.4g} (gathering the outputs on rank 0: "
                 f"{m['outputs_to_rank0'] * 1e6:.4g})"]
        for s, (res, st) in enumerate(zip(self.stages, self.pipeline["stages"])):
            sends = ", ".join(f"{e['name']} -> {e['to']}" for e in st["sends"]) or "none"
            lines.append(f"== stage {s}: {st['ops']} ops (roofline {st['modeled_time_s'] * 1e3:.3g} ms on one device); "
                         f"sends {sends}")
            lines.append(res.summary())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def measured_op_times(graph, optimization_config, device=None, repeat: int = 5, ranks: int = 1) -> list[float]:
    """Each op's time (seconds, in ``graph``'s node order) measured on this machine: ``graph`` compiled
    for one cpu rank into a temporary folder and profiled (:func:`_timing_inputs`'s inputs)
    by ``shardflow run --nproc 1 --profile-json`` (``repeat`` runs, medians) with the threads a rank gets
    when ``ranks`` ranks share this machine's cores (as ``shardflow run --nproc ranks`` starts them: ops
    scale differently with threads, so a stage is timed as it will run). A kernel is named after the
    last op it computes; its time is spread over the ops since the kernel before it (those it fused, and
    views that run no kernel) in proportion to their roofline times (:func:`~.parallel.pipeline.op_times`
    on ``device``), a kernel whose op the graph does not hold (a part of a split projection is named
    after it, ``#part``) counting toward the next one that does."""
    import subprocess
    import sys
    import tempfile

    import numpy as np

    from shardflow.runtime.launch import _threads_per_rank

    from .driver import _compile
    from .parallel.pipeline import op_times

    with tempfile.TemporaryDirectory(prefix="shardflow-balance-") as tmp:
        one = Path(tmp) / "one"
        _compile(graph, distributed_config={"mesh_shape": [1], "algo": "replicate"},
                 optimization_config=optimization_config, out_dir=one, input_shapes=None, input_values=None,
                 state=None)
        entries = json.loads((one / "rank0" / "manifest.json").read_text())["inputs"]
        np.savez(Path(tmp) / "inputs.npz", **_timing_inputs(entries))
        env = dict(os.environ, OMP_NUM_THREADS=_threads_per_rank(ranks))
        proc = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "run", str(one), "--nproc", "1",
                               "--launcher", "spawn", "--inputs", str(Path(tmp) / "inputs.npz"), "--repeat",
                               str(repeat), "--profile-json", str(Path(tmp) / "profile.json")],
                              capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode:
            raise ShardflowError(f"pipeline_balance 'measured': timing the graph's kernels failed "
                                 f"({proc.stderr[-2000:]})")
        steps = json.loads((Path(tmp) / "profile.json").read_text())["ranks"][0]
    times = spread_kernel_times(graph, steps, op_times(graph, device))
    log.info("pipeline: measured %d kernels, %.4g ms a run (%s threads)", len(steps), math.fsum(times) * 1e3,
             env["OMP_NUM_THREADS"])
    return times


def _timing_inputs(entries: list[dict]) -> dict:
    """Inputs to time a program on (its manifest's ``entries``): integer and boolean inputs all ones,
    moved into the range the program checks them against (token ids: 1 is inside every table of two rows or
    more; a mask of ones attends everywhere, where zeros would make a position computed from its sum, as
    onnxruntime-genai's ``seqlens_k`` is, fall outside its axis and the run refuse itself), the others
    zeros."""
    import numpy as np

    from shardflow.runtime.artifact import buffer_dtype

    res = {}
    for e in entries:
        dtype = buffer_dtype(e["dtype"])
        if dtype.kind in "iub":
            checks = e.get("index_checks") or [(1, 1)]  # (lo, hi[, op]) each
            value = min(max(1, max(int(c[0]) for c in checks)), min(int(c[1]) for c in checks))
            res[e["name"]] = np.full(e["shape"], value, dtype)
        else:
            res[e["name"]] = np.zeros(e["shape"], dtype)
    return res


def spread_kernel_times(graph, steps, roof: Sequence[float]) -> list[float]:
    """Each op's share of the profiled ``steps`` (``RankProgram.profile``'s records: ``node``, ``ms``), in
    ``graph``'s node order: a kernel's time goes to the ops since the kernel before it by their shares of
    ``roof`` (their roofline times); a kernel named after no op of the graph counts toward the next one
    that is (a split projection's ``#part`` kernels are named after their op); kernels after the last op
    found go to the ops after it."""
    at = {op.name: i for i, op in enumerate(graph.nodes)}
    times = [0.0] * len(graph.nodes)

    def spread(span, total):
        weight = math.fsum(roof[k] for k in span)
        for k in span:
            times[k] += total * (roof[k] / weight if weight else 1.0 / len(span))

    done, carry = -1, 0.0  # (the last op a kernel's time went to; time not placed yet)
    for st in steps:
        i = at.get(st["node"], at.get(str(st["node"]).split("#part")[0]))
        carry += st["ms"] * 1e-3
        if i is None:
            continue
        spread(range(done + 1, i + 1) if i > done else range(i, i + 1), carry)
        done, carry = max(done, i), 0.0
    if carry:
        spread(range(done + 1, len(graph.nodes)) if done + 1 < len(graph.nodes) else range(done, done + 1), carry)
    return times


#: how much faster the measured cut's slowest stage program must time than the roofline cut's to be kept:
#: runs a few minutes apart differ by a few percent (onnx's light VGG-19: 96.6 against 97.5 ms at compile,
#: 110.4 against 102.1 ms a run in the pipeline; ResNet-50's 28.2 against 34.1 ms held, 28.7 against 35.5)
MEASURED_MARGIN = 0.05


def _measured_cut(graph, dcfg, optimization_config, state, times, ranks: int):
    """``pipeline_balance: "measured"``: the cut on the ops' measured ``times``, checked against the cut on
    roofline times by timing each cut's stage programs (compiled and profiled as :func:`measured_op_times`
    does): the ops' times within the whole graph's program do not say what a stage's own program takes,
    since a cut changes what the stages compile (DenseNet-121's concatenations in place and its blocked
    layout across a cut: a stage slower than its ops' times). The measured cut is kept when its slowest
    stage program is :data:`MEASURED_MARGIN` faster, else the roofline one; the note says why."""
    from .parallel.pipeline import split_stages

    first = split_stages(graph, dcfg.pipeline_stages, dcfg.device, state=state)
    second = split_stages(graph, dcfg.pipeline_stages, dcfg.device, state=state, times=times)
    if [st.ops for st in first.stages] == [st.ops for st in second.stages]:
        second.note = f"the measured times cut where the roofline times do: {[st.ops for st in second.stages]} ops"
        return second
    slowest = []
    for pipe in (first, second):
        slowest.append(max(math.fsum(measured_op_times(st.graph, optimization_config, dcfg.device, ranks=ranks))
                           for st in pipe.stages))
    kept = second if slowest[1] < (1 - MEASURED_MARGIN) * slowest[0] else first
    kept.note = (f"stage programs timed here: the cut on roofline times ({[st.ops for st in first.stages]} ops) "
                 f"{slowest[0] * 1e3:.4g} ms its slowest stage, on measured times ({[st.ops for st in second.stages]} "
                 f"ops) {slowest[1] * 1e3:.4g} ms: kept the {'measured' if kept is second else 'roofline'} one "
                 f"(the measured one when {MEASURED_MARGIN:.0%} faster: timings here vary by a few percent)")
    log.info("pipeline: %s", kept.note)
    return kept


def _cut(model, dcfg, opt, input_shapes, input_values, state, dim_sizes, optimization_config,
         measured: dict | None = None) -> tuple:
    """Import, the state checked, the microbatch's graph, the cut: ``(pipeline, whole, state, timings,
    plans)`` (``whole``: shape and dtype of every model input and output at the whole batch). With
    microbatches the cut is balanced again on the stages' plans (:func:`_rebalanced`, with
    ``optimization_config``, what the stages are planned with), and ``plans`` are the kept stages'
    plans; else ``None`` (none made). With ``pipeline_balance`` ``"measured"`` the cut balances the ops'
    measured times (:func:`measured_op_times`; ``measured``: those already measured, by microbatch count),
    checked against the roofline cut on the stage programs' times (:func:`_measured_cut`), and is not
    balanced again."""
    from .driver import _check_state, _import_for
    from .parallel.pipeline import constants_beside_readers, microbatch_graph, split_stages

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    graph = _import_for(model, opt, input_shapes, input_values, dim_sizes)
    timings["import"] = time.perf_counter() - t0
    # what a run takes and returns: the whole batch, whatever the microbatches
    whole = {t.name: (t.shape, t.dtype) for t in graph.inputs}
    whole.update((n, (t.shape, t.dtype)) for n, t in zip(graph.output_names, graph.outputs))
    micro = dcfg.pipeline_microbatches
    state = _check_state(graph, state, input_values)
    _check_stage_placements(dcfg, graph, state)
    # (with microbatches each state is split along dim 0 as every input and output is: a stage's ranks keep an
    # instance of its program per microbatch, each with its rows: runtime/pipeline.py)
    t0 = time.perf_counter()
    graph = constants_beside_readers(microbatch_graph(graph, micro))
    if dcfg.preload_plan:  # (the saved cut, each stage's plan loaded by its compile)
        pipe = split_stages(graph, dcfg.pipeline_stages, dcfg.device, state=state, cuts=saved_cut(dcfg, graph))
        timings["cut"] = time.perf_counter() - t0
        return pipe, whole, state, timings, None
    times = None
    if dcfg.pipeline_balance == "measured":
        if opt.target != "cpu":
            raise ConfigError(f"distributed_config['pipeline_balance'] = 'measured' times the ops on this machine's "
                              f"cpu; the {opt.target} target's are not timed at compile time: use 'modeled'")
        measured = {} if measured is None else measured
        ranks = math.prod(dcfg.mesh_shape)  # (timed with the threads a rank of the whole world gets here)
        if micro not in measured:
            measured[micro] = measured_op_times(graph, optimization_config, dcfg.device, ranks=ranks)
        times = measured[micro]
        pipe = _measured_cut(graph, dcfg, optimization_config, state, times, ranks)
        timings["measure"] = time.perf_counter() - t0
    else:
        pipe = split_stages(graph, dcfg.pipeline_stages, dcfg.device, state=state)
    plans = None
    if micro > 1 and times is None:
        pipe, plans = _rebalanced(graph, pipe, dcfg, optimization_config, state)
    timings["cut"] = time.perf_counter() - t0
    return pipe, whole, state, timings, plans


def _check_stage_placements(dcfg, graph, state: Mapping[str, str]) -> None:
    """With stages, ``input_placements`` name model inputs (each on the mesh of the stage reading it) and
    ``output_placements`` only the outputs of ``state`` (kept by their stage, never gathered): an output a
    run returns is gathered whole from its stage, so a placement of it is a :class:`ConfigError`."""
    inputs = {t.name for t in graph.inputs}
    for name in dcfg.input_placements:
        if name not in inputs:
            raise ConfigError(f"distributed_config['input_placements'] names {name!r}, which is not an input of the "
                              f"model (its inputs: {sorted(inputs)})")
    for name in dcfg.output_placements:
        if name not in state:
            raise ConfigError(f"distributed_config['output_placements'][{name!r}]: with pipeline_stages a run's "
                              "outputs are gathered whole from the stage making them; only a state's output (kept by "
                              f"its stage) takes a placement (the states: {sorted(state) or 'none'})")


def _stage_plans(pipe, dcfg, optimization_config) -> list:
    """Each stage's plan (a microbatch's), as ``compile`` plans it (its states kept split where the plan
    splits their writers: :func:`~.driver.plan_with_state`)."""
    from .driver import plan_with_state, planned_graph

    plans = []
    for st in pipe.stages:
        sub = _stage_config(dcfg, st)
        with _naming_stage(st, len(pipe.stages)):
            graph = planned_graph(st.graph, distributed_config=sub, optimization_config=optimization_config)
            plans.append(plan_with_state(graph, sub, st.state or None)[0])
    return plans


@contextlib.contextmanager
def _naming_stage(st, stages: int):
    """A :class:`ShardflowError` raised while planning or compiling stage ``st`` says which stage (its type
    and traceback kept): a stage's mesh is not the config's."""
    try:
        yield
    except ShardflowError as exc:
        if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("pipeline stage "):
            what = " (it keeps states)" if st.state else ""
            exc.args = (f"pipeline stage {st.index} of {stages}{what}: {exc.args[0]}",) + exc.args[1:]
        raise


def _stage_config(dcfg, st):
    """The config stage ``st`` is planned with: ``dcfg.stage_config()``, its ranks holding an instance of its
    program per microbatch when it keeps states (a KV cache, its rows a microbatch's: runtime/pipeline.py),
    which its plan's memory counts (each instance's activations and states; the parameters once)."""
    import dataclasses

    # (placements on the stage's mesh: of the model inputs it reads, and of the state outputs it keeps; a
    # saved pipeline's stage plan in its folder)
    return dataclasses.replace(
        dcfg.stage_config(keeps_states=bool(st.state) and int(dcfg.pipeline_microbatches) > 1),
        input_placements={k: v for k, v in dcfg.input_placements.items() if k in st.graph_inputs},
        output_placements={k: v for k, v in dcfg.output_placements.items() if k in st.state},
        preload_plan=str(Path(dcfg.preload_plan) / f"stage{st.index}") if dcfg.preload_plan else None)


#: The file ``shardflow plan --stages P -o DIR`` writes beside the stages' plans: the cut, which
#: ``preload_plan`` reads back (as it reads a staged out_dir's ``pipeline.json``).
STAGE_PLANS_FILE, STAGE_PLANS_FORMAT, STAGE_PLANS_VERSION = "stages.json", "shardflow-stage-plans", 1


def write_stage_plans(folder: str | os.PathLike, pipe, plans, dcfg) -> None:
    """Each stage's plan into ``folder/stage{s}`` and the cut into ``folder/stages.json``: what
    ``preload_plan`` takes with ``pipeline_stages`` (the cut, then each stage's plan)."""
    folder = Path(folder)
    for st, plan in zip(pipe.stages, plans):
        plan.save(folder / f"stage{st.index}")
    write_json(folder / STAGE_PLANS_FILE, {"format": STAGE_PLANS_FORMAT, "version": STAGE_PLANS_VERSION,
                                           "mesh_shape": list(dcfg.mesh_shape),
                                           "microbatches": int(dcfg.pipeline_microbatches),
                                           "stages": pipe.to_dict()["stages"]})


def saved_cut(dcfg, graph) -> list[int]:
    """``preload_plan`` with ``pipeline_stages``: where the saved pipeline's stages 1.. start in ``graph``'s
    order (a microbatch's graph, its ops from constants beside their readers, as the cut is made), read
    from the folder's ``stages.json`` (``shardflow plan --stages P -o DIR``) or ``pipeline.json`` (a
    staged out_dir). Its stages, microbatches and mesh must be the config's and its stages' first and last
    ops this graph's there, else a :class:`ConfigError` saying what differs."""
    from shardflow.runtime.artifact import read_versioned
    from shardflow.runtime.pipeline import read_pipeline

    folder, n, micro = Path(dcfg.preload_plan), int(dcfg.pipeline_stages), int(dcfg.pipeline_microbatches)
    key = f"distributed_config['preload_plan'] = {str(folder)!r}"
    if (folder / PIPELINE_FILE).is_file():
        where, spec = folder / PIPELINE_FILE, read_pipeline(folder)
    elif (folder / STAGE_PLANS_FILE).is_file():
        where = folder / STAGE_PLANS_FILE
        spec = read_versioned(where, "stages' plans", STAGE_PLANS_FORMAT, STAGE_PLANS_VERSION)
    else:
        raise ConfigError(f"{key} with pipeline_stages = {n}: give the folder `shardflow plan --stages {n} -o DIR` "
                          f"wrote ({STAGE_PLANS_FILE} and a plan per stage) or a staged out_dir ({PIPELINE_FILE}); "
                          "it has neither")
    try:
        stages = spec["stages"]
        counts = [int(st["ops"]) for st in stages]
        ends = [(str(st["first_op"]), str(st["last_op"])) for st in stages]
        saved = (len(stages), int(spec.get("microbatches", 1)), [int(d) for d in spec["mesh_shape"]])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: {str(where)!r} does not say where the stages are cut ({type(exc).__name__}: "
                          f"{exc}); plan or compile again with this version of Shardflow") from None
    given = (n, micro, list(dcfg.mesh_shape))
    for what, a, b in zip(("pipeline_stages", "pipeline_microbatches", "mesh_shape"), saved, given):
        if a != b:
            raise ConfigError(f"{key} was planned with {what} {a}, the config gives {b}: its plans are for "
                              f"{'a microbatch' if what == 'pipeline_microbatches' else 'a stage'} of that; give the "
                              "same, or plan again")
    starts = [sum(counts[:k]) for k in range(len(counts))]
    fits = sum(counts) == len(graph.nodes) and all(
        graph.nodes[a].name == first and graph.nodes[a + c - 1].name == last
        for a, c, (first, last) in zip(starts, counts, ends))
    if not fits:
        here = [op.name for op in graph.nodes]
        raise ConfigError(f"{key}: its cut ({counts} ops, stage 0 from {ends[0][0]!r}) does not fit this model's graph "
                          f"({len(here)} ops from {here[0] if here else None!r}): it was planned for another model or "
                          "other shapes or options; plan again")
    return starts[1:]


def _rebalanced(graph, pipe, dcfg, optimization_config, state) -> tuple:
    """``(pipeline, its stages' plans)``. With microbatches a run goes at its slowest stage's pace, and the
    cut balanced roofline times on one device, which the stages' plans (their splits, their budgets) do
    not keep: each stage planned, its ops' times scaled by its plan's cost over their roofline sum, the
    graph cut again on those, the new stages planned; the cut whose slowest stage (plan and sends) is
    faster is kept. A stage the budget refuses keeps the first cut (plans ``None`` when it is the
    first cut's: ``compile`` says why)."""
    from .parallel.pipeline import op_times, split_stages

    def slowest(p, plans):
        return max(_modeled(p, [x.cost for x in plans], dcfg)["per_stage"])
    try:
        plans = _stage_plans(pipe, dcfg, optimization_config)
    except ShardflowError:
        return pipe, None
    times = op_times(graph, dcfg.device)
    scaled, at = [], 0
    for st, plan in zip(pipe.stages, plans):
        part = times[at:at + st.ops]
        total = sum(part)
        scaled += [t * plan.cost / total for t in part] if total else part
        at += st.ops
    again = split_stages(graph, dcfg.pipeline_stages, dcfg.device, state=state, times=scaled)
    if [st.ops for st in again.stages] == [st.ops for st in pipe.stages]:
        return pipe, plans
    try:
        plans2 = _stage_plans(again, dcfg, optimization_config)
    except ShardflowError as exc:
        log.info("pipeline: the cut balanced on the stages' plans is refused (%s); keeping the first", exc)
        return pipe, plans
    before, after = slowest(pipe, plans), slowest(again, plans2)
    log.info("pipeline: slowest stage %.4g us a microbatch with the cut on roofline times (%s ops), %.4g us "
             "balanced on the stages' plans (%s ops): keeping the %s", before * 1e6, [st.ops for st in pipe.stages],
             after * 1e6, [st.ops for st in again.stages], "second" if after < before else "first")
    return (again, plans2) if after < before else (pipe, plans)


def _modeled(pipe, costs: Sequence[float], dcfg) -> dict:
    """The modeled time of a run of ``pipe`` whose stages' plans cost ``costs`` (seconds, a microbatch):
    a microbatch's time in each stage is its plan's cost and its sends; the microbatches follow each other,
    so a run is every stage once (the first microbatch) and the slowest stage m - 1 times more."""
    bw = dcfg.axis_bandwidth_GBps[0] if dcfg.axis_bandwidth_GBps else None
    lat = dcfg.axis_latency_us[0] if dcfg.axis_latency_us else None
    micro = dcfg.pipeline_microbatches
    per = [c + pipe.transfer_seconds(bw, lat, ("cut",), s) for s, c in enumerate(costs)]
    return {"stages": list(costs), "per_stage": per, "cut_transfers": pipe.transfer_seconds(bw, lat, ("cut",)),
            "total": math.fsum(per) + (micro - 1) * max(per),
            "outputs_to_rank0": pipe.transfer_seconds(bw, lat, ("output",)) * micro}


#: the most microbatches ``pipeline_microbatches: "auto"`` weighs
MAX_AUTO_MICROBATCHES = 16


def _microbatch_counts(model, opt, input_shapes, input_values, dim_sizes) -> list[int]:
    """The counts of microbatches ``"auto"`` weighs: the divisors, up to :data:`MAX_AUTO_MICROBATCHES`, of
    the batch every input and output has along dim 0 (their sizes' greatest common divisor)."""
    from .driver import _import_for

    graph = _import_for(model, opt, input_shapes, input_values, dim_sizes)
    batch = 0
    for t in list(graph.inputs) + list(graph.outputs):
        batch = math.gcd(batch, int(t.shape[0]) if t.shape else 1)
    return [m for m in range(1, min(batch, MAX_AUTO_MICROBATCHES) + 1) if batch % m == 0] or [1]


def choose_stages(model, *, dcfg, opt, optimization_config, input_shapes, input_values, state, dim_sizes,
                  options: list | None = None):
    """``pipeline_stages`` or ``pipeline_microbatches`` ``"auto"``: ``(config, note)``, the config ``compile``
    goes on with and a line saying why. Planned: with stages ``"auto"``, one plan over the whole mesh and,
    for each count of stages ``P`` > 1 that divides the first mesh axis, the cut into ``P`` stages with each
    stage's plan over its share of the mesh (else the ``P`` given); with microbatches ``"auto"``, each
    staged option at every count of microbatches dividing the batch (:func:`_microbatch_counts`; else the
    count given). The one of least modeled time (:func:`_modeled`: with ``m`` microbatches, every stage
    once and the slowest ``m - 1`` times more, each microbatch reading the stage's weights again) is kept;
    a plan the budget or the device's memory refuses, or a cut or a split into microbatches the model
    refuses, is out of the running, with its reason in the note. ``compile`` then plans the one kept
    again, as it would have with that config given (the compile is the same). ``options``: a list that
    gets every option weighed, ``(what, config, modeled seconds or inf, why refused or None)``
    (``shardflow plan`` prints them)."""
    import dataclasses

    from .driver import _planned_graph
    from .parallel import search

    options = [] if options is None else options  # (what, config, modeled s, why refused)
    errors: list[ShardflowError] = []  # (the refusals' errors)
    if dcfg.pipeline_stages == "auto":
        flat = dataclasses.replace(dcfg, pipeline_stages=1, pipeline_microbatches=1)
        try:
            cost = search(_planned_graph(model, opt, flat, input_shapes, input_values, dim_sizes), flat).cost
            options.append((f"one plan over mesh {list(dcfg.mesh_shape)}", flat, cost, None))
        except ShardflowError as exc:
            options.append((f"one plan over mesh {list(dcfg.mesh_shape)}", flat, math.inf, str(exc)))
            errors.append(exc)
        counts = [n for n in range(2, int(dcfg.mesh_shape[0]) + 1) if dcfg.mesh_shape[0] % n == 0]
    else:
        counts = [int(dcfg.pipeline_stages)]
    micros = (_microbatch_counts(model, opt, input_shapes, input_values, dim_sizes)
              if dcfg.pipeline_microbatches == "auto" else [int(dcfg.pipeline_microbatches)])
    measured: dict = {}  # (pipeline_balance 'measured': each microbatch graph timed once, whatever the stages)
    for n in counts:
        for m in micros:
            staged = dataclasses.replace(dcfg, pipeline_stages=n, pipeline_microbatches=m)
            many = dcfg.pipeline_microbatches == "auto" or m > 1
            what = f"{n} stages over {list(staged.stage_config().mesh_shape)}" + (
                f", {m} microbatch{'es' if m > 1 else ''}" if many else "")
            try:
                pipe, *_, plans = _cut(model, staged, opt, input_shapes, input_values, state, dim_sizes,
                                       optimization_config, measured)
                plans = plans or _stage_plans(pipe, staged, optimization_config)
                options.append((what, staged, _modeled(pipe, [p.cost for p in plans], staged)["total"], None))
            except ShardflowError as exc:
                options.append((what, staged, math.inf, str(exc)))
                errors.append(exc)
    best = min(options, key=lambda o: o[2])
    said = "; ".join(f"{w} {'refused (' + why + ')' if why else f'{t * 1e6:.4g} us'}" for w, _, t, why in options)
    keys = " and ".join(f"{k} 'auto'" for k in ("pipeline_stages", "pipeline_microbatches")
                        if getattr(dcfg, k) == "auto")
    if math.isinf(best[2]):
        if all(isinstance(e, ConfigError) for e in errors):  # (the config is wrong whatever the choice: say so)
            raise ConfigError(f"{keys} on mesh {list(dcfg.mesh_shape)}: every option refuses the config: {said}")
        raise ShardflowError(f"{keys} on mesh {list(dcfg.mesh_shape)}: nothing fits: {said}")
    note = f"{keys}: {best[0]} (modeled runs: {said})"
    log.info("%s", note)
    return best[1], note


def _stage_ranks(dcfg, stages: int, width: int) -> list[list[int]]:
    """The global ranks of each stage in its own rank order: stage ``s`` holds the mesh positions whose
    first coordinate is in its run of the first axis, which in row-major order are positions ``s * width``
    to ``(s + 1) * width - 1`` (the stage's mesh numbers them alike), each the rank ``rank_map`` gives it
    (default: its position)."""
    from .parallel.mesh import DeviceMesh

    mesh = DeviceMesh(dcfg.mesh_shape, dcfg.mesh_axis_names, dcfg.rank_map)  # (a bad rank_map: ConfigError)
    return [[int(mesh.rank_map[p]) for p in range(s * width, (s + 1) * width)] for s in range(stages)]


def compile_stages(model, *, dcfg, opt, optimization_config, out_dir: str | os.PathLike,
                   input_shapes: Mapping[str, Sequence[int]] | None, input_values: Mapping[str, Any] | None,
                   state: Mapping[str, str] | None, dim_sizes: Mapping[str, int] | None,
                   note: str | None = None) -> StagesResult:
    """:func:`~shardflow.compiler.compile` for ``dcfg.pipeline_stages`` > 1 (``dcfg``, ``opt``:
    the validated configs): import, cut, then each stage compiled as an ordinary graph on
    ``dcfg.stage_config()``'s mesh into ``out_dir/stage{s}``; the whole written under a temporary
    name and renamed at the end. ``note``: why stages (``pipeline_stages = "auto"``), kept in
    ``pipeline.json``."""
    from .driver import _compile

    t_all = time.perf_counter()
    ranks = _stage_ranks(dcfg, int(dcfg.pipeline_stages), math.prod(dcfg.stage_config().mesh_shape))
    # (with microbatches the cut's rebalance planned the stages: _compile plans them again, so that each
    # stage compiles as any graph does)
    pipe, whole, state, timings, _ = _cut(model, dcfg, opt, input_shapes, input_values, state, dim_sizes,
                                          optimization_config)
    micro = dcfg.pipeline_microbatches
    results = []
    out = Path(out_dir)
    with atomic_output_dir(out) as tmp:
        for st in pipe.stages:
            log.info("pipeline stage %d of %d: %d ops", st.index, len(pipe.stages), len(st.graph.nodes))
            with _naming_stage(st, len(pipe.stages)):
                res = _compile(st.graph, distributed_config=_stage_config(dcfg, st),
                               optimization_config=optimization_config, out_dir=tmp / f"stage{st.index}",
                               input_shapes=None, input_values=None, state=st.state or None)
            st.graph = None  # (compiled: its weights may go)
            results.append(res)
            for k, v in res.timings.items():
                if k != "total":
                    timings[k] = timings.get(k, 0.0) + v
        _check_pins_matched(dcfg, [r.plan for r in results])
        stage_world = results[0].world_size
        # the ranges the stages read their inputs as indices in, checked on every rank before a run (so that
        # all refuse a bad one, not only the stage reading it while the others wait on its sends)
        ranges: dict[str, list] = {}
        for res in results:
            for e in json.loads((res.out_dir / "rank0" / "manifest.json").read_text())["inputs"]:
                if e["name"] in pipe.inputs and e.get("index_checks"):
                    ranges.setdefault(e["name"], []).extend(e["index_checks"])
        pipe.gather_on(next(s for s, r in enumerate(ranks) if 0 in r))  # (global rank 0's stage, a rank_map's)
        modeled = _modeled(pipe, [r.plan.cost for r in results], dcfg)
        body = pipe.to_dict()
        body["ranks"] = ranks
        for e in body["transfers"]:
            if e["kind"] == "output":  # (gathered whole: every microbatch's rows)
                e["shape"] = list(whole[e["name"]][0])
        spec = {"format": PIPELINE_FORMAT, "version": PIPELINE_VERSION, "shardflow_version": __version__,
                "target": opt.target, "world_size": stage_world * len(results), "stage_world_size": stage_world,
                "mesh_shape": list(dcfg.mesh_shape), "microbatches": micro, "balance": dcfg.pipeline_balance,
                "inputs": [{"name": n, "shape": list(whole[n][0]), "dtype": whole[n][1],
                            **({"index_checks": ranges[n]} if n in ranges else {}),
                            **({"state": True} if n in state.values() else {})} for n in pipe.inputs],
                "outputs": [{"name": n, "shape": list(whole[n][0]), "dtype": whole[n][1], "stage": s}
                            for s, st in enumerate(pipe.stages) for n in st.outputs if n not in state],
                "modeled_s": modeled, **({"note": note} if note else {}), **body}
        write_json(tmp / PIPELINE_FILE, spec)
    timings["total"] = time.perf_counter() - t_all
    out = out.resolve()
    for res in results:  # (their paths as they are now, inside out_dir)
        name = res.out_dir.name
        res.out_dir = out / name
        res.rank_dirs = [out / name / d.name for d in res.rank_dirs]
    log.info("wrote %s: %d stages of %d rank(s) in %.2f s", out, len(results), stage_world, timings["total"])
    return StagesResult(out_dir=out, stages=results, pipeline=spec, world_size=spec["world_size"],
                        target=opt.target, arch=results[0].arch, timings=timings)


def plan_stages(model, *, distributed_config: Mapping[str, Any], optimization_config: Mapping[str, Any] | None = None,
                input_shapes: Mapping[str, Sequence[int]] | None = None,
                input_values: Mapping[str, Any] | None = None, dim_sizes: Mapping[str, int] | None = None,
                state: Mapping[str, str] | None = None):
    """The cut and each stage's plan that :func:`~shardflow.compiler.compile` makes for these
    arguments (``shardflow plan --stages``; ``state`` as ``compile``'s): ``(pipeline, plans)``, a
    :class:`~shardflow.compiler.parallel.pipeline.Pipeline` and one
    :class:`~shardflow.compiler.parallel.ShardingPlan` per stage."""
    from .driver import OptimizationConfig, planning_config

    dcfg = planning_config(distributed_config, optimization_config)
    if not dcfg.staged:
        raise ConfigError("plan_stages needs distributed_config['pipeline_stages'] > 1")
    if dcfg.pipeline_microbatches == "auto":
        raise ConfigError("plan_stages with pipeline_microbatches 'auto': compile decides (its note in pipeline.json "
                          "says why); plan with a number of microbatches")
    opt = OptimizationConfig.from_dict(optimization_config)
    pipe, *_, plans = _cut(model, dcfg, opt, input_shapes, input_values, state, dim_sizes, optimization_config)
    plans = plans or _stage_plans(pipe, dcfg, optimization_config)
    _check_pins_matched(dcfg, plans)
    return pipe, plans


def _check_pins_matched(dcfg, plans) -> None:
    """Each pattern of ``op_placements`` named an op of some stage (a stage's search takes the patterns
    naming none of its ops as another stage's)."""
    from .parallel.pins import KEY, matching_ops

    for pattern in dcfg.op_placements:
        if not any(matching_ops(list(p.op_specs), pattern) for p in plans):
            raise ConfigError(f"{KEY}: {pattern!r} names no op of any pipeline stage (ops are named as plan.txt "
                              "prints them: `shardflow plan MODEL --mesh ... --stages P`; a pattern takes *, ? "
                              "and [...])")
