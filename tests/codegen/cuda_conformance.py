"""The ONNX backend node tests through the cuda code generator, run on the host emulation.

Each case the evaluator passes (``tests/frontend/conformance.py``) is imported as the cuda driver
imports a rank's graph on one device, its ops grouped into kernels as ``build_cuda_library`` groups
them (fusion, views), the kernels generated for ``sm_90`` and compiled for the host
(``tests/cuda_host.py``, many cases to one translation unit), and the program run kernel by kernel
(views and ops without a kernel by the evaluator); the graph's outputs are checked against the
case's expected outputs under the conformance tolerance. Classes: passed, wrong (an output
differs; the detail names it), refused (the cuda target refuses an op with a typed
error), error (an untyped exception: a defect), skipped (not run by the evaluator's conformance).

Usage: ``python tests/codegen/cuda_conformance.py [substring ...] [-v]`` prints the counts and,
with ``-v``, every case that is not passed or skipped, with its reason.
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "frontend")]

from conformance import (RANDOM_PASS, _arrays, _import_binding, is_random_case, is_tensor_only,  # noqa: E402
                         node_cases, outputs_mismatch, print_counts)
from cuda_host import build_all, run  # noqa: E402

from shardflow.compiler import ShardflowError  # noqa: E402
from shardflow.compiler.ir.expr import numpy_type  # noqa: E402

#: cases compiled into one host translation unit
BATCH = 400
#: kernels run, by launch kind (over every run_all of the process)
KERNELS_RUN: Counter = Counter()


def _prepare(case, idx: int):
    """``(groups, feeds, outputs, expected, graph)`` of the case's first data set, its ops renamed
    ``c<idx>/...`` (one translation unit holds many cases), or a ``(status, detail)`` pair."""
    from shardflow.compiler.codegen.cuda import kernel_groups
    from shardflow.compiler.driver import OptimizationConfig, _is_view, rank_passes

    if not is_tensor_only(case, sequences=True):
        return "skipped", "not tensor-only"
    graph_inputs = [vi.name for vi in case.model.graph.input
                    if vi.name not in {i.name for i in case.model.graph.initializer}]
    inputs, expected = (_arrays(x) for x in case.data_sets[0])
    if len(inputs) != len(graph_inputs):
        return "skipped", "optional inputs left out of the data set"
    try:
        g, feeds, _ = _import_binding(case, dict(zip(graph_inputs, inputs)))
    except ShardflowError as exc:
        return "skipped", f"not imported: {type(exc).__name__}"
    try:
        g = rank_passes(g, OptimizationConfig.from_dict({"target": "cuda", "arch": "sm_90"}))  # as compile() does
        for op in g.nodes:
            op.name = f"c{idx}/{op.name}"
        ops = list(g.nodes)
        views = [op.name for op in ops if _is_view(op)]
        groups = kernel_groups(ops, "sm_90", keep=[t.name for t in g.outputs], views=views)
    except ShardflowError as exc:
        return "refused", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - untyped: a defect
        return "error", f"{type(exc).__name__} before codegen: {exc}"
    return groups, feeds, [vi.name for vi in case.model.graph.output], expected, g


def _run_case(kernels, src, graph, groups, feeds, out_names, expected, case) -> tuple[str, str]:
    """Run the case's program on the host in the graph's order: each group's kernel at its last
    member (the evaluator for the ops without a kernel: views, ops compiled elsewhere), then check
    the outputs."""
    env = dict(feeds)
    owner = {m.name: grp for grp in groups for m in getattr(grp, "members", [grp])}
    for op in graph.nodes:
        grp = owner.get(op.name)
        members = getattr(grp, "members", [grp])
        launch = src.launches.get(grp.name) if grp is not None else None
        if grp is not None and op is not members[-1]:
            continue  # (fused into the group's kernel)
        if launch is None or 0 in launch.grid:
            for m in members if grp is not None else [op]:
                outs = m.run(*[env[t.name] if t.name in env else t.value for t in m.inputs])
                env.update({t.name: v for t, v in zip(m.outputs, outs)})
            continue
        names = launch.args
        consts = {t.name: t.value for m in members for t in m.inputs if t.value is not None}
        ins = [env[n] if n in env else consts[n] for n in names[:launch.num_inputs]]
        outputs = [_tensor(members, n) for n in names[launch.num_inputs:]]
        outs = run(kernels, launch, ins, [(tuple(t.shape), numpy_type(t.dtype)) for t in outputs])
        env.update(dict(zip(names[launch.num_inputs:], outs)))
        KERNELS_RUN[launch.kind] += 1
    # (by the graph's output names: a sequence output is several, name[0], name[1], ...; or folded at import)
    got = {name: env[t.name] if t.name in env else t.value for name, t in zip(graph.output_names, graph.outputs)}
    why = outputs_mismatch(got, out_names, expected, case)
    if why:
        return "wrong", why
    return RANDOM_PASS if is_random_case(case) else ("passed", "")


def _tensor(members, name: str):
    return next(t for op in members for t in op.outputs if t.name == name)


def _generates(case, groups, results: dict) -> bool:
    """Whether the cuda code generator takes ``groups`` alone; if not, the case's class and reason
    go into ``results``."""
    from shardflow.compiler.codegen.cuda import generate_cuda_source

    try:
        generate_cuda_source(groups, arch="sm_90")
        return True
    except ShardflowError as exc:
        results[case.name] = ("refused", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - untyped: a defect
        results[case.name] = ("error", f"{type(exc).__name__} in codegen: {exc}")
    return False


def run_all(patterns=(), work_dir: str | None = None, every: int = 1, cases=None) -> dict:
    """``{case name: (status, detail)}`` for the node cases matching ``patterns`` (all by default;
    ``every``: one case in that many, in the order of their names), or for ``cases`` (objects with a
    node case's ``name``, ``model``, ``data_sets``, ``rtol`` and ``atol``: tests/fuzz_node_cases.py's)."""
    from shardflow.compiler.codegen.cuda import generate_cuda_source

    work_dir = work_dir or tempfile.mkdtemp(prefix="sf-cuda-conf-")
    results: dict = {}
    ready = []
    cases = sorted((c for c in (node_cases() if cases is None else cases)
                    if not patterns or any(p in c.name for p in patterns)), key=lambda c: c.name)[::every]
    for idx, case in enumerate(cases):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            prep = _prepare(case, idx)
        if isinstance(prep[0], str):
            results[case.name] = prep
        else:
            ready.append((case, prep))
    batches, sources = [], []
    for start in range(0, len(ready), BATCH):
        batch = ready[start:start + BATCH]
        try:
            src = generate_cuda_source([g for _, prep in batch for g in prep[0]], arch="sm_90")
        except Exception:  # noqa: BLE001 - some case's ops: find them one case at a time
            batch = [(case, prep) for case, prep in batch if _generates(case, prep[0], results)]
            src = generate_cuda_source([g for _, prep in batch for g in prep[0]], arch="sm_90")
        batches.append(batch)
        sources.append(src)
    # (-O0: these small kernels run as fast either way, and g++ -O2 takes 3x as long on them)
    for batch, src, kernels in zip(batches, sources, build_all([s.text for s in sources], work_dir, "-O0")):
        for case, (groups, feeds, out_names, expected, graph) in batch:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                try:
                    results[case.name] = _run_case(kernels, src, graph, groups, feeds, out_names, expected, case)
                except Exception as exc:  # noqa: BLE001
                    results[case.name] = ("error", f"{type(exc).__name__} running: {exc}")
    return results


def main(argv):
    print_counts(run_all([a for a in argv if a != "-v"]), "-v" in argv,
                 ("passed", "random", "wrong", "error", "refused", "skipped"), ("passed", "skipped"))
    print("kernels run: " + ", ".join(f"{k} {n}" for k, n in KERNELS_RUN.most_common()))


if __name__ == "__main__":
    main(sys.argv[1:])
