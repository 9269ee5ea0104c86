"""GridSample, RoiAlign and DeformConv: imported models against onnxruntime (or the ONNX reference
evaluator where onnxruntime lacks the case or departs from the reference), errors by type and message,
GridSample and DeformConv models sharded over two ranks, and models of the three compiled for the cpu
target."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from shardflow.compiler import ModelFormatError, ShapeError, UnsupportedOperatorError, compile, load_onnx
from shardflow.compiler.parallel import partition, search, simulate
from shardflow.runtime import load

ort = pytest.importorskip("onnxruntime")
from onnx_oracles import run_ort, run_reference  # noqa: E402

_TYPES = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.float64): onnx.TensorProto.DOUBLE,
          np.dtype(np.float16): onnx.TensorProto.FLOAT16, np.dtype(np.int64): onnx.TensorProto.INT64,
          np.dtype(np.int32): onnx.TensorProto.INT32}


def make_model(op: str, opset: int, inputs: dict, out_shape, initializers: dict | None = None,
               **attrs) -> onnx.ModelProto:
    """A one-node model reading ``inputs`` (name -> example array; those in ``initializers`` are constants)
    and producing ``y`` of ``out_shape`` and the first input's type."""
    initializers = initializers or {}
    node = helper.make_node(op, list(inputs), ["y"], name="node0", **attrs)
    first = _TYPES[next(iter(inputs.values())).dtype]
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, _TYPES[v.dtype], v.shape) for n, v in inputs.items()
         if n not in initializers],
        [helper.make_tensor_value_info("y", first, list(out_shape))],
        [numpy_helper.from_array(v, n) for n, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def check(model: onnx.ModelProto, feeds: dict, reference, tol: float = 2e-5) -> np.ndarray:
    want = reference(model, feeds)
    got = load_onnx(model).run(feeds)["y"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return got


# GridSample ---------------------------------------------------------------------------------------

def grid_inputs(d: int, seed: int = 0, dtype=np.float32) -> dict:
    """An image and a grid reaching well outside [-1, 1], with points exactly on pixel centres, corners
    and (for nearest) halfway between two pixels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3) + ((4, 5) if d == 2 else (3, 4, 5))).astype(dtype)
    g = rng.uniform(-2.7, 2.7, (2,) + ((3, 4) if d == 2 else (2, 3, 4)) + (d,)).astype(dtype)
    g.flat[:10] = [-1, 1, 0, -1.5, 2.0, 0.25, -0.75, 0.5, -0.2, 1.1]
    return {"x": x, "g": g}


def grid_model(opset: int, inputs: dict, **attrs) -> onnx.ModelProto:
    x, g = inputs["x"], inputs["g"]
    return make_model("GridSample", opset, inputs, x.shape[:2] + g.shape[1:-1], **attrs)


@pytest.mark.parametrize("d,mode,padding,align", list(itertools.product(
    (2, 3), ("nearest", "linear", "cubic"), ("zeros", "border", "reflection"), (0, 1))))
def test_grid_sample(d, mode, padding, align):
    inputs = grid_inputs(d, seed=d + align)
    model = grid_model(20, inputs, mode=mode, padding_mode=padding, align_corners=align)
    # onnxruntime has no 3-D cubic mode, and its 2-D cubic border mode pads each tap (as PyTorch does)
    # where the reference clamps the coordinate first: those cases go against the reference
    reference = run_reference if mode == "cubic" and (d == 3 or padding == "border") else run_ort
    check(model, inputs, reference)


@pytest.mark.parametrize("opset,mode", [(16, "bilinear"), (16, "nearest"), (16, "bicubic"), (22, "linear"),
                                        (22, "nearest")])
def test_grid_sample_opsets(opset, mode):
    inputs = grid_inputs(2, seed=5)
    check(grid_model(opset, inputs, mode=mode, padding_mode="reflection"), inputs, run_ort)


def test_grid_sample_nearest_rounds_half_to_even():
    # align_corners=1 over 5 pixels: x = (g + 1) * 2, so g = -0.75, -0.25, 0.25, 0.75 land on 0.5 .. 3.5
    x = np.arange(5, dtype=np.float32).reshape(1, 1, 1, 5)
    g = np.zeros((1, 1, 4, 2), np.float32)
    g[..., 0] = [-0.75, -0.25, 0.25, 0.75]
    inputs = {"x": x, "g": g}
    y = check(grid_model(20, inputs, mode="nearest", align_corners=1), inputs, run_ort)
    np.testing.assert_array_equal(y.ravel(), [0, 2, 2, 4])


@pytest.mark.parametrize("mode,padding", list(itertools.product(("nearest", "linear", "cubic"),
                                                               ("zeros", "border", "reflection"))))
def test_grid_sample_1d_and_single_pixel_axis(mode, padding):
    rng = np.random.default_rng(4)
    line = {"x": rng.standard_normal((2, 3, 5)).astype(np.float32),
            "g": rng.uniform(-3, 3, (2, 6, 1)).astype(np.float32)}
    check(grid_model(20, line, mode=mode, padding_mode=padding), line, run_reference)
    # one pixel high with align_corners: the reflection borders coincide
    flat = {"x": rng.standard_normal((1, 2, 1, 4)).astype(np.float32),
            "g": rng.uniform(-1.5, 1.5, (1, 3, 3, 2)).astype(np.float32)}
    check(grid_model(20, flat, mode="linear", padding_mode=padding, align_corners=1), flat, run_ort)


def test_grid_sample_float64_and_integer_nearest():
    inputs = grid_inputs(2, seed=3, dtype=np.float64)
    check(grid_model(20, inputs, mode="cubic", padding_mode="zeros"), inputs, run_ort, tol=1e-9)
    ints = {"x": (inputs["x"] * 10).astype(np.int32), "g": inputs["g"].astype(np.float32)}
    y = check(grid_model(20, ints, mode="nearest", padding_mode="border"), ints, run_reference)
    assert y.dtype == np.int32


@pytest.mark.parametrize("opset,xshape,gshape,attrs,error,match", [
    (16, (1, 1, 2, 3, 4), (1, 2, 2, 2, 3), {}, ShapeError, "X must be 4-D"),
    (20, (1, 1, 3, 4), (1, 2, 2, 3), {}, ShapeError, "does not fit X"),
    (16, (1, 1, 3, 4), (1, 2, 2, 2), {"mode": "linear"}, ModelFormatError, "mode must be one of bilinear"),
    (20, (1, 1, 3, 4), (1, 2, 2, 2), {"mode": "bicubic"}, ModelFormatError, "mode must be one of linear"),
    (20, (1, 1, 3, 4), (1, 2, 2, 2), {"padding_mode": "wrap"}, ModelFormatError, "padding_mode"),
])
def test_grid_sample_errors(opset, xshape, gshape, attrs, error, match):
    inputs = {"x": np.zeros(xshape, np.float32), "g": np.zeros(gshape, np.float32)}
    model = make_model("GridSample", opset, inputs, xshape[:2] + gshape[1:-1], **attrs)
    with pytest.raises(error, match=match) as info:
        load_onnx(model)
    assert "node0" in str(info.value)


def test_grid_sample_refuses_linear_on_integers():
    inputs = {"x": np.zeros((1, 1, 3, 4), np.int32), "g": np.zeros((1, 2, 2, 2), np.float32)}
    with pytest.raises(UnsupportedOperatorError, match=r"node0 .*linear interpolation of a int32 input"):
        load_onnx(make_model("GridSample", 20, inputs, (1, 1, 2, 2)))


def conv_grid_sample() -> tuple[onnx.ModelProto, dict]:
    """A 1x1 convolution whose output is resampled (cubic, reflection) at a grid given at run time."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((8, 8, 1, 1)) / 3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"]),
             helper.make_node("GridSample", ["h", "g"], ["y"], mode="cubic", padding_mode="reflection")]
    graph = helper.make_graph(
        nodes, "warp",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8, 6, 7]),
         helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, [2, 5, 4, 2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8, 5, 4])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    inputs = {"x": rng.standard_normal((2, 8, 6, 7)).astype(np.float32),
              "g": rng.uniform(-1.4, 1.4, (2, 5, 4, 2)).astype(np.float32)}
    return model, inputs


def test_grid_sample_sharded_over_two_ranks():
    model, inputs = conv_grid_sample()
    want = run_ort(model, inputs)
    graph = load_onnx(model)
    # replicated, the model needs more than 50,000 B a rank; 30,000 B makes the search split the batch
    plan = search(graph, {"mesh_shape": [2], "memory_budget_bytes": 30_000})
    assert str(plan.tensor_specs["y"]).startswith("S(")
    got = simulate(partition(graph, plan), inputs)
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)


def test_grid_sample_compiled_for_cpu(tmp_path):
    inputs = grid_inputs(2, seed=11)
    model = grid_model(20, inputs, mode="linear", padding_mode="zeros")
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "gs")
    got = load(res.out_dir).run(inputs)["y"]
    np.testing.assert_allclose(got, run_ort(model, inputs), rtol=1e-5, atol=1e-5)


# RoiAlign -----------------------------------------------------------------------------------------

ROIS = np.array([[0, 0, 5, 4], [1.3, 2.2, 6.9, 5.5], [-3, -2, 2, 8], [4, 4, 3.5, 4.2], [2, 1, 2, 1],
                 [6.5, 5.5, 9, 9], [0.4, 0.6, 13.1, 11.7]], np.float32)


def roi_inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((2, 3, 6, 7)).astype(np.float32), "rois": ROIS,
            "batch": np.array([0, 1, 1, 0, 1, 0, 1], np.int64)}


def roi_model(opset: int, inputs: dict, const_rois: bool, oh: int = 3, ow: int = 2, **attrs) -> onnx.ModelProto:
    out = (inputs["rois"].shape[0], inputs["x"].shape[1], oh, ow)
    inits = {"rois": inputs["rois"]} if const_rois else {}
    return make_model("RoiAlign", opset, inputs, out, inits, output_height=oh, output_width=ow, **attrs)


@pytest.mark.parametrize("opset,mode,ctm,ratio", [
    (o, m, c, r) for o, m, c, r in itertools.product((10, 16, 22), ("avg", "max"),
                                                       ("half_pixel", "output_half_pixel"), (0, 2))
    if o > 10 or c == "output_half_pixel"])
def test_roi_align(opset, mode, ctm, ratio):
    inputs = roi_inputs(opset)
    attrs = {"mode": mode, "sampling_ratio": ratio, "spatial_scale": 0.75}
    if opset >= 16:
        attrs["coordinate_transformation_mode"] = ctm
    # sampling_ratio 0 (adaptive) needs the rois at import: they are an initializer there
    model = roi_model(opset, inputs, const_rois=ratio == 0, **attrs)
    feeds = {k: v for k, v in inputs.items() if ratio or k != "rois"}
    # onnxruntime has no RoiAlign-22; the reference evaluator treats opset 10 as half_pixel, where the spec
    # (and onnxruntime) do not shift
    check(model, feeds, run_reference if opset >= 22 else run_ort)


def test_roi_align_adaptive_sampling_needs_known_rois():
    inputs = roi_inputs()
    model = roi_model(16, inputs, const_rois=False, sampling_ratio=0)
    with pytest.raises(UnsupportedOperatorError, match=r"node0 .*must be known at compile time.*sampling_ratio=0"):
        load_onnx(model)
    # bound at import, the rois make it work
    got = load_onnx(model, input_values={"rois": ROIS}).run({"x": inputs["x"], "batch": inputs["batch"]})["y"]
    np.testing.assert_allclose(got, run_ort(model, inputs), rtol=2e-5, atol=2e-5)


def test_roi_align_compiled_for_cpu(tmp_path):
    inputs = roi_inputs(3)
    model = roi_model(16, inputs, const_rois=True, mode="max", sampling_ratio=0)
    feeds = {k: v for k, v in inputs.items() if k != "rois"}
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "roi")
    np.testing.assert_allclose(load(res.out_dir).run(feeds)["y"], run_ort(model, feeds), rtol=1e-5, atol=1e-5)


def test_roi_align_batch_indices_outside_the_batch_are_refused(tmp_path):
    """A batch index outside ``[0, N)`` (the spec's range) is an error as in onnxruntime: the evaluator
    raises a ShapeError naming the node, a compiled program an InputIndexError before the run (the
    gather of the image rows would take -1 as the last image, and clamp 2 to it)."""
    from shardflow.runtime import InputIndexError

    inputs = roi_inputs(4)
    model = roi_model(16, inputs, const_rois=True, sampling_ratio=2)
    feeds = {k: v for k, v in inputs.items() if k != "rois"}
    prog = load(compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                        out_dir=tmp_path / "roi").out_dir)
    np.testing.assert_allclose(prog.run(feeds)["y"], run_ort(model, feeds), rtol=1e-5, atol=1e-5)
    for bad in (-1, 2):
        f = dict(feeds, batch=np.where(np.arange(7) == 3, bad, feeds["batch"]))
        with pytest.raises(Exception, match=rf"batch_indices value {bad} at index 3 is out of range \[0, 2\)"):
            run_ort(model, f)
        with pytest.raises(ShapeError, match=rf"node0/batch_indices_in_range: batch_indices holds {bad}, "
                                             r"outside \[0, 1\]"):
            load_onnx(model).run(f)
        with pytest.raises(InputIndexError, match=rf"input 'batch' holds the index {bad}, outside \[0, 1\]"):
            prog.run(f)


def test_roi_align_refuses_adaptive_sampling_of_huge_rois():
    inputs = roi_inputs()
    inputs["rois"] = ROIS * np.float32(1000)
    with pytest.raises(UnsupportedOperatorError, match=r"node0 .*adaptive sampling with \d+ x \d+ samples per bin"):
        load_onnx(roi_model(16, inputs, const_rois=True, sampling_ratio=0))


@pytest.mark.parametrize("attrs,error,match", [
    ({"mode": "min"}, ModelFormatError, "mode must be 'avg' or 'max'"),
    ({"coordinate_transformation_mode": "asymmetric"}, ModelFormatError, "coordinate_transformation_mode"),
    ({"oh": 0}, ModelFormatError, "must be positive"),
])
def test_roi_align_errors(attrs, error, match):
    inputs = roi_inputs()
    with pytest.raises(error, match=match) as info:
        load_onnx(roi_model(16, inputs, const_rois=False, **{"sampling_ratio": 1, **attrs}))
    assert "node0" in str(info.value)


# DeformConv -----------------------------------------------------------------------------------------

def deform_inputs(n=2, c=4, oc=6, hw=(6, 7), k=(3, 3), group=1, og=1, strides=(1, 1), dil=(1, 1),
                  pads=(1, 1, 1, 1), mask=True, bias=True, seed=0) -> tuple[dict, tuple]:
    """Inputs of a DeformConv and its output shape; offsets up to +-3 pixels (some taps land off the
    image, some between pixels, a few exactly on pixel centres)."""
    rng = np.random.default_rng(seed)
    oh = (hw[0] + pads[0] + pads[2] - dil[0] * (k[0] - 1) - 1) // strides[0] + 1
    ow = (hw[1] + pads[1] + pads[3] - dil[1] * (k[1] - 1) - 1) // strides[1] + 1
    inputs = {"x": rng.standard_normal((n, c) + hw).astype(np.float32),
              "w": rng.standard_normal((oc, c // group) + k).astype(np.float32),
              "offset": rng.uniform(-3, 3, (n, og * 2 * k[0] * k[1], oh, ow)).astype(np.float32)}
    inputs["offset"].flat[::7] = np.round(inputs["offset"].flat[::7])
    if bias:
        inputs["b"] = rng.standard_normal(oc).astype(np.float32)
    if mask:
        inputs["mask"] = rng.uniform(0, 1, (n, og * k[0] * k[1], oh, ow)).astype(np.float32)
    return inputs, (n, oc, oh, ow)


def deform_model(inputs: dict, out_shape, const_weights=False, **attrs) -> onnx.ModelProto:
    names = ["x", "w", "offset", "b" if "b" in inputs else "", "mask" if "mask" in inputs else ""]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("DeformConv", names, ["y"], name="node0", **attrs)
    inits = {k: inputs[k] for k in ("w", "b") if const_weights and k in inputs}
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, v.shape) for k, v in inputs.items()
                      if k not in inits],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(out_shape))],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("case", [
    {},
    {"mask": False, "bias": False},
    {"group": 2, "og": 2, "c": 4, "oc": 4},
    {"og": 4, "c": 4},
    {"strides": (2, 1), "dil": (1, 2), "pads": (0, 2, 1, 1), "k": (2, 3)},
    {"k": (1, 1), "pads": (0, 0, 0, 0), "hw": (5, 5)},
])
def test_deform_conv(case):
    kw = dict(case)
    inputs, out = deform_inputs(**kw)
    attrs = {"kernel_shape": list(kw.get("k", (3, 3))), "pads": list(kw.get("pads", (1, 1, 1, 1))),
             "strides": list(kw.get("strides", (1, 1))), "dilations": list(kw.get("dil", (1, 1))),
             "group": kw.get("group", 1), "offset_group": kw.get("og", 1)}
    model = deform_model(inputs, out, **attrs)
    got = check(model, inputs, run_ort, tol=1e-4)
    np.testing.assert_allclose(got, run_reference(model, inputs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inputs_change,attrs,error,match", [
    ({"x": np.zeros((1, 4, 5, 6, 7), np.float32)}, {}, UnsupportedOperatorError, "3-D DeformConv"),
    ({"offset": np.zeros((2, 9, 6, 7), np.float32)}, {}, ShapeError, "offset of shape"),
    ({}, {"group": 3}, ShapeError, "do not fit"),
    ({}, {"strides": [0, 1]}, ModelFormatError, "must be positive"),
    ({"mask": np.zeros((2, 9, 6, 6), np.float32)}, {}, ShapeError, "mask of shape"),
])
def test_deform_conv_errors(inputs_change, attrs, error, match):
    inputs, out = deform_inputs()
    inputs.update(inputs_change)
    with pytest.raises(error, match=match):
        load_onnx(deform_model(inputs, out, **{"pads": [1, 1, 1, 1], **attrs}))


def test_deform_conv_compiled_for_cpu_and_on_two_ranks(tmp_path):
    """Constant weights and bias, compiled for the cpu target, against onnxruntime; and the same graph
    planned on two ranks (its batch split under a memory budget) and simulated."""
    inputs, out = deform_inputs(n=2, c=8, oc=16, hw=(9, 10), og=2, group=2, seed=3)
    model = deform_model(inputs, out, const_weights=True, kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         group=2, offset_group=2)
    feeds = {k: inputs[k] for k in ("x", "offset", "mask")}
    want = run_ort(model, feeds)
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "dc")
    np.testing.assert_allclose(load(res.out_dir).run(feeds)["y"], want, rtol=1e-4, atol=1e-4)
    graph = load_onnx(model)
    # replicated it needs about 520 kB a rank; 400 kB makes the search split the batch
    plan = search(graph, {"mesh_shape": [2], "memory_budget_bytes": 400_000})
    assert str(plan.tensor_specs[graph.outputs[0].name]).startswith("S(")
    got = simulate(partition(graph, plan), feeds)
    np.testing.assert_allclose(got["y"], want, rtol=1e-4, atol=1e-4)
