"""Random models (tests/random_models.py) compiled for the cpu target end to end: each program's
native kernels (g++) run by the runtime against onnxruntime, on one rank at every precision
(float32, bfloat16, float16); with a random half of the cpu target's optimizations off; and under
a random sharding plan (every op a random strategy among the candidates the rules give it, as
tests/parallel/test_random_plans.py does on the simulator) on two ranks and on a 2x2 mesh, the
ranks run in one process on threads with in-process communicators. ``-m slow`` (a few seconds a
case on two cores with the kernel cache warm); ``SHARDFLOW_RANDOM_SEEDS=A:B`` runs seeds
``A..B-1`` instead of the default ``0:4``. The reference is onnxruntime with its graph
optimizations off (random_models.reference)."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from random_models import GENERATORS, reference
from threads import run_threads

from shardflow.compiler import compile
from shardflow.compiler.driver import planned_graph
from shardflow.compiler.parallel.config import DistributedConfig
from shardflow.compiler.parallel.plan import ShardingPlan
from shardflow.compiler.parallel.search import Problem
from shardflow.runtime import load
from shardflow.runtime.comm import InProcessWorld

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")]

SEEDS = range(*(int(v) for v in os.environ.get("SHARDFLOW_RANDOM_SEEDS", "0:4").split(":")))

# of the output's largest magnitude; a half model (x float16) is compared at the half tolerance
TOLERANCE = {"float32": 1e-4, "float16": 3e-2, "bfloat16": 6e-2}


def _compare(model, feeds, got: dict, want: dict, precision: str, what: str) -> None:
    half = any(v.dtype == np.float16 for v in feeds.values())
    tol = TOLERANCE["float16"] if half and precision == "float32" else TOLERANCE[precision]
    for o in model.graph.output:
        w, g = np.asarray(want[o.name]), np.asarray(got[o.name])
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {o.name} {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        if w.dtype.kind in "fc":
            w, g = w.astype(np.float32), g.astype(np.float32)
            scale = float(np.abs(w).max()) if w.size else 0.0
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(scale, 1e-6), err_msg=f"{what}: {o.name}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{what}: {o.name}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_model_on_the_cpu_target(tmp_path, kind, seed):
    run_random_model(tmp_path, kind, seed, "cpu")


def run_random_model(tmp_path, kind: str, seed: int, target: str, runs: int = 1) -> None:
    """Compile random model ``kind``/``seed`` for ``target`` on one rank at each precision and compare
    ``runs`` runs of it with onnxruntime."""
    model, feeds, desc = GENERATORS[kind](seed)
    want = reference(model, feeds)
    for precision in ("float32", "bfloat16", "float16"):
        out = tmp_path / precision
        compile(model, distributed_config={"mesh_shape": [1]},
                optimization_config={"target": target, "precision": precision}, out_dir=out)
        prog = load(out)
        for k in range(runs):
            what = f"{kind} {seed} ({desc}) {precision} run {k}"
            _compare(model, feeds, prog.run(dict(feeds)), want, precision, what)


# the cpu target's optimizations that can be turned off (the driver's optimization_config keys)
SWITCHES = ("fuse", "prepack", "winograd", "blocked", "fold_affine", "precompute", "int8_qdq")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_model_with_optimizations_off(tmp_path, kind, seed):
    """The same with a random half of the cpu target's optimizations off, at a random precision: the
    paths a default build does not take (unfused ops, unpacked weights, plain layouts, direct convs)."""
    model, feeds, desc = GENERATORS[kind](seed)
    rng = np.random.default_rng([seed, 7])
    off = {k: False for k in SWITCHES if rng.random() < 0.5}
    precision = ("float32", "bfloat16", "float16")[int(rng.integers(3))]
    compile(model, distributed_config={"mesh_shape": [1]},
            optimization_config={"target": "cpu", "precision": precision, **off}, out_dir=tmp_path / "out")
    _compare(model, feeds, load(tmp_path / "out").run(dict(feeds)), reference(model, feeds), precision,
             f"{kind} {seed} ({desc}) {precision}, off: {sorted(off)}")


@pytest.mark.parametrize("mesh", [[2], [2, 2]], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_plan_on_cpu_ranks(tmp_path, kind, seed, mesh):
    """A random plan (saved, then compiled with ``preload_plan``) on ranks that run the native
    kernels and the collectives it needs; every rank's outputs against onnxruntime."""
    run_random_plan(tmp_path, kind, seed, mesh, {"target": "cpu"})


def run_random_plan(tmp_path, kind: str, seed: int, mesh: list[int], optimization_config: dict) -> None:
    """Compile random model ``kind``/``seed`` under a random plan on ``mesh`` (every op a random strategy
    among its candidates; saved, then given as ``preload_plan``), run its ranks on threads with in-process
    communicators, and compare every rank's outputs with onnxruntime's."""
    model, feeds, desc = GENERATORS[kind](seed)
    want = reference(model, feeds)
    g = planned_graph(model, distributed_config={"mesh_shape": mesh}, optimization_config=optimization_config)
    problem = Problem(g, DistributedConfig.from_dict({"mesh_shape": mesh}))
    rng = np.random.default_rng([seed, len(mesh)])
    assign = {id(op): problem.strategies[id(op)][int(rng.integers(len(problem.strategies[id(op)])))]
              for op in g.nodes}
    plan = ShardingPlan.from_assignment(problem, assign, algo="random")
    plan.save(tmp_path / "plan")
    compile(model, distributed_config={"mesh_shape": mesh, "preload_plan": str(tmp_path / "plan")},
            optimization_config=optimization_config, out_dir=tmp_path / "out")
    world = InProcessWorld(int(np.prod(mesh))).communicators()
    programs = [load(tmp_path / "out", c.rank, c) for c in world]
    outs = run_threads(world, lambda c: programs[c.rank].run(dict(feeds)), timeout=300)
    what = f"{kind} {seed} ({desc}) on {mesh}, {len(plan.collectives)} reshardings"
    for r, got in enumerate(outs):
        _compare(model, feeds, got, want, "float32", f"{what}, rank {r}")
