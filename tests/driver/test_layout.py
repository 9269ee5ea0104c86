"""The blocked layout between convs (passes/layout.py): which tensors it blocks, and compiled programs
against onnxruntime with it on and off, on two cpu ranks."""
import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import compile
from shardflow.compiler.ir import FlowGraph, Tensor, const_tensor
from shardflow.compiler.ops.conv import Conv, PackedConv, Pool
from shardflow.compiler.ops.elementwise import Activation, Binary
from shardflow.compiler.ops.reduce import Softmax
from shardflow.compiler.passes.layout import BlockedLayout
from shardflow.runtime import load
from shardflow.runtime.comm import InProcessWorld
from threads import run_ranks, run_threads


def _net(rng, path, batch=1):
    """x [batch, 16, 32, 32] -> 1x1 16->64, BatchNormalization, times and plus constants of one value per
    channel, Relu, MaxPool -> 16x16 -> 3x3 64->64 (direct: too little work for Winograd), Relu, 1x1
    64->64, + the pool's output, Relu -> r; a 1x1 of stride 2 (64->48) and a 3x3 of stride 2 (64->16) of r,
    concatenated with a max pool of x (plain: a reorder), 80 channels at 8x8, an average pool, a 1x1 to 20
    channels (not a multiple of 16) -> y1;
    and GlobalAveragePool of r plus a MaxPool of r's whole 16x16 plane (pools of the whole blocked plane) -> y2."""
    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("w1", w(64, 16, 1, 1)), ("b1", w(64)), ("w2", w(64, 64, 3, 3, scale=0.05)), ("w3", w(64, 64, 1, 1)),
        ("ws", w(48, 64, 1, 1)), ("wc", w(16, 64, 3, 3, scale=0.05)), ("bc", w(16)), ("wo", w(20, 80, 1, 1)),
        ("g", 1 + w(64)), ("beta", w(64)), ("mu", w(64)), ("var", 0.5 + np.abs(w(64))), ("k", w(64, 1, 1)),
        ("d", w(1, 64, 1, 1))]]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1", "b1"], ["c0"]),
             n("BatchNormalization", ["c0", "g", "beta", "mu", "var"], ["bn"], epsilon=1e-3),
             n("Mul", ["bn", "k"], ["m1"]), n("Add", ["d", "m1"], ["c1"]), n("Relu", ["c1"], ["r1"]),
             n("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             n("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]), n("Relu", ["c2"], ["r2"]),
             n("Conv", ["r2", "w3"], ["c3"]), n("Add", ["c3", "p1"], ["a3"]), n("Relu", ["a3"], ["r"]),
             n("Conv", ["r", "ws"], ["s"], strides=[2, 2]),
             n("Conv", ["r", "wc", "bc"], ["cc"], strides=[2, 2], pads=[1, 1, 1, 1]),
             n("MaxPool", ["x"], ["px"], kernel_shape=[4, 4], strides=[4, 4]),
             n("Concat", ["cc", "s", "px"], ["cat"], axis=1),
             n("AveragePool", ["cat"], ["ap"], kernel_shape=[2, 2]),
             n("Conv", ["ap", "wo"], ["y1"]), n("GlobalAveragePool", ["r"], ["g1"]),
             n("MaxPool", ["r"], ["g2"], kernel_shape=[16, 16]), n("Add", ["g1", "g2"], ["y2"])]
    graph = helper.make_graph(
        nodes, "blocked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16, 32, 32])],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [batch, 20, 7, 7]),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, [batch, 64, 1, 1])], inits)
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


def _run(path, out, mesh, x, **options):
    compile(path, distributed_config={"mesh_shape": mesh}, optimization_config={"target": "cpu", **options},
            out_dir=out)
    world = int(np.prod(mesh))
    programs = [json.loads((out / f"rank{r}" / "program.json").read_text()) for r in range(world)]

    def work(c):
        res = load(out, c.rank, c).run({"x": x})
        return res["y1"], res["y2"]
    return programs, run_threads(InProcessWorld(world).communicators(), work, timeout=120)


@pytest.mark.parametrize("mesh", [[2]])
def test_blocked_programs_match_onnxruntime(tmp_path, mesh):
    """The net's tensors between convs are blocked ([N, C/16, H, W, 16] buffers; the pool, the residual
    add and the concatenation in that layout, the concatenation's plain part through a reorder; the 1x1
    of 20 channels writes the plain layout and GlobalAveragePool pools the blocked r), and every rank's
    outputs match onnxruntime's, as do those of the program compiled with ``blocked: False`` (no 5-D
    buffer)."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(3)
    path = tmp_path / "net.onnx"
    _net(rng, path, batch=2)
    x = rng.standard_normal((2, 16, 32, 32)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for blocked in (True, False):
        # the BatchNorm and the Mul, Add after it not folded into the conv (passes/fold.py): they follow the layout
        programs, got = _run(path, tmp_path / f"out{blocked}", mesh, x, blocked=blocked, fold_affine=False)
        for program in programs:
            five = [b for b in program["buffers"] if len(b["shape"]) == 5]
            steps = [s["node"] for s in program["steps"] if s["kind"] == "kernel"]
            if not blocked:
                assert not five
                continue
            assert len(five) >= 5 and all(b["shape"][-1] == 16 for b in five)
            # GlobalAveragePool and the 16x16 MaxPool read r blocked (a pool of the whole plane, viewed as
            # [N, C, 1, 1]): no reorder
            assert not any(name.endswith(".unblock") for name in steps)
            gap = [s for s in program["steps"] if s["kind"] == "kernel" and s["node"].endswith(".blocked")]
            assert len(gap) == 2 and all(len(program["buffers"][s["inputs"][0]]["shape"]) == 5 for s in gap)
            # the concatenation reads the plain pool of x (its reorder fused into the concatenation's kernel)
            bufs = program["buffers"]
            cat = [s for s in program["steps"] if s["kind"] == "kernel" and s["node"] == "Concat(cat)"]
            assert len(cat) == 1 and len(bufs[cat[0]["outputs"][0]]["shape"]) == 5
            assert sorted(len(bufs[i]["shape"]) for i in cat[0]["inputs"]) == [4, 5, 5]
        for y1, y2 in got:
            np.testing.assert_allclose(y1, want[0], rtol=1e-4, atol=1e-4 * float(np.abs(want[0]).max()))
            np.testing.assert_allclose(y2, want[1], rtol=1e-4, atol=1e-4 * float(np.abs(want[1]).max()))


def _placeholder(*shape):
    return Tensor("x", shape, "float32")


def _w(*shape):
    return const_tensor(np.ones(shape, np.float32))


def test_which_tensors_are_blocked():
    """A conv's output is blocked when a reader reads it natively (a conv, or an element-wise op or pool
    whose own output is blocked); not a graph output, not 24 channels, not one only a Softmax reads;
    a plain reader of a blocked tensor gets one reorder; convs keep their form when neither side is
    blocked."""
    x = _placeholder(1, 16, 8, 8)
    a = Conv([x, _w(32, 16, 1, 1)], name="a")                        # blocked: b reads it
    b = Conv([a.outputs[0], _w(32, 32, 3, 3)], name="b", pads=(1, 1, 1, 1))
    relu = Activation([b.outputs[0]], name="relu", kind="relu")      # blocked: the pool reads it blocked
    pool = Pool([relu.outputs[0]], name="pool", kind="max", kernel=(2, 2), strides=(2, 2))
    c = Conv([pool.outputs[0], _w(24, 32, 1, 1)], name="c")          # 24 channels: plain
    d = Conv([pool.outputs[0], _w(32, 32, 1, 1)], name="d")          # read by softmax and an add: plain
    sm = Softmax([d.outputs[0]], name="sm", axes=(1,))
    add = Binary([d.outputs[0], pool.outputs[0]], name="add", fn="add")
    e = Conv([c.outputs[0], _w(16, 24, 1, 1)], name="e")             # plain in, plain out: stays a Conv
    g = FlowGraph([x], [sm.outputs[0], add.outputs[0], e.outputs[0]], [a, b, relu, pool, c, d, sm, add, e])
    g = BlockedLayout().run(g)
    by = {op.name: op for op in g.nodes}
    assert [t.ndim for t in by["b"].inputs[:1] + by["b"].outputs] == [5, 5]
    assert by["a"].op_type == "PackedConv" and by["a"].attrs["blocked_out"] and not by["a"].attrs["blocked_in"]
    assert by["pool"].attrs["kernel"] == (2, 2, 1) and by["pool"].outputs[0].shape == (1, 2, 4, 4, 16)
    assert by["c"].attrs["blocked_in"] and not by["c"].attrs["blocked_out"] and by["c"].outputs[0].ndim == 4
    assert by["d"].attrs["blocked_in"] and not by["d"].attrs["blocked_out"]
    assert by["add"].outputs[0].ndim == 4 and by["add"].inputs[1].producer.name == "pool.unblock.view"
    assert by["e"].op_type == "Conv"
    assert sum(op.name.endswith(".unblock") for op in g.nodes) == 1
    assert all(t.ndim == 4 for t in g.outputs)


def test_a_memory_budget_keeps_conv_weights():
    """With ``repack=False`` (a memory budget) plain Convs keep their weights; PackedConvs are laid out."""
    x = _placeholder(1, 16, 8, 8)
    a = Conv([x, _w(32, 16, 1, 1)], name="a")
    p = PackedConv([a.outputs[0], _w(2, 32, 16)], name="p", oc=32, kernel=(1, 1))
    q = PackedConv([p.outputs[0], _w(2, 32, 16)], name="q", oc=32, kernel=(1, 1))
    g = BlockedLayout(repack=False).run(FlowGraph([x], [q.outputs[0]], [a, p, q]))
    by = {op.name: op for op in g.nodes}
    assert by["a"].op_type == "Conv" and by["p"].attrs["blocked_out"] and by["q"].attrs["blocked_in"]


def test_depthwise_convs_follow_the_layout():
    """A depthwise conv (group = C = OC, a multiple of 16) reads and writes the blocked layout and stays a
    Conv with its weight as it is; one with two outputs per channel keeps the plain layout (the conv
    before it writes plain)."""
    x = _placeholder(1, 16, 8, 8)
    a = Conv([x, _w(32, 16, 1, 1)], name="a")
    dw = Conv([a.outputs[0], _w(32, 1, 3, 3)], name="dw", group=32, pads=(1, 1, 1, 1), strides=(2, 2))
    b = Conv([dw.outputs[0], _w(32, 32, 1, 1)], name="b")
    twice = Conv([b.outputs[0], _w(64, 1, 3, 3)], name="twice", group=32, pads=(1, 1, 1, 1))
    g = BlockedLayout().run(FlowGraph([x], [twice.outputs[0]], [a, dw, b, twice]))
    by = {op.name: op for op in g.nodes}
    assert by["dw"].op_type == "Conv" and by["dw"].attrs["blocked_in"] and by["dw"].attrs["blocked_out"]
    assert by["dw"].inputs[1] is dw.inputs[1] and by["dw"].outputs[0].shape == (1, 2, 4, 4, 16)
    assert by["twice"].op_type == "Conv" and not by["twice"].attrs.get("blocked_in")
    assert by["twice"].inputs[0] is by["b"].outputs[0] and not by["b"].attrs.get("blocked_out")


def _mobile_block(rng, path):
    """x [2, 16, 14, 14] -> 1x1 16->96, Clip(0, 6) -> depthwise 3x3 (bias), Clip(0, 6) -> 1x1 96->16, + x ->
    depthwise 3x3 of stride 2 (16 channels), Relu -> y [2, 16, 7, 7] (MobileNetV2's inverted residual)."""
    def w(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("we", w(96, 16, 1, 1)), ("be", w(96)), ("wd", w(96, 1, 3, 3)), ("bd", w(96)), ("wp", w(16, 96, 1, 1)),
        ("ws", w(16, 1, 3, 3)), ("lo", np.float32(0)), ("hi", np.float32(6))]]
    n = helper.make_node
    nodes = [n("Conv", ["x", "we", "be"], ["e"]), n("Clip", ["e", "lo", "hi"], ["e6"]),
             n("Conv", ["e6", "wd", "bd"], ["d"], group=96, pads=[1, 1, 1, 1]), n("Clip", ["d", "lo", "hi"], ["d6"]),
             n("Conv", ["d6", "wp"], ["p"]), n("Add", ["p", "x"], ["r"]),
             n("Conv", ["r", "ws"], ["s"], group=16, pads=[1, 1, 1, 1], strides=[2, 2]), n("Relu", ["s"], ["y"])]
    graph = helper.make_graph(
        nodes, "mobile", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 14, 14])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 7, 7])], inits)
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


def test_blocked_depthwise_programs_match_onnxruntime(tmp_path):
    """The inverted residual on two cpu ranks: its depthwise conv runs on blocked tensors (the clamp in its
    stores), and the outputs match onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(5)
    path = tmp_path / "mobile.onnx"
    _mobile_block(rng, path)
    x = rng.standard_normal((2, 16, 14, 14)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    compile(path, distributed_config={"mesh_shape": [2]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "o")
    for r in range(2):
        program = json.loads((tmp_path / "o" / f"rank{r}" / "program.json").read_text())
        bufs = program["buffers"]
        dws = [s for s in program["steps"] if s["kind"] == "kernel" and len(bufs[s["inputs"][1]]["shape"]) == 4
               and bufs[s["inputs"][1]]["shape"][1] == 1]
        # the first reads and writes blocked tensors; the second reads the residual add of the plain input x
        ranks = [(len(bufs[s["inputs"][0]]["shape"]), len(bufs[s["outputs"][0]]["shape"])) for s in dws]
        assert ranks == [(5, 5), (4, 4)]
    got = [o["y"] for o in run_ranks(tmp_path / "o", {"x": x})]
    for y in got:
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def _model_and_reference(tmp_path, name, nodes, inits, x, out_shape):
    """Write the graph of ``nodes`` (input ``x``, output ``y`` of ``out_shape``) to ``tmp_path/name.onnx``;
    its path and onnxruntime's ``y``."""
    ort = pytest.importorskip("onnxruntime")
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_large_convs_of_a_small_image_match_onnxruntime(tmp_path):
    """A 7x7 stage's large convs (2 MiB of weights or more: the blocked direct conv runs their K in chunks
    whose partial sums it keeps in the output, conv.h): a 1x1 1024->512 with a bias and Relu, then a 3x3
    512->128 whose residual (a 1x1 of x) is added before a Relu, to a 1x1 128->16; one cpu rank's outputs
    against onnxruntime's."""
    rng = np.random.default_rng(7)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("w1", w(512, 1024, 1, 1)), ("b1", w(512, 1)[:, 0]), ("w2", w(128, 512, 3, 3)), ("b2", w(128, 1)[:, 0]),
        ("ws", w(128, 1024, 1, 1)), ("w3", w(16, 128, 1, 1))]]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1", "b1"], ["c1"]), n("Relu", ["c1"], ["r1"]),
             n("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]), n("Conv", ["x", "ws"], ["s"]),
             n("Add", ["c2", "s"], ["a"]), n("Relu", ["a"], ["r2"]), n("Conv", ["r2", "w3"], ["y"])]
    x = rng.standard_normal((1, 1024, 7, 7)).astype(np.float32)
    path, want = _model_and_reference(tmp_path, "stage", nodes, inits, x, [1, 16, 7, 7])
    compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "o")
    program = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    assert sum(len(b["shape"]) == 5 for b in program["buffers"]) >= 2  # r1 and r2 blocked
    y = load(tmp_path / "o", 0).run({"x": x})["y"]
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("mesh", [[1], [2]])
def test_grouped_convs_of_whole_blocks_run_blocked(tmp_path, mesh):
    """RegNet's block: 1x1 64->96, Relu, a grouped 3x3 of 3 groups of 32 channels (stride 2, bias, Relu), 1x1
    96->32. The grouped conv reads and writes the blocked layout as a PackedConv of 3 groups (each group's
    channels whole blocks of 16); a grouped conv of 8-channel groups stays a plain Conv. The outputs match
    onnxruntime's, on one and two cpu ranks."""
    rng = np.random.default_rng(9)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("w1", w(96, 64, 1, 1)), ("w2", w(96, 32, 3, 3)), ("b2", w(96, 1)[:, 0]), ("w3", w(32, 96, 1, 1)),
        ("w4", w(32, 8, 3, 3)), ("w5", w(16, 32, 1, 1))]]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1"], ["c1"]), n("Relu", ["c1"], ["r1"]),
             n("Conv", ["r1", "w2", "b2"], ["c2"], group=3, strides=[2, 2], pads=[1, 1, 1, 1], name="grouped"),
             n("Relu", ["c2"], ["r2"]), n("Conv", ["r2", "w3"], ["c3"]), n("Relu", ["c3"], ["r3"]),
             n("Conv", ["r3", "w4"], ["c4"], group=4, pads=[1, 1, 1, 1], name="narrow"), n("Conv", ["c4", "w5"], ["y"])]
    x = rng.standard_normal((2, 64, 15, 15)).astype(np.float32)
    path, want = _model_and_reference(tmp_path, "regnet", nodes, inits, x, [2, 16, 8, 8])
    out = tmp_path / "o"
    compile(path, distributed_config={"mesh_shape": mesh}, optimization_config={"target": "cpu"}, out_dir=out)
    world = int(np.prod(mesh))
    for r in range(world):
        program = json.loads((out / f"rank{r}" / "program.json").read_text())
        bufs = program["buffers"]
        grouped = [st for st in program["steps"] if st["kind"] == "kernel" and "w2.panels" in
                   [bufs[i]["name"] for i in st["inputs"]]]
        assert len(grouped) == 1 and len(bufs[grouped[0]["inputs"][0]]["shape"]) == 5
        assert len(bufs[grouped[0]["outputs"][0]]["shape"]) == 5
        assert any(b["name"] == "w4" for b in bufs)  # the narrow groups' weight as it is
    got = [o["y"] for o in run_ranks(out, {"x": x}, world=world)]
    for y in got:
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_a_stem_of_three_channels_writes_the_layout():
    """A 7x7 stride-2 conv of a 3-channel image writes the layout (its image read plane by plane) when a conv
    reads it; a 1x1 of 8 channels keeps its form."""
    x = _placeholder(1, 3, 32, 32)
    stem = Conv([x, _w(32, 3, 7, 7)], name="stem", pads=(3, 3, 3, 3), strides=(2, 2))
    a = Conv([stem.outputs[0], _w(32, 32, 1, 1)], name="a")
    x8 = Tensor("x8", (1, 8, 8, 8), "float32")
    thin = Conv([x8, _w(32, 8, 1, 1)], name="thin")
    b = Conv([thin.outputs[0], _w(32, 32, 1, 1)], name="b")
    g = BlockedLayout().run(FlowGraph([x, x8], [a.outputs[0], b.outputs[0]], [stem, a, thin, b]))
    by = {op.name: op for op in g.nodes}
    assert by["stem"].op_type == "PackedConv" and by["stem"].attrs["blocked_out"] and a.name in by
    assert by["a"].attrs["blocked_in"] and by["thin"].op_type == "Conv"


def _compiled_against_onnxruntime(tmp_path, name, nodes, inits, x, outputs):
    """Compile the one-input model of ``nodes`` (input ``x``, float32 ``outputs``: name -> shape) for one cpu
    rank, check its outputs against onnxruntime's and return ``{step's node: its buffers' shapes}``."""
    ort = pytest.importorskip("onnxruntime")
    f = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, name, [f("x", TensorProto.FLOAT, list(x.shape))],
                              [f(k, TensorProto.FLOAT, list(v)) for k, v in outputs.items()], inits)
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    compile(str(path), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "o")
    got = load(tmp_path / "o", rank=0).run({"x": x})
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for k, ref in zip(outputs, want):
        np.testing.assert_allclose(got[k], ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    program = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    bufs = program["buffers"]
    return {st["node"]: [bufs[i]["shape"] for i in st["inputs"] + st["outputs"]] for st in program["steps"]}


def test_slices_of_whole_channel_blocks_stay_blocked(tmp_path):
    """A C2f block (YOLOv8's): a 1x1 conv split into two halves of whole blocks of 16 channels, the second
    through a 3x3 conv, the three concatenated into a 1x1: the split's slices read and write the blocked
    layout (the block axis sliced, no reorder); a slice of channels 8..40 (not whole blocks) reads a
    reorder. Values match onnxruntime's."""
    rng = np.random.default_rng(5)

    def w(*shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32))
    inits = [w(64, 16, 1, 1), w(32, 32, 3, 3), w(32, 96, 1, 1), w(16, 32, 1, 1)]
    for t, name in zip(inits, ("w1", "w2", "w3", "w4")):
        t.name = name
    inits.append(numpy_helper.from_array(np.array([32, 32], np.int64), "halves"))
    inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
              (("s0", [8]), ("s1", [40]), ("ax", [1]))]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1"], ["c1"]), n("Split", ["c1", "halves"], ["a", "b"], axis=1),
             n("Conv", ["b", "w2"], ["c2"], pads=[1, 1, 1, 1]), n("Concat", ["a", "b", "c2"], ["cat"], axis=1),
             n("Conv", ["cat", "w3"], ["y"]), n("Slice", ["c1", "s0", "s1", "ax"], ["mid"]),
             n("Conv", ["mid", "w4"], ["z"])]
    x = rng.standard_normal((1, 16, 12, 12)).astype(np.float32)
    shapes = _compiled_against_onnxruntime(tmp_path, "c2f", nodes, inits, x,
                                           {"y": (1, 32, 12, 12), "z": (1, 16, 12, 12)})
    dims = {k: [len(sh) for sh in v] for k, v in shapes.items()}
    # the halves are views of the first conv's blocked output (rfcs/0003 "Slices as views"): no steps of
    # their own; the concatenation and the 3x3 read them blocked
    assert dims["Concat(cat)"] == [5, 5, 5, 5] and dims["Conv(c2)"][0] == 5, dims
    assert not [k for k in dims if "Split" in k or "Slice(a" in k or "Slice(b" in k], dims
    assert sum(k.endswith(".unblock") for k in dims) == 1, dims  # (the unaligned slice's reorder)


def test_squeeze_and_excitation_scales_keep_the_layout(tmp_path):
    """A squeeze-and-excitation block (RegNetY's, EfficientNet's) on a batch of 2: the image times its
    computed scale ``[N, C, 1, 1]`` (global pool, two 1x1 convs, Sigmoid) stays blocked, the scale read as
    ``[N, C/16, 1, 1, 16]`` (the same order), and the 1x1 after it reads the product natively: no reorder but
    the one a spatial map ``[N, 1, H, W]`` (not one value per channel) needs. Values match onnxruntime's."""
    rng = np.random.default_rng(7)
    inits = []
    for name, shape in (("w1", (32, 16, 3, 3)), ("ws1", (8, 32, 1, 1)), ("ws2", (32, 8, 1, 1)), ("w3", (16, 32, 1, 1)),
                        ("wm", (1, 32, 1, 1)), ("w4", (16, 32, 1, 1))):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name))
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), n("Relu", ["c1"], ["r"]),
             n("GlobalAveragePool", ["r"], ["p"]), n("Conv", ["p", "ws1"], ["q"]), n("Relu", ["q"], ["qr"]),
             n("Conv", ["qr", "ws2"], ["sl"]), n("Sigmoid", ["sl"], ["s"]), n("Mul", ["r", "s"], ["e"]),
             n("Conv", ["e", "w3"], ["y"]),
             # a spatial map (one value per pixel) is not a per-channel scale: its product reads a reorder
             n("Conv", ["r", "wm"], ["m"]), n("Mul", ["r", "m"], ["f"]), n("Conv", ["f", "w4"], ["z"])]
    x = rng.standard_normal((2, 16, 10, 10)).astype(np.float32)
    shapes = _compiled_against_onnxruntime(tmp_path, "se", nodes, inits, x,
                                           {"y": (2, 16, 10, 10), "z": (2, 16, 10, 10)})
    scale, image, product = shapes["Mul(e)"]  # (the scale's buffer is the Sigmoid's: the view is its own)
    assert scale == [2, 32, 1, 1] and image == product == [2, 2, 10, 10, 16], shapes
    assert shapes["Conv(y)"][0] == product, shapes
    assert sum(k.endswith(".unblock") for k in shapes) == 1, shapes  # (the spatial map's product's)
