"""Random ops (ops/random.py, frontend/handlers_random.py): the generator's statistics, the compiled
kernels' bits against the numpy reference, fresh values on every run (the step kept as state),
seeds, and ranks drawing exactly the single-device values."""
import math
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from threads import run_threads
from shardflow.compiler import ModelFormatError, compile, load_onnx
from shardflow.compiler.ir.graph import RNG_STEP, RNG_STEP_NEXT, Tensor
from shardflow.compiler.parallel import partition, search, simulate
from shardflow.compiler.ops.random import Random, random_bits, splitmix64_key
from shardflow.runtime import load
from shardflow.runtime.comm import InProcessWorld


def _model(nodes, inputs, outputs, opset=20, initializers=()):
    g = oh.make_graph(nodes, "random", [oh.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                      [oh.make_tensor_value_info(n, t, s) for n, t, s in outputs], list(initializers))
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)])
    onnx.checker.check_model(m)
    return m


def _draw(kind, shape, dtype="float32", step=0, seed=42, p=None, **ab):
    op = Random([Tensor("s", (), "int64")] + ([Tensor("p", p.shape, str(p.dtype))] if p is not None else []),
                name="r", kind=kind, shape=shape, dtype=dtype, key=splitmix64_key(seed), **ab)
    return op.numpy(np.array(step), *([p] if p is not None else []))[0]


def test_splitmix64_reference_values():
    # SplitMix64 seeded with 1234567: its published first outputs (the C reference, splitmix64.c)
    want = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
            16408922859458223821]
    assert random_bits(1234567, np.arange(1, 6)).tolist() == want


def test_uniform_and_normal_statistics():
    n = 200_000
    u = _draw("uniform", (n,), a=-2.0, b=3.0)
    assert u.dtype == np.float32 and u.min() >= -2.0 and u.max() < 3.0
    # mean 0.5, sd 5/sqrt(12): 5 standard errors
    assert abs(u.mean() - 0.5) < 5 * (5 / math.sqrt(12)) / math.sqrt(n)
    hist = np.histogram(u, bins=10, range=(-2, 3))[0]
    assert np.abs(hist - n / 10).max() < 5 * math.sqrt(n / 10)
    for dtype in ("float32", "float64"):
        z = _draw("normal", (n,), dtype, a=1.0, b=2.0)
        assert z.dtype == np.dtype(dtype)
        assert abs(z.mean() - 1.0) < 5 * 2 / math.sqrt(n) and abs(z.std() - 2.0) < 0.02
        inside = np.mean(np.abs(z - 1.0) < 2.0)  # within one sd: erf(1/sqrt(2)) = 0.6827
        assert abs(inside - 0.682689) < 5 * math.sqrt(0.6827 * 0.3173 / n)
    # neighbouring elements and steps uncorrelated
    a, b = _draw("uniform", (n,), step=0), _draw("uniform", (n,), step=1)
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.02 and abs(np.corrcoef(a, b)[0, 1]) < 0.02


def test_bernoulli_frequencies_follow_p():
    p = np.linspace(0, 1, 101, dtype=np.float64).repeat(2000).reshape(101, 2000)
    b = _draw("bernoulli", p.shape, "int64", p=p)
    assert set(np.unique(b).tolist()) <= {0, 1}
    assert (b[0] == 0).all() and (b[-1] == 1).all()
    freq = b.mean(axis=1)
    assert np.all(np.abs(freq - p[:, 0]) <= 5 * np.sqrt(p[:, 0] * (1 - p[:, 0]) / 2000) + 1e-12)


def _noise_model(seed_attrs=None):
    """y = (x @ w) + RandomNormalLike, b = Bernoulli(p), u = RandomUniform [3, 5] float64; w a weight
    (a plan splits the product, its noise read in parts)."""
    seed_attrs = seed_attrs or {}
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"]),
             oh.make_node("RandomNormalLike", ["h"], ["eps"], mean=0.5, scale=2.0, **seed_attrs),
             oh.make_node("Add", ["h", "eps"], ["y"]),
             oh.make_node("Bernoulli", ["p"], ["b"], dtype=TensorProto.BOOL),
             oh.make_node("RandomUniform", [], ["u"], shape=[3, 5], low=-1.0, high=4.0, dtype=TensorProto.DOUBLE)]
    w = np.random.default_rng(2).standard_normal((256, 512)).astype(np.float32)
    return _model(nodes, [("x", TensorProto.FLOAT, [64, 256]), ("p", TensorProto.FLOAT, [8, 8])],
                  [("y", TensorProto.FLOAT, [64, 512]), ("b", TensorProto.BOOL, [8, 8]),
                   ("u", TensorProto.DOUBLE, [3, 5])], initializers=[numpy_helper.from_array(w, "w")])


def _feeds():
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((64, 256)).astype(np.float32), "p": rng.uniform(0, 1, (8, 8)).astype(np.float32)}


def test_imported_graph_takes_the_step_and_returns_the_next():
    g = load_onnx(_noise_model())
    assert g.inputs[-1].name == RNG_STEP and g.output_names[-1] == RNG_STEP_NEXT
    first, again = g.run(_feeds()), g.run({**_feeds(), RNG_STEP: np.array(0)})
    second = g.run({**_feeds(), RNG_STEP: np.array(1)})
    assert first[RNG_STEP_NEXT] == 1 and second[RNG_STEP_NEXT] == 2
    assert all(np.array_equal(first[k], again[k]) for k in ("y", "b", "u"))
    assert not np.array_equal(first["y"], second["y"]) and not np.array_equal(first["u"], second["u"])
    assert first["b"].dtype == bool and first["u"].dtype == np.float64
    assert first["u"].min() >= -1 and first["u"].max() < 4


def test_compiled_program_draws_the_reference_values_and_new_ones_each_run(tmp_path):
    m, feeds = _noise_model(), _feeds()
    g = load_onnx(m)
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    prog = load(tmp_path / "o")
    assert prog.output_names == ["y", "b", "u"] and prog.state_names == {RNG_STEP: RNG_STEP_NEXT}
    runs = [prog.run(feeds) for _ in range(3)]
    for step, out in enumerate(runs):
        ref = g.run({**feeds, RNG_STEP: np.array(step)})
        # uniform and Bernoulli: exactly the reference's bits; the normal through log/cos: to rounding
        assert np.array_equal(out["u"], ref["u"]) and np.array_equal(out["b"], ref["b"])
        np.testing.assert_allclose(out["y"], ref["y"], rtol=1e-5, atol=1e-4)
    assert not np.array_equal(runs[0]["u"], runs[1]["u"]) and not np.array_equal(runs[1]["b"], runs[2]["b"])
    assert prog.read_state()[RNG_STEP] == 3
    prog.reset_state()  # the sequence again from the first run
    assert np.array_equal(prog.run(feeds)["u"], runs[0]["u"])
    # the step given sets the run drawn
    assert np.array_equal(prog.run({**feeds, RNG_STEP: np.array(2)})["u"], runs[2]["u"])


@pytest.mark.parametrize("mesh,algo", [([2], "megatron"), ([4], "megatron"), ([2, 2], "megatron")])
def test_ranks_draw_the_single_device_values(tmp_path, mesh, algo):
    """The product split by columns, its noise drawn whole on every rank and read in parts."""
    m, feeds = _noise_model(), _feeds()
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "one")
    res = compile(m, distributed_config={"mesh_shape": mesh, "algo": algo}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "many")
    assert "S(1) via local_slice" in (tmp_path / "many" / "plan.txt").read_text()
    single = load(tmp_path / "one")
    want = [single.run(feeds) for _ in range(2)]
    comms = InProcessWorld(res.world_size).communicators()

    def ranks(c):
        prog = load(tmp_path / "many", c.rank, c)
        return [prog.run(feeds) for _ in range(2)]
    for outs in run_threads(comms, ranks):
        for got, ref in zip(outs, want):
            assert np.array_equal(got["u"], ref["u"]) and np.array_equal(got["b"], ref["b"])
            np.testing.assert_allclose(got["y"], ref["y"], rtol=1e-5, atol=1e-4)



def test_simulated_ranks_take_the_first_run_when_the_step_is_left_out():
    """``simulate`` binds the step as ``FlowGraph.run`` does (0 when left out): the plan's ranks
    draw the single-device values of the first run, and of the run given."""
    g = load_onnx(_noise_model())
    plan = search(g, {"mesh_shape": [2], "algo": "megatron"})
    ranks = partition(g, plan)
    for step in (None, 3):
        feeds = _feeds() | ({} if step is None else {RNG_STEP: np.array(step)})
        want, got = g.run(feeds), simulate(ranks, feeds)
        assert np.array_equal(got["u"], want["u"]) and np.array_equal(got["b"], want["b"])
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-4)
    assert not np.array_equal(simulate(ranks, _feeds())["u"], got["u"])

def test_seeds():
    fixed = {"seed": 7.0}
    a = load_onnx(_noise_model(fixed)).run(_feeds())["y"]
    b = load_onnx(_noise_model(fixed)).run(_feeds())["y"]
    c = load_onnx(_noise_model({"seed": 8.0})).run(_feeds())["y"]
    d = load_onnx(_noise_model()).run(_feeds())["y"]
    e = load_onnx(_noise_model()).run(_feeds())["y"]
    assert np.array_equal(a, b) and np.array_equal(d, e)  # a compile is reproducible, seeded or not
    assert not np.array_equal(a, c) and not np.array_equal(a, d)
    # two unseeded nodes draw different values; two with one seed the same
    for attrs, same in (({}, False), ({"seed": 3.0}, True)):
        nodes = [oh.make_node("RandomUniform", [], [n], shape=[4, 4], **attrs) for n in ("r1", "r2")]
        out = load_onnx(_model(nodes, [], [(n, TensorProto.FLOAT, [4, 4]) for n in ("r1", "r2")])).run({})
        assert np.array_equal(out["r1"], out["r2"]) == same


def test_bad_random_nodes_are_refused_by_name():
    bad = _model([oh.make_node("RandomUniform", [], ["r"], shape=[2], dtype=TensorProto.INT32)], [],
                 [("r", TensorProto.INT32, [2])])
    with pytest.raises(ModelFormatError, match=r"RandomUniform\(r\).*dtype int32"):
        load_onnx(bad)
    clash = _model([oh.make_node("RandomUniformLike", [RNG_STEP], ["r"], dtype=TensorProto.FLOAT)],
                   [(RNG_STEP, TensorProto.FLOAT, [2])], [("r", TensorProto.FLOAT, [2])])
    with pytest.raises(ModelFormatError, match=RNG_STEP):
        load_onnx(clash)


def test_an_unrolled_loops_iterations_draw_different_values():
    body = oh.make_graph([oh.make_node("RandomUniform", [], ["r"], shape=[3], seed=5.0),
                          oh.make_node("Identity", ["cond_in"], ["cond_out"]),
                          oh.make_node("Identity", ["r"], ["scan"])],
                         "body", [oh.make_tensor_value_info("i", TensorProto.INT64, []),
                                  oh.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
                         [oh.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                          oh.make_tensor_value_info("scan", TensorProto.FLOAT, [3])])
    m = _model([oh.make_node("Loop", ["M", "c"], ["out"], body=body)], [], [("out", TensorProto.FLOAT, [4, 3])],
               initializers=[numpy_helper.from_array(np.array(4, np.int64), "M"),
                             numpy_helper.from_array(np.array(True), "c")])
    out = load_onnx(m).run({})["out"]
    assert len({row.tobytes() for row in out}) == 4


def test_training_dropout_keeps_one_minus_ratio_scaled(tmp_path):
    ratio = 0.3
    m = _model([oh.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=11)],
               [("x", TensorProto.FLOAT, [256, 256])], [("y", TensorProto.FLOAT, [256, 256]),
                                                        ("mask", TensorProto.BOOL, [256, 256])],
               initializers=[numpy_helper.from_array(np.array(ratio, np.float32), "r"),
                             numpy_helper.from_array(np.array(True), "t")])
    x = np.random.default_rng(3).uniform(1, 2, (256, 256)).astype(np.float32)
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    prog = load(tmp_path / "o")
    first, second = prog.run({"x": x}), prog.run({"x": x})
    for out in (first, second):
        kept = out["mask"]
        assert abs(1 - kept.mean() - ratio) < 5 * math.sqrt(ratio * (1 - ratio) / x.size)
        assert np.array_equal(out["y"][kept], x[kept] * np.float32(1 / (1 - ratio))) and (out["y"][~kept] == 0).all()
    assert not np.array_equal(first["mask"], second["mask"])
    ref = load_onnx(m).run({"x": x})
    assert np.array_equal(ref["mask"], first["mask"]) and np.array_equal(ref["y"], first["y"])


def test_multinomial_draws_follow_the_softmax(tmp_path):
    with np.errstate(divide="ignore"):  # (log 0 = -inf: classes never drawn)
        logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]], np.float32))
    logits[0] += 100  # (exp would overflow: the weights are exp(x - max))
    n = 20000
    m = _model([oh.make_node("Multinomial", ["x"], ["y"], sample_size=n, dtype=TensorProto.INT64, seed=2.0)],
               [("x", TensorProto.FLOAT, [3, 4])], [("y", TensorProto.INT64, [3, n])])
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    prog = load(tmp_path / "o")
    first, second = prog.run({"x": logits})["y"], prog.run({"x": logits})["y"]
    ref = load_onnx(m).run({"x": logits})["y"]
    assert np.mean(first == ref) > 0.999  # (a draw on a boundary may round the other way in the sums)
    assert not np.array_equal(first, second)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    for row in range(3):
        freq = np.bincount(first[row], minlength=4) / n
        assert np.all(np.abs(freq - p[row]) <= 5 * np.sqrt(p[row] * (1 - p[row]) / n) + 1e-12), (row, freq)


def test_a_torch_reparameterization_and_mc_dropout(tmp_path):
    """torch.randn_like and a training-mode dropout as torch.onnx.export writes them (RandomNormalLike,
    Dropout with training_mode): the noise recovered from the compiled program's output is N(0, 1),
    new on every run."""
    torch = pytest.importorskip("torch")
    import io

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mu, self.logvar = torch.nn.Linear(32, 8), torch.nn.Linear(32, 8)

        def forward(self, x):
            mu, logvar = self.mu(x), self.logvar(x)
            return mu + torch.exp(0.5 * logvar) * torch.randn_like(mu), torch.nn.functional.dropout(x, 0.2, True)

    torch.manual_seed(0)
    enc, f = Encoder(), io.BytesIO()
    x = torch.randn(512, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(enc, (x,), f, opset_version=17, dynamo=False, input_names=["x"], output_names=["z", "d"])
    m = onnx.load_from_string(f.getvalue())
    assert {"RandomNormalLike", "Dropout"} <= {n.op_type for n in m.graph.node}
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    prog = load(tmp_path / "o")
    with torch.no_grad():
        mu, sigma = enc.mu(x).numpy(), torch.exp(0.5 * enc.logvar(x)).numpy()
    eps = [(prog.run({"x": x.numpy()})["z"] - mu) / sigma for _ in range(2)]
    for e in eps:
        assert abs(e.mean()) < 5 / math.sqrt(e.size) and abs(e.std() - 1) < 0.05
    assert abs(np.corrcoef(eps[0].ravel(), eps[1].ravel())[0, 1]) < 0.1
    d = prog.run({"x": x.numpy()})["d"]
    kept = d != 0
    assert abs(1 - kept.mean() - 0.2) < 0.02 and np.allclose(d[kept], x.numpy()[kept] / 0.8, rtol=1e-6)


@pytest.mark.parametrize("mesh", [[2], [3]])
def test_a_sharded_draw_computes_only_its_part(tmp_path, mesh):
    """A plan that splits the noise itself (ilp: batch rows, 1023 of them: parts of unequal size):
    each rank draws its rows only, at their positions in the whole (``Operator.positional``), the
    single-device values."""
    rng = np.random.default_rng(4)
    w, w2 = (numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) / 16, n)
             for n, s in (("w", (256, 1024)), ("w2", (1024, 256))))
    m = _model([oh.make_node("MatMul", ["x", "w"], ["h"]), oh.make_node("RandomNormalLike", ["h"], ["e"]),
                oh.make_node("Add", ["h", "e"], ["y"]), oh.make_node("MatMul", ["y", "w2"], ["z"])],
               [("x", TensorProto.FLOAT, [1023, 256])], [("z", TensorProto.FLOAT, [1023, 256])],
               initializers=[w, w2])
    x = rng.standard_normal((1023, 256)).astype(np.float32)
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "one")
    res = compile(m, distributed_config={"mesh_shape": mesh, "algo": "ilp"}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "many")
    line = next(s for s in (tmp_path / "many" / "plan.txt").read_text().splitlines() if s.startswith("RandomNormal"))
    assert "R -> S(0)" in line, line
    single = load(tmp_path / "one")
    want = [single.run({"x": x}) for _ in range(2)]

    def ranks(c):
        prog = load(tmp_path / "many", c.rank, c)
        return [prog.run({"x": x}) for _ in range(2)]
    for outs in run_threads(InProcessWorld(res.world_size).communicators(), ranks):
        for got, ref in zip(outs, want):  # (the noise is as large as the product: a wrong draw shows)
            np.testing.assert_allclose(got["z"], ref["z"], rtol=1e-4, atol=1e-4)
    assert not np.allclose(want[0]["z"], want[1]["z"], atol=1e-2)
