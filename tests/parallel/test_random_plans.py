"""Random plans: every op of an exported test model takes a random strategy among the candidates
the rules give it (partial sums included), on 1-D and 2-D meshes with uneven splits; whatever the
plan, ``simulate(partition(g, plan))`` computes what onnxruntime does. The searched plans
(test_models_parallel.py) visit a few of these combinations; random ones reach the reshardings
between any two specs that ``connect`` builds, chained through whole models."""
import json
import os

import numpy as np
import onnxruntime as ort
import pytest

from shardflow.compiler import load_onnx
from shardflow.compiler.parallel import partition, simulate
from shardflow.compiler.parallel.config import DistributedConfig
from shardflow.compiler.parallel.plan import ShardingPlan
from shardflow.compiler.parallel.search import Problem

MODELS = os.path.join(os.path.dirname(__file__), "..", "models")
EXPORTS = {e["file"]: e for e in json.load(open(os.path.join(MODELS, "MANIFEST.json")))["exports"]
           if e["status"] == "ok" and "_ts" in e["file"]}


@pytest.mark.parametrize("mesh", [[2], [3], [2, 2]], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("file", sorted(EXPORTS), ids=lambda f: f[:-5])
def test_random_plans_compute_the_model(file, mesh):
    path = os.path.join(MODELS, file)
    feeds = dict(np.load(os.path.join(MODELS, EXPORTS[file]["inputs_file"])))
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    g = load_onnx(path)
    problem = Problem(g, DistributedConfig.from_dict({"mesh_shape": mesh}))
    rng = np.random.default_rng(len(mesh) * 10 + mesh[0])
    for trial in range(3):
        assign = {id(op): problem.strategies[id(op)][int(rng.integers(len(problem.strategies[id(op)])))]
                  for op in g.nodes}
        plan = ShardingPlan.from_assignment(problem, assign, algo="random")
        assert plan.collectives, "a random plan reshards somewhere"
        got = simulate(partition(g, plan), feeds, plan.mesh)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-3, atol=1e-3 * float(np.abs(w).max()),
                                       err_msg=f"trial {trial}: {name}")
