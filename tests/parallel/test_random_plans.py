"""Random plans: every op of an exported test model (or of a random model, tests/random_models.py)
takes a random strategy among the candidates the rules give it (partial sums included), on 1-D and
2-D meshes with uneven splits; whatever the plan, ``simulate(partition(g, plan))`` computes what
onnxruntime does. The searched plans (test_models_parallel.py) visit a few of these combinations;
random ones reach the reshardings between any two specs that ``connect`` builds, chained through
whole models."""
import json
import os

import numpy as np
import onnxruntime as ort
import pytest

from random_models import GENERATORS, reference

from shardflow.compiler import load_onnx
from shardflow.compiler.parallel import partition, simulate
from shardflow.compiler.parallel.config import DistributedConfig
from shardflow.compiler.parallel.plan import ShardingPlan
from shardflow.compiler.parallel.search import Problem

MODELS = os.path.join(os.path.dirname(__file__), "..", "models")
EXPORTS = {e["file"]: e for e in json.load(open(os.path.join(MODELS, "MANIFEST.json")))["exports"]
           if e["status"] == "ok" and "_ts" in e["file"]}


def _random_plans(g, feeds, want, mesh, seed, trials, must_reshard=True):
    problem = Problem(g, DistributedConfig.from_dict({"mesh_shape": mesh}))
    rng = np.random.default_rng(seed)
    for trial in range(trials):
        assign = {id(op): problem.strategies[id(op)][int(rng.integers(len(problem.strategies[id(op)])))]
                  for op in g.nodes}
        plan = ShardingPlan.from_assignment(problem, assign, algo="random")
        assert plan.collectives or not must_reshard, "a random plan reshards somewhere"
        got = simulate(partition(g, plan), feeds, plan.mesh)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-3, atol=1e-3 * float(np.abs(w).max()),
                                       err_msg=f"trial {trial}: {name}")


@pytest.mark.parametrize("mesh", [[2], [3], [2, 2]], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("file", sorted(EXPORTS), ids=lambda f: f[:-5])
def test_random_plans_compute_the_model(file, mesh):
    path = os.path.join(MODELS, file)
    feeds = dict(np.load(os.path.join(MODELS, EXPORTS[file]["inputs_file"])))
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    _random_plans(load_onnx(path), feeds, want, mesh, len(mesh) * 10 + mesh[0], 3)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_plans_of_random_models(kind, seed):
    """The same on random models in float32 (convs of every shape, products, attention blocks),
    two plans on each of [2], [3], [2, 3]."""
    model, feeds, desc = GENERATORS[kind](seed)
    if feeds["x"].dtype != np.float32:
        feeds = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
        model = _float32(model)
    want = reference(model, feeds)
    for mesh in ([2], [3], [2, 3]):
        _random_plans(load_onnx(model), feeds, want, mesh, seed, 2, must_reshard=False)


def _float32(model):
    """``model`` with its float16 inputs, outputs, weights and constants in float32 (in its
    subgraphs too)."""
    import onnx
    from onnx import TensorProto, numpy_helper

    def widen(g):
        for vi in list(g.input) + list(g.output):
            if vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
                vi.type.tensor_type.elem_type = TensorProto.FLOAT
        for i, t in enumerate(g.initializer):
            if t.data_type == TensorProto.FLOAT16:
                wide = numpy_helper.to_array(t).astype(np.float32)
                g.initializer[i].CopyFrom(numpy_helper.from_array(wide, t.name))
        for n in g.node:
            for a in n.attribute:
                if a.name == "to" and a.i == TensorProto.FLOAT16:
                    a.i = TensorProto.FLOAT
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else []) + list(a.graphs):
                    widen(sub)

    m = onnx.ModelProto()
    m.CopyFrom(model)
    widen(m.graph)
    return m
