"""A float8 test model (tests/frontend/test_float8.py compiles it for the cpu target,
tests/codegen/test_cuda_host.py runs its cuda kernels on the host emulation)."""
import ml_dtypes
import numpy as np
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT

_F8 = {"float8_e4m3fn": TensorProto.FLOAT8E4M3FN, "float8_e4m3fnuz": TensorProto.FLOAT8E4M3FNUZ,
       "float8_e5m2": TensorProto.FLOAT8E5M2, "float8_e5m2fnuz": TensorProto.FLOAT8E5M2FNUZ}


def float8_model(kind: str, saturate: int):
    """``x`` [4, 64] float32 -> ``q`` = QuantizeLinear(x, 0.5, 0 of ``kind``) and ``c`` = Cast(x,
    ``kind``, ``saturate``) (float8 outputs), ``y`` = DequantizeLinear(q) * 2 + Cast(c, float32)
    (float32); and inputs with every special value, ties, subnormals and overflows."""
    t = _F8[kind]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], saturate=saturate),
             helper.make_node("Cast", ["x"], ["c"], to=t, saturate=saturate),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["d"]),
             helper.make_node("Cast", ["c"], ["cf"], to=F),
             helper.make_node("Mul", ["d", "two"], ["d2"]),
             helper.make_node("Add", ["d2", "cf"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "s"), helper.make_tensor("zp", t, [], [0.0]),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [4, 64])],
                          [helper.make_tensor_value_info(n, dt, [4, 64]) for n, dt in (("q", t), ("c", t), ("y", F))],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    ft = getattr(ml_dtypes, kind)
    rng = np.random.default_rng(2)
    vals = np.unique(np.arange(256, dtype=np.uint8).view(ft).astype(np.float32))
    vals = vals[np.isfinite(vals)]
    mids = (vals[:-1] + vals[1:]) / 2  # (ties: to even)
    big = float(ml_dtypes.finfo(ft).max)
    x = np.concatenate([vals[-40:], mids[-40:], mids[:40], [np.nan, np.inf, -np.inf, -0.0, 0.0, big * 1.2, -big * 3,
                                                            1e-30, -1e-30, 3e38],
                        rng.standard_normal(256) * 50])[:256].astype(np.float32)
    return m, {"x": x.reshape(4, 64)}


def same_values(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """Equal values (NaN where the other has NaN; zeros with their sign)."""
    g, w = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
    ok = ~np.isnan(w)
    np.testing.assert_array_equal(g[ok], w[ok], err_msg=name)
    np.testing.assert_array_equal(np.signbit(g[ok]), np.signbit(w[ok]), err_msg=name)
