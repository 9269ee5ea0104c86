"""Per-channel affine ops folded into convs (passes/fold.py): which chains fold, the values against the
graph before the pass, and compiled programs against onnxruntime with the fold on and off."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import compile
from shardflow.compiler.errors import ConfigError
from shardflow.compiler.ir import FlowGraph, Tensor, const_tensor
from shardflow.compiler.ops.conv import Conv
from shardflow.compiler.ops.elementwise import Activation, Binary
from shardflow.compiler.ops.norm import BatchNorm
from shardflow.compiler.passes.fold import FoldAffineIntoConv
from shardflow.runtime import load
from threads import run_ranks

RNG = np.random.default_rng(7)


def _c(*shape, lo=None):
    v = RNG.standard_normal(shape).astype(np.float32)
    return const_tensor(np.abs(v) + lo if lo is not None else v)


def _bn(y, name):
    c = y.shape[1]
    return BatchNorm([y, _c(c), _c(c), _c(c), _c(c, lo=0.5)], name=name, epsilon=1e-3)


def _check(graph, feeds):
    """Run ``graph`` before and after the pass; the outputs agree to float32 rounding."""
    before = graph.run(feeds)
    graph = FoldAffineIntoConv().run(graph)
    graph.validate()
    after = graph.run(feeds)
    for k in before:
        assert after[k].shape == before[k].shape
        scale = float(np.abs(before[k][np.isfinite(before[k])]).max())
        np.testing.assert_allclose(after[k], before[k], rtol=2e-5, atol=2e-5 * scale)
    return graph


def test_a_chain_folds_into_one_conv():
    """Conv (no bias) -> BatchNorm -> times [1, C, 1, 1] -> plus [C, 1, 1] -> minus a scalar -> divided by
    [C, 1, 1] -> constant minus it -> Relu: one conv with a bias, then the Relu; the conv keeps its node name,
    its output the last folded tensor's name; a depthwise conv (group = C) folds the same way."""
    x = Tensor("x", (2, 8, 6, 6), "float32")
    conv = Conv([x, _c(8, 8, 3, 3)], name="conv", pads=(1, 1, 1, 1))
    bn = _bn(conv.outputs[0], "bn")
    mul = Binary([bn.outputs[0], _c(1, 8, 1, 1)], name="mul", fn="mul")
    add = Binary([_c(8, 1, 1), mul.outputs[0]], name="add", fn="add")
    sub = Binary([add.outputs[0], _c()], name="sub", fn="sub")
    div = Binary([sub.outputs[0], _c(8, 1, 1, lo=0.5)], name="div", fn="div")
    rsub = Binary([_c(8, 1, 1), div.outputs[0]], name="rsub", fn="sub")
    relu = Activation([rsub.outputs[0]], name="relu", kind="relu")
    dw = Conv([relu.outputs[0], _c(8, 1, 3, 3), _c(8)], name="dw", group=8, pads=(1, 1, 1, 1))
    bn2 = _bn(dw.outputs[0], "bn2")
    g = FlowGraph([x], bn2.outputs, output_names=["y"])
    g = _check(g, {"x": RNG.standard_normal(x.shape).astype(np.float32)})
    assert [(op.op_type, op.name) for op in g.nodes] == [("Conv", "conv"), ("Activation", "relu"), ("Conv", "dw")]
    assert len(g.nodes[0].inputs) == 3 and g.nodes[0].outputs[0].name == rsub.outputs[0].name
    assert g.outputs[0] is g.nodes[2].outputs[0] and g.output_names == ["y"]


def test_what_does_not_fold():
    """Not folded: a conv result with a second reader, or that is a graph output; a constant varying along
    a spatial dim, or widening the batch; a Div by a constant with a zero, or of a constant by the conv;
    a product of the conv with itself. A chain stops before a tensor that is a graph output (the ops
    before it fold)."""
    x = Tensor("x", (1, 4, 5, 5), "float32")

    def conv(name):
        return Conv([x, _c(4, 4, 1, 1)], name=name)

    a = conv("a")                                    # two readers
    a1 = Binary([a.outputs[0], _c(4, 1, 1)], name="a1", fn="mul")
    a2 = Activation([a.outputs[0]], name="a2", kind="relu")
    b = conv("b")                                    # spatial constant
    b1 = Binary([b.outputs[0], _c(1, 1, 5, 1)], name="b1", fn="mul")
    c = conv("c")                                    # widens the batch
    c1 = Binary([c.outputs[0], _c(2, 4, 1, 1)], name="c1", fn="add")
    d = conv("d")                                    # a zero divisor
    zero = const_tensor(np.array([1, 0, 2, 3], np.float32).reshape(4, 1, 1))
    d1 = Binary([d.outputs[0], zero], name="d1", fn="div")
    e = conv("e")                                    # constant / conv
    e1 = Binary([_c(4, 1, 1), e.outputs[0]], name="e1", fn="div")
    f = conv("f")                                    # conv * conv
    f1 = Binary([f.outputs[0], f.outputs[0]], name="f1", fn="mul")
    h = conv("h")                                    # the add's input is a graph output: only the mul folds
    h1 = Binary([h.outputs[0], _c(4, 1, 1)], name="h1", fn="mul")
    h2 = Binary([h1.outputs[0], _c(4, 1, 1)], name="h2", fn="add")
    outs = [a1, a2, b1, c1, d1, e1, f1, h1, h2, conv("out")]
    g = FlowGraph([x], [o.outputs[0] for o in outs], output_names=[f"y{k}" for k in range(len(outs))])
    g = _check(g, {"x": RNG.standard_normal(x.shape).astype(np.float32)})
    names = [op.name for op in g.nodes]
    assert names == ["a", "a1", "a2", "b", "b1", "c", "c1", "d", "d1", "e", "e1", "f", "f1", "h", "h2", "out"]
    assert len(g.nodes[13].inputs) == 3 and g.outputs[7] is g.nodes[13].outputs[0]


def test_identical_convs_share_one_folded_weight():
    """Two convs of one weight followed by the same BatchNorm constants share the folded weight and bias;
    a third with other constants gets its own."""
    x = Tensor("x", (1, 4, 5, 5), "float32")
    w = _c(4, 4, 3, 3)
    params = [_c(4), _c(4), _c(4), _c(4, lo=0.5)]
    other = [_c(4), _c(4), _c(4), _c(4, lo=0.5)]
    convs = [Conv([x, w], name=f"c{k}", pads=(1, 1, 1, 1)) for k in range(3)]
    bns = [BatchNorm([cv.outputs[0]] + p, name=f"bn{k}", epsilon=1e-5)
           for k, (cv, p) in enumerate(zip(convs, [params, params, other]))]
    g = FlowGraph([x], [b.outputs[0] for b in bns], output_names=["p", "q", "r"])
    g = _check(g, {"x": RNG.standard_normal(x.shape).astype(np.float32)})
    ws = [op.inputs[1] for op in g.nodes]
    bs = [op.inputs[2] for op in g.nodes]
    assert ws[0] is ws[1] and bs[0] is bs[1] and ws[2] is not ws[0]


def _net(path):
    """x [2, 16, 12, 12] -> 3x3 16->32 (no bias), BatchNormalization, * [1, 32, 1, 1], + [32, 1, 1], Relu ->
    depthwise 3x3 with a bias, BatchNormalization, Relu -> 1x1 32->32, BatchNormalization, + the Relu before
    (residual) -> y."""
    def w(*shape, scale=0.2):
        return (RNG.standard_normal(shape) * scale).astype(np.float32)

    def bn_params(p):
        return [(f"{p}g", 1 + w(32)), (f"{p}b", w(32)), (f"{p}m", w(32)), (f"{p}v", 0.5 + np.abs(w(32)))]

    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("w1", w(32, 16, 3, 3)), ("k", w(1, 32, 1, 1)), ("d", w(32, 1, 1)), ("wd", w(32, 1, 3, 3)), ("bd", w(32)),
        ("w2", w(32, 32, 1, 1))] + bn_params("p") + bn_params("q") + bn_params("s")]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             n("BatchNormalization", ["c1", "pg", "pb", "pm", "pv"], ["n1"], epsilon=1e-3),
             n("Mul", ["n1", "k"], ["m1"]), n("Add", ["d", "m1"], ["a1"]), n("Relu", ["a1"], ["r1"]),
             n("Conv", ["r1", "wd", "bd"], ["c2"], group=32, pads=[1, 1, 1, 1]),
             n("BatchNormalization", ["c2", "qg", "qb", "qm", "qv"], ["n2"]), n("Relu", ["n2"], ["r2"]),
             n("Conv", ["r2", "w2"], ["c3"]),
             n("BatchNormalization", ["c3", "sg", "sb", "sm", "sv"], ["n3"]), n("Add", ["n3", "r1"], ["y"])]
    graph = helper.make_graph(
        nodes, "fold", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32, 12, 12])], inits)
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


def test_folded_programs_match_onnxruntime(tmp_path):
    """The net on two cpu ranks, with the fold (no BatchNorm or Mul left in the rank programs) and without:
    each rank's output matches onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "net.onnx"
    _net(path)
    x = RNG.standard_normal((2, 16, 12, 12)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for fold in (True, False):
        out = tmp_path / f"out{fold}"
        res = compile(path, distributed_config={"mesh_shape": [2]},
                      optimization_config={"target": "cpu", "fold_affine": fold}, out_dir=out)
        kinds = [line.split()[1] for line in (out / "plan.txt").read_text().splitlines() if not line.startswith("#")]
        counts = (kinds.count("Conv"), kinds.count("BatchNorm"), kinds.count("Binary"))
        assert counts == ((3, 0, 1) if fold else (3, 3, 3))
        got = [o["y"] for o in run_ranks(out, {"x": x})]
        for y in got:
            np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_fold_affine_must_be_a_switch(tmp_path):
    path = tmp_path / "net.onnx"
    _net(path)
    with pytest.raises(ConfigError, match="fold_affine"):
        compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"fold_affine": 1},
                out_dir=tmp_path / "out")


def test_compiling_a_flow_graph_leaves_it_as_it_was(tmp_path):
    """``compile`` folds a copy of a FlowGraph it is given: the caller's graph keeps its BatchNorm."""
    x = Tensor("x", (1, 4, 6, 6), "float32")
    conv = Conv([x, _c(4, 4, 3, 3)], name="conv", pads=(1, 1, 1, 1))
    bn = _bn(conv.outputs[0], "bn")
    g = FlowGraph([x], bn.outputs, output_names=["y"])
    feeds = {"x": RNG.standard_normal(x.shape).astype(np.float32)}
    want = g.run(feeds)["y"]
    compile(g, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    assert [op.name for op in g.nodes] == ["conv", "bn"] and g.outputs[0] is bn.outputs[0]
    got = load(tmp_path / "o").run(feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
