"""BitCast (opset 26): the bytes of a tensor read as another type of the same width. Imported and run
against numpy's ``view`` (onnxruntime here predates opset 26), refused widths, and a model with a BitCast
between two kernels compiled for the cpu target (it runs as a view of its input's bytes, no kernel),
compiled for cuda (nvcc), and planned over two ranks."""
import shutil

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import ModelFormatError, compile, load_onnx
from shardflow.compiler.parallel import partition, search, simulate
from shardflow.runtime import load

_T = {"float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "uint32": TensorProto.UINT32,
      "float64": TensorProto.DOUBLE, "int64": TensorProto.INT64, "bool": TensorProto.BOOL, "uint8": TensorProto.UINT8,
      "int8": TensorProto.INT8, "float16": TensorProto.FLOAT16, "int16": TensorProto.INT16}


def bitcast_model(src: str, dst: str, shape, pre=None, post=None) -> "helper.ModelProto":
    """``x`` (``src``) -> [``pre``: x * 3] -> BitCast(to ``dst``) -> [``post``: + 1] -> ``y``."""
    nodes, cur = [], "x"
    if pre:
        nodes.append(helper.make_node("Mul", ["x", "three"], ["x3"]))
        cur = "x3"
    nodes.append(helper.make_node("BitCast", [cur], ["b"], to=_T[dst], name="bc"))
    out = "b"
    if post:
        nodes.append(helper.make_node("Add", ["b", "one"], ["y"]))
        out = "y"
    inits = [numpy_helper.from_array(np.array(3, src), "three"), numpy_helper.from_array(np.array(1, dst), "one")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", _T[src], list(shape))],
                          [helper.make_tensor_value_info(out, _T[dst], list(shape))], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 26)])
    m.ir_version = 13
    return m


CASES = [("float32", "int32"), ("int32", "float32"), ("float64", "int64"), ("bool", "uint8"), ("int8", "uint8"),
         ("float16", "int16"), ("uint32", "int32")]


def _inputs(src: str, shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if src == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if np.dtype(src).kind == "f":
        x = (rng.standard_normal(shape) * 100).astype(src)
        x.flat[:3] = [np.inf, -0.0, np.nan]
        return x
    info = np.iinfo(src)
    return rng.integers(info.min, info.max, shape, dtype=src, endpoint=True)


@pytest.mark.parametrize("src,dst", CASES)
def test_bitcast_is_numpys_view(src, dst):
    x = _inputs(src, (3, 5))
    got = load_onnx(bitcast_model(src, dst, x.shape)).run({"x": x})["b"]
    assert got.dtype == np.dtype(dst) and got.shape == x.shape
    assert got.tobytes() == x.tobytes()


def test_bitcast_of_a_constant_is_folded():
    m = bitcast_model("float32", "int32", (4,))
    m.graph.node[0].input[0] = "c"
    m.graph.initializer.append(numpy_helper.from_array(np.array([1.0, -2.0, 0.5, 0.0], np.float32), "c"))
    g = load_onnx(m)
    assert not any(op.op_type == "BitCast" for op in g.nodes)
    assert g.run({"x": np.zeros(4, np.float32)})["b"].tolist() == [1065353216, -1073741824, 1056964608, 0]


@pytest.mark.parametrize("src,dst", [("float32", "int64"), ("int8", "int16")])
def test_bitcast_of_another_width_is_refused(src, dst):
    with pytest.raises(ModelFormatError, match="is not as wide"):
        load_onnx(bitcast_model(src, dst, (2, 2)))


@pytest.mark.parametrize("src,dst", [("float32", "int32"), ("int32", "float32"), ("float64", "int64")])
def test_bitcast_between_kernels_compiled_for_cpu(tmp_path, src, dst):
    """x * 3 -> BitCast -> + 1: the BitCast is a view of the product's bytes, no kernel of its own."""
    x = _inputs(src, (4, 6), seed=1)
    if np.dtype(src).kind == "i":
        x = x // 4  # (no overflow in x * 3)
    model = bitcast_model(src, dst, x.shape, pre=True, post=True)
    with np.errstate(all="ignore"):
        want = (x * np.array(3, src)).view(dst) + np.array(1, dst)
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "bc")
    got = load(res.out_dir).run({"x": x})["y"]
    assert got.dtype == np.dtype(dst)
    np.testing.assert_array_equal(got, want)
    assert res.ranks[0]["kernels"] == 2


def test_bitcast_of_an_input_to_an_output_compiled_for_cpu(tmp_path):
    x = _inputs("float32", (2, 3))
    res = compile(bitcast_model("float32", "int32", x.shape), distributed_config={"mesh_shape": [1]},
                  optimization_config={"target": "cpu"}, out_dir=tmp_path / "bc")
    assert load(res.out_dir).run({"x": x})["b"].tobytes() == x.tobytes()


def test_bitcast_sharded_over_two_ranks():
    x = _inputs("float32", (8, 64), seed=2)
    model = bitcast_model("float32", "int32", x.shape, pre=True, post=True)
    graph = load_onnx(model)
    plan = search(graph, {"mesh_shape": [2], "memory_budget_bytes": 4000})  # (replicated: over 5000)
    assert str(plan.tensor_specs[graph.outputs[0].name]).startswith("S(")
    got = simulate(partition(graph, plan), {"x": x})["y"]
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(got, (x * np.float32(3)).view(np.int32) + 1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_bitcast_compiled_for_cuda(tmp_path):
    model = bitcast_model("float32", "int32", (4, 6), pre=True, post=True)
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cuda"},
                  out_dir=tmp_path / "bc")
    assert res.ranks[0]["kernels"] == 2
