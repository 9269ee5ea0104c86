"""Data-movement ops imported from small ONNX models agree with onnxruntime, keep affine index
expressions where the data movement allows, and reject malformed nodes with typed errors."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import ModelFormatError, ShapeError, UnsupportedOperatorError, load_onnx
from shardflow.compiler.ir import TensorElement, affine_form, walk

ort = pytest.importorskip("onnxruntime")

_ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
         np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL}


def _model(nodes, inputs: dict, outputs: dict, inits: dict | None = None, opset: int = 18) -> onnx.ModelProto:
    """``inputs``: name -> example array; ``outputs``: name -> (numpy dtype, rank)."""
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, _ELEM[a.dtype], a.shape) for n, a in inputs.items()],
        [helper.make_tensor_value_info(n, _ELEM[np.dtype(dt)], [None] * r) for n, (dt, r) in outputs.items()],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in (inits or {}).items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _check(model: onnx.ModelProto, feeds: dict):
    """Import, run and compare every output with onnxruntime; return the graph."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    want = dict(zip(names, sess.run(names, feeds)))
    g = load_onnx(model)
    got = g.run(feeds)
    for n in names:
        assert got[n].shape == want[n].shape and got[n].dtype == want[n].dtype, n
        np.testing.assert_allclose(got[n], want[n], rtol=1e-6, atol=1e-6)
    return g


def _reads(op):
    """The index tuples with which ``op``'s definition reads its first input."""
    x0 = op.task.inputs[0]
    return [e.indices for e in walk(op.task.outputs[0].value) if isinstance(e, TensorElement) and e.tensor is x0]


rng = np.random.default_rng(0)


def test_reshape_head_split_is_affine_and_matches_onnxruntime():
    x = rng.standard_normal((2, 5, 768)).astype(np.float32)
    m = _model([helper.make_node("Reshape", ["x", "s"], ["y"])], {"x": x}, {"y": (np.float32, 4)},
               {"s": np.array([0, 0, 12, -1], np.int64)})
    g = _check(m, {"x": x})
    (op,) = g.nodes
    assert op.outputs[0].shape == (2, 5, 12, 64)
    (idx,) = _reads(op)
    b, s, h, d = op.task.outputs[0].axes
    forms = [affine_form(e) for e in idx]
    assert forms[0] == ({b: 1}, 0) and forms[1] == ({s: 1}, 0) and forms[2] == ({h: 64, d: 1}, 0)


def test_reshape_head_merge_reads_div_mod_only_on_merged_dim():
    x = rng.standard_normal((2, 5, 12, 64)).astype(np.float32)
    m = _model([helper.make_node("Reshape", ["x", "s"], ["y"])], {"x": x}, {"y": (np.float32, 3)},
               {"s": np.array([2, 5, 768], np.int64)})
    g = _check(m, {"x": x})
    (idx,) = _reads(g.nodes[0])
    b, s, c = g.nodes[0].task.outputs[0].axes
    assert affine_form(idx[0]) == ({b: 1}, 0) and affine_form(idx[1]) == ({s: 1}, 0)
    assert repr(idx[2]) == "(i2 // 64)" and repr(idx[3]) == "(i2 % 64)"


def test_attention_layout_pipeline():
    """Split heads, transpose, transpose back, merge: the shapes flow through Shape arithmetic."""
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        helper.make_node("Slice", ["shp", "zero", "two"], ["bs"]),
        helper.make_node("Concat", ["bs", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["split"]),
        helper.make_node("Transpose", ["split"], ["bhsd"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["bhsd"], ["bshd"], perm=[0, 2, 1, 3]),
        helper.make_node("Flatten", ["bshd"], ["flat"], axis=2),
        helper.make_node("Reshape", ["flat", "shp"], ["y"]),
    ]
    m = _model(nodes, {"x": x}, {"y": (np.float32, 3), "bhsd": (np.float32, 4)},
               {"zero": np.array([0], np.int64), "two": np.array([2], np.int64), "heads": np.array([2, 4], np.int64)})
    g = _check(m, {"x": x})
    assert {op.op_type for op in g.nodes} <= {"Reshape", "Transpose", "Shape", "Slice", "Concat"}


def test_reshape_to_same_shape_is_removed():
    x = rng.standard_normal((3, 4)).astype(np.float32)
    m = _model([helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
               {"x": x}, {"y": (np.float32, 2)}, {"s": np.array([3, -1], np.int64)})
    g = _check(m, {"x": x})
    assert [op.op_type for op in g.nodes] != [] and all(op.op_type != "Reshape" for op in g.nodes)


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1, -1], [1000, -1000], [0, 2], [1, -2]),
    ([-100, 0], [2, 9223372036854775807], [-3, 1], [2, 1]),
    ([3], [1], [1], [-1]),
])
def test_slice_opset13(starts, ends, axes, steps):
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    m = _model([helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"])], {"x": x}, {"y": (np.float32, 3)},
               {"s": np.array(starts, np.int64), "e": np.array(ends, np.int64), "a": np.array(axes, np.int64),
                "t": np.array(steps, np.int64)}, opset=13)
    _check(m, {"x": x})


def test_a_concatenation_of_many_parts_tests_its_index_in_a_balanced_tree(tmp_path):
    """``Concat`` picks its part with a balanced tree of index tests (depth log2(parts)): an
    unrolled scan stacks one part per step, and a chain of 1100 tests overflowed Python's recursion
    in the sharding rules (RecursionError). Planned over two ranks, and compiled, it is still the
    concatenation."""
    from shardflow.compiler import compile
    from shardflow.compiler.ir import IfThenElse
    from shardflow.compiler.parallel import partition, search, simulate
    from shardflow.runtime import load

    n = 1100
    x = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    nodes = [helper.make_node("Split", ["x"], [f"p{k}" for k in range(n)], axis=0, num_outputs=n),
             helper.make_node("Concat", [f"p{k}" for k in range(n)], ["c"], axis=0),
             helper.make_node("Neg", ["c"], ["y"])]
    model = _model(nodes, {"x": x}, {"y": (np.float32, 2)})
    g = _check(model, {"x": x})
    concat, = [op for op in g.nodes if op.op_type == "Concat"]

    def depth(e):
        return (1 + max(map(depth, e.children()), default=0)) if isinstance(e, IfThenElse) else 0
    assert depth(concat.task.outputs[0].value) == 11  # ceil(log2(1100))
    plan = search(g, {"mesh_shape": [2]})
    np.testing.assert_array_equal(simulate(partition(g, plan), {"x": x}, plan.mesh)["y"], -x)
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=str(tmp_path))
    np.testing.assert_array_equal(load(str(tmp_path)).run({"x": x})["y"], -x)


def test_split_num_outputs_uneven_and_split_input():
    x = rng.standard_normal((2, 7)).astype(np.float32)
    m = _model([helper.make_node("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=3)], {"x": x},
               {k: (np.float32, 2) for k in "abc"})
    g = _check(m, {"x": x})
    assert [g.outputs[k].shape[1] for k in range(3)] == [3, 3, 1]
    m = _model([helper.make_node("Split", ["x", "sp"], ["a", "b"], axis=-1)], {"x": x},
               {k: (np.float32, 2) for k in "ab"}, {"sp": np.array([2, 5], np.int64)}, opset=13)
    _check(m, {"x": x})


@pytest.mark.parametrize("mode,pads", [("constant", [1, 0, -1, 2]), ("reflect", [0, 2, 1, 3]),
                                       ("edge", [2, -1, 0, 3]), ("wrap", [1, 4, 2, 1])])
def test_pad_modes(mode, pads):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    ins = ["x", "p", "v"] if mode == "constant" else ["x", "p"]
    m = _model([helper.make_node("Pad", ins, ["y"], mode=mode)], {"x": x}, {"y": (np.float32, 2)},
               {"p": np.array(pads, np.int64), "v": np.array(2.5, np.float32)}, opset=19)
    _check(m, {"x": x})


def test_pad_axes_opset18():
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    m = _model([helper.make_node("Pad", ["x", "p", "", "a"], ["y"], mode="edge")], {"x": x}, {"y": (np.float32, 3)},
               {"p": np.array([1, 0, 2, 3], np.int64), "a": np.array([-1, 0], np.int64)}, opset=18)
    _check(m, {"x": x})


@pytest.mark.parametrize("indices,op_type", [
    (np.array(-1, np.int64), "AffineGather"),                # x[:, -1]: y[b, h] = x[b, 4, h]
    (np.array([[0, 1], [2, 3]], np.int64), "AffineGather"),  # y[b, j, k, h] = x[b, 2j + k, h]
    (np.array([1, 3], np.int64), "Slice"),
    (np.array([3, 0, 2], np.int64), "Gather"),
])
def test_gather_with_constant_indices(indices, op_type):
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    m = _model([helper.make_node("Gather", ["x", "i"], ["y"], axis=1)], {"x": x},
               {"y": (np.float32, 2 + indices.ndim)}, {"i": indices})
    g = _check(m, {"x": x})
    assert [op.op_type for op in g.nodes] == [op_type]
    if op_type != "Gather":
        assert all(affine_form(e) is not None for idx in _reads(g.nodes[0]) for e in idx)


def test_gather_nd_of_broadcast_aranges_is_affine():
    """The attention-mask pattern of torch.export: GatherND at constant (batch, position) pairs."""
    mask = rng.integers(0, 2, (2, 8)).astype(np.int64)
    pairs = np.stack(np.broadcast_arrays(np.arange(2)[:, None, None, None], np.arange(8)[None, None, None, :]), -1)
    m = _model([helper.make_node("GatherND", ["m", "p"], ["y"])], {"m": mask}, {"y": (np.int64, 4)}, {"p": pairs})
    g = _check(m, {"m": mask})
    (op,) = g.nodes
    assert op.op_type == "AffineGather"
    (idx,) = _reads(op)
    axes = op.task.outputs[0].axes
    assert [affine_form(e) for e in idx] == [({axes[0]: 1}, 0), ({axes[3]: 1}, 0)]


def test_gather_family_with_runtime_indices():
    x = rng.standard_normal((4, 5, 3)).astype(np.float32)
    i = np.array([[3, -1], [0, 2]], np.int64)
    ie = rng.integers(-5, 5, (4, 2, 3)).astype(np.int64)
    ind = np.array([[[1], [0]], [[4], [-2]], [[0], [0]], [[2], [1]]], np.int64)
    nodes = [helper.make_node("Gather", ["x", "i"], ["g"], axis=0),
             helper.make_node("GatherElements", ["x", "ie"], ["ge"], axis=1),
             helper.make_node("GatherND", ["x", "ind"], ["gn"], batch_dims=1)]
    m = _model(nodes, {"x": x, "i": i, "ie": ie, "ind": ind},
               {"g": (np.float32, 4), "ge": (np.float32, 3), "gn": (np.float32, 3)})
    _check(m, {"x": x, "i": i, "ie": ie, "ind": ind})


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatters(reduction):
    data = rng.standard_normal((4, 3)).astype(np.float32)
    idx = np.array([[1, 0, 2], [3, 0, 1]], np.int64)
    upd = rng.standard_normal((2, 3)).astype(np.float32)
    nd_idx = np.array([[1], [3], [1]], np.int64) if reduction != "none" else np.array([[1], [3]], np.int64)
    nd_upd = rng.standard_normal((nd_idx.shape[0], 3)).astype(np.float32)
    nodes = [helper.make_node("ScatterElements", ["d", "i", "u"], ["se"], axis=0, reduction=reduction),
             helper.make_node("ScatterND", ["d", "ni", "nu"], ["sn"], reduction=reduction)]
    feeds = {"d": data, "i": idx, "u": upd, "ni": nd_idx, "nu": nd_upd}
    _check(_model(nodes, feeds, {"se": (np.float32, 2), "sn": (np.float32, 2)}), feeds)


def test_one_hot_range_trilu_and_shape_generators():
    ind = np.array([[0, 2], [-1, 5]], np.int64)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("OneHot", ["ind", "depth", "vals"], ["oh"], axis=1),
        helper.make_node("Shape", ["x"], ["shp"], start=-1),
        helper.make_node("ConstantOfShape", ["shp"], ["ones"],
                         value=numpy_helper.from_array(np.array([1.0], np.float32))),
        helper.make_node("Squeeze", ["shp"], ["n"]),
        helper.make_node("Range", ["zero", "n", "one"], ["r"]),
        helper.make_node("Trilu", ["x", "k"], ["tri"], upper=0),
        helper.make_node("EyeLike", ["x"], ["eye"], k=1),
        helper.make_node("Size", ["x"], ["size"]),
        helper.make_node("Expand", ["ones", "shp2"], ["ex"]),
    ]
    inits = {"depth": np.array(4, np.int64), "vals": np.array([-1.0, 3.0], np.float32),
             "zero": np.array(0, np.int64), "one": np.array(1, np.int64), "k": np.array(-1, np.int64),
             "shp2": np.array([2, 1], np.int64)}
    outs = {"oh": (np.float32, 3), "ones": (np.float32, 1), "r": (np.int64, 1), "tri": (np.float32, 2),
            "eye": (np.float32, 2), "size": (np.int64, 0), "ex": (np.float32, 2)}
    _check(_model(nodes, {"ind": ind, "x": x}, outs, inits), {"ind": ind, "x": x})


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_round_trip(mode):
    x = rng.standard_normal((1, 8, 2, 3)).astype(np.float32)
    nodes = [helper.make_node("DepthToSpace", ["x"], ["d"], blocksize=2, mode=mode),
             helper.make_node("SpaceToDepth", ["d"], ["y"], blocksize=2)]
    _check(_model(nodes, {"x": x}, {"d": (np.float32, 4), "y": (np.float32, 4)}, opset=13), {"x": x})


def test_constant_folding_of_value_dependent_ops():
    x = rng.standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("NonZero", ["c"], ["nz"]),
             helper.make_node("Compress", ["x", "cond"], ["cx"], axis=1),
             helper.make_node("Unique", ["u"], ["uy", "ui", "uinv", "uc"], sorted=0)]
    inits = {"c": np.array([[0, 1], [2, 0]], np.int64), "cond": np.array([True, False, True]),
             "u": np.array([3, 1, 3, 2, 1], np.int64)}
    outs = {"nz": (np.int64, 2), "cx": (np.float32, 2), "uy": (np.int64, 1), "ui": (np.int64, 1),
            "uinv": (np.int64, 1), "uc": (np.int64, 1)}
    g = _check(_model(nodes, {"x": x}, outs, inits), {"x": x})
    assert [op.op_type for op in g.nodes] == ["Slice"]   # condition [T, F, T] selects a stride-2 slice


@pytest.mark.parametrize("center,thresholds", [(0, "all"), (0, "iou"), (1, "all"), (0, "none")])
def test_non_max_suppression_of_constants(center, thresholds):
    """NonMaxSuppression folded at import (its output's length depends on the values): 2 batches, 3
    classes, 12 boxes with overlapping clusters, tied scores, corners given in either order, an
    empty box; against onnxruntime."""
    r = np.random.default_rng(7)
    xy = np.repeat(r.uniform(0, 10, (2, 4, 2)), 3, axis=1) + r.uniform(-0.6, 0.6, (2, 12, 2))
    wh = r.uniform(0.5, 3, (2, 12, 2))
    if center:
        boxes = np.concatenate([xy, wh], axis=2)
    else:
        boxes = np.concatenate([xy[..., ::-1], xy[..., ::-1] + wh[..., ::-1]], axis=2)
        boxes[0, 1] = boxes[0, 1, [2, 3, 0, 1]]  # corners in the other order
        boxes[1, 4, 2:] = boxes[1, 4, :2]  # an empty box
    scores = np.round(r.uniform(0, 1, (2, 3, 12)), 1)  # ties
    inits = {"boxes": boxes.astype(np.float32), "scores": scores.astype(np.float32),
             "max": np.array([4], np.int64), "iou": np.array([0.3], np.float32), "floor": np.array([0.25], np.float32)}
    names = {"all": ["boxes", "scores", "max", "iou", "floor"], "iou": ["boxes", "scores", "max", "iou"],
             "none": ["boxes", "scores"]}[thresholds]
    x = np.zeros(1, np.float32)
    nodes = [helper.make_node("NonMaxSuppression", names, ["sel"], center_point_box=center),
             helper.make_node("Identity", ["x"], ["xo"])]
    g = _check(_model(nodes, {"x": x}, {"sel": (np.int64, 2), "xo": (np.float32, 1)},
                      {k: inits[k] for k in names}), {"x": x})
    assert not any(op.op_type == "NonMaxSuppression" for op in g.nodes)


def test_non_max_suppression_of_computed_boxes_names_the_inputs():
    boxes = np.zeros((1, 3, 4), np.float32)
    m = _model([helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["sel"])],
               {"boxes": boxes, "scores": np.zeros((1, 2, 3), np.float32)}, {"sel": (np.int64, 2)})
    with pytest.raises(UnsupportedOperatorError, match=r"must be known at compile time.*\['boxes'\]"):
        load_onnx(m)


def test_value_dependent_shapes_are_refused():
    x = rng.standard_normal((3, 4)).astype(np.float32)
    m = _model([helper.make_node("Compress", ["x", "cond"], ["y"], axis=0)],
               {"x": x, "cond": np.array([True, False, True])}, {"y": (np.float32, 2)})
    with pytest.raises(UnsupportedOperatorError, match="must be known at compile time"):
        load_onnx(m)


@pytest.mark.parametrize("node,inits,err,msg", [
    (helper.make_node("Reshape", ["x", "s"], ["y"]), {"s": np.array([5, -1], np.int64)}, ShapeError, "infer"),
    (helper.make_node("Reshape", ["x", "s"], ["y"]), {"s": np.array([-1, -1], np.int64)}, ModelFormatError, "-1"),
    (helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"]),
     {"s": np.array([0]), "e": np.array([2]), "a": np.array([0]), "t": np.array([0])}, ModelFormatError, "steps"),
    (helper.make_node("Transpose", ["x"], ["y"], perm=[0, 0]), {}, ModelFormatError, "permutation"),
    (helper.make_node("Gather", ["x", "i"], ["y"], axis=1), {"i": np.array([4], np.int64)}, ShapeError, "range"),
    (helper.make_node("Squeeze", ["x", "a"], ["y"]), {"a": np.array([0], np.int64)}, ShapeError, "squeeze"),
    (helper.make_node("Split", ["x"], ["a", "b"], axis=1, num_outputs=3), {}, ModelFormatError, "num_outputs"),
    (helper.make_node("Pad", ["x", "p"], ["y"], mode="circular"), {"p": np.zeros(4, np.int64)},
     ModelFormatError, "mode"),
])
def test_malformed_nodes_raise_typed_errors(node, inits, err, msg):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    outs = {o: (np.float32, 2) for o in node.output}
    with pytest.raises(err, match=msg):
        load_onnx(_model([node], {"x": x}, outs, inits))
