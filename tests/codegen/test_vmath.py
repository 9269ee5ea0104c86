"""The exponentials in vector form (``cpu_library/vmath.h``, rfcs/0002 "Exponentials in vector form"): the
generated kernels call ``sfv_exp``/``sfv_exp_nonpos`` where a call is unconditional and outside a reduction's
loop, GCC calls their 4/8/16-lane forms under the x86-64 vector function ABI, and they compute the inline
helpers' values bit for bit."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as oh

from shardflow.compiler import compile, load_onnx
from shardflow.compiler.codegen.cpp import generate_cpu_source
from shardflow.compiler.codegen.fusion import fuse
from shardflow.runtime import load

ROOT = Path(__file__).resolve().parents[2]


def _x86_cxx() -> str:
    cxx = os.environ.get("CXX", "g++")
    if platform.machine() not in ("x86_64", "AMD64") or not shutil.which(cxx.split()[0]):
        pytest.skip("needs an x86-64 C++ compiler")
    return cxx


def _model(shape) -> onnx.ModelProto:
    """``x`` to ``Exp`` (unconditional: the vector form), ``Elu`` with alpha 1 (its exponential under the select:
    the inline helper), ``Sigmoid`` and ``Softmax`` over the middle axis (sfv_exp_nonpos in the exponentials'
    own loop) and over the last (in the sum's loop: inline)."""
    nodes = [oh.make_node("Exp", ["x"], ["e"]), oh.make_node("Elu", ["x"], ["elu"], alpha=1.0),
             oh.make_node("Sigmoid", ["x"], ["s"]), oh.make_node("Softmax", ["x"], ["sm1"], axis=1),
             oh.make_node("Softmax", ["x"], ["sm2"], axis=2)]
    outs = [oh.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("e", "elu", "s", "sm1", "sm2")]
    graph = oh.make_graph(nodes, "vmath", [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outs)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def _printed(model: onnx.ModelProto, fused: bool = False) -> dict[str, str]:
    """Each op's kernel text (``fused``: each fused group's, by its last op), by its output's name."""
    graph = load_onnx(model)
    ops = fuse(graph.nodes, keep={t.name for t in graph.outputs}) if fused else graph.nodes
    src = generate_cpu_source(ops)
    names = {op.name: op.outputs[0].name for op in graph.nodes}
    return {names[src.users[sym][0]]: text for sym, text in src.kernels}


def test_the_printer_calls_the_vector_forms_where_they_vectorize():
    """Unconditional exponentials (a sigmoid's too) call ``sfv_exp``/``sfv_exp_nonpos``; one under a select (Elu's
    negative side) and one in a reduction's loop (the softmax over the last axis sums them as it computes them)
    keep the inline helpers."""
    by_op = _printed(_model([2, 64, 40]))
    assert "sfv_exp(" in by_op["e"] and "sf_exp(" not in by_op["e"]
    assert "sf_exp(" in by_op["elu"] and "sfv_" not in by_op["elu"]
    assert "sfv_exp(" in by_op["s"]
    assert "sfv_exp_nonpos(" in by_op["sm1"]
    assert "sf_exp_nonpos(" in by_op["sm2"] and "sfv_" not in by_op["sm2"]


def test_the_vector_forms_compute_the_inline_helpers_values(tmp_path):
    """Compiled and run: the library links the forms (their ABI names defined in it on x86-64), and ``Exp``'s
    values (the vector form) minus 1 equal ``Elu``'s on the negative side (the inline helper) bit for bit, over
    values that reach both clamps, denormal results, infinities and NaN; all outputs against numpy."""
    shape = [3, 64, 77]  # (77: every row ends in lanes the vectorized loop leaves to the scalar clone)
    out = tmp_path / "out"
    compile(_model(shape), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=str(out))
    if platform.machine() in ("x86_64", "AMD64") and shutil.which("nm"):
        names = subprocess.run(["nm", str(out / "rank0" / "kernels.so")], capture_output=True, text=True).stdout
        for form in ("_ZGVbN4v_", "_ZGVdN8v_", "_ZGVeN16v_"):
            assert form + "sfv_exp" in names and form + "sfv_exp_nonpos" in names, form
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 40).astype(np.float32)
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, 88.7, 88.8, 89.5, -87.3, -95.0, -103.9, -104.5, -150.0, 1e-8]
    x.flat[:len(specials)] = specials
    y = load(str(out)).run({"x": x})
    neg = x < 0
    np.testing.assert_array_equal((y["e"][neg] - np.float32(1)).view(np.int32), y["elu"][neg].view(np.int32))
    with np.errstate(over="ignore", invalid="ignore"):
        ref = np.exp(x.astype(np.float64))
        np.testing.assert_allclose(y["e"], ref.astype(np.float32), rtol=3e-7, atol=1e-44)
        # (1 / (1 + exp(-x)) is 0 where exp(-x) overflows float32, below -88.7: the reference's subnormals there)
        np.testing.assert_allclose(y["s"], (1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32), rtol=5e-7,
                                   atol=3e-38)
    for name, axis in (("sm1", 1), ("sm2", 2)):
        v = x.astype(np.float64)
        with np.errstate(invalid="ignore"):
            p = np.exp(v - v.max(axis, keepdims=True))
            np.testing.assert_allclose(y[name], p / p.sum(axis, keepdims=True), rtol=2e-6, atol=1e-12, err_msg=name)


def test_every_vector_form_equals_the_inline_helper_on_sampled_bit_patterns(tmp_path):
    """``benchmarks/cpu_vmath_exhaustive.cpp`` on every 251st float bit pattern (17 million): each form and
    scalar clone this CPU runs against the inline helper vectorized by GCC for the same instruction set (the
    whole 2^32 in about two minutes: run the tool without an argument)."""
    cxx = _x86_cxx()
    exe = tmp_path / "vmath_check"
    flags = ["-std=c++17", "-O3", "-fopenmp", "-march=x86-64-v2", "-mtune=generic", "-fno-math-errno",
             "-fno-trapping-math", "-fwrapv", "-w"]
    res = subprocess.run(cxx.split() + flags + [str(ROOT / "benchmarks" / "cpu_vmath_exhaustive.cpp"), "-o", str(exe)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    run = subprocess.run([str(exe), "251"], capture_output=True, text=True, timeout=300)
    counts = re.findall(r"differs (\d+)", run.stdout)
    assert run.returncode == 0 and len(counts) >= 4 and set(counts) == {"0"}, run.stdout + run.stderr


def _half_model(shape) -> onnx.ModelProto:
    """float16 ``a + b`` and its SiLU (loads and stores of float16), ``Where(c, a, b)``, ``a`` padded by zeros on
    its last axis (its loads under a select: inline), and a float32 ``x`` cast to float16 and back before a Relu
    (fused: a rounding kept in float32)."""
    nodes = [oh.make_node("Add", ["a", "b"], ["s"]), oh.make_node("Sigmoid", ["s"], ["g"]),
             oh.make_node("Mul", ["s", "g"], ["silu"]), oh.make_node("Where", ["c", "a", "b"], ["w"]),
             oh.make_node("Pad", ["a", "pads"], ["p"], mode="constant"),
             oh.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
             oh.make_node("Cast", ["x16"], ["r"], to=TensorProto.FLOAT), oh.make_node("Relu", ["r"], ["rr"])]
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    ins = [oh.make_tensor_value_info("a", f16, shape), oh.make_tensor_value_info("b", f16, shape),
           oh.make_tensor_value_info("c", TensorProto.BOOL, shape), oh.make_tensor_value_info("x", f32, shape)]
    outs = [oh.make_tensor_value_info(n, t, shape) for n, t in (("s", f16), ("silu", f16), ("w", f16), ("rr", f32))]
    outs.append(oh.make_tensor_value_info("p", f16, shape[:-1] + [shape[-1] + 4]))
    pads = onnx.numpy_helper.from_array(np.array([0, 0, 2] + [0, 0, 2], np.int64), "pads")
    return oh.make_model(oh.make_graph(nodes, "half", ins, outs, [pads]), opset_imports=[oh.make_opsetid("", 17)])


def test_float16_loads_stores_and_roundings_take_the_vector_forms(tmp_path):
    """float16 loads print ``sfv_h2f``, stores ``sfv_f2h`` and a float32 value's rounding to float16
    ``sfv_f16_round`` (F16C's conversions in the AVX2 and AVX-512 forms), except under a select; compiled and
    run, the values are numpy's bit for bit (float16 sums, casts of floats around float16's range, subnormals,
    infinities and NaN) and the SiLU's within float16's rounding."""
    shape = [3, 64, 77]
    model = _half_model(shape)
    by_op = _printed(model, fused=True)
    assert "sfv_h2f(" in by_op["silu"] and "(uint16_t)sfv_f2h(" in by_op["silu"]
    assert "sf_h2f(" in by_op["p"] and "sfv_h2f(" not in by_op["p"] and "(uint16_t)sfv_f2h(" in by_op["p"]
    assert "sfv_f16_round(" in by_op["rr"]
    out = tmp_path / "out"
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=str(out))
    if platform.machine() in ("x86_64", "AMD64") and shutil.which("nm"):
        names = subprocess.run(["nm", str(out / "rank0" / "kernels.so")], capture_output=True, text=True).stdout
        for fn in ("sfv_h2f", "sfv_f2h", "sfv_f16_round"):
            assert "_ZGVeN16v_" + fn in names and "_ZGVdN8v_" + fn in names, fn
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(shape) * 300).astype(np.float16)
    b = (rng.standard_normal(shape) * 300).astype(np.float16)
    a.flat[:6] = [np.nan, np.inf, -np.inf, 6e-8, -3e-5, 65504]
    b.flat[:6] = [1, 1, 1, 6e-8, 1e-5, 65504]
    c = rng.random(shape) < 0.5
    x = (rng.standard_normal(shape) * 3e4).astype(np.float32)
    x.flat[:8] = [np.nan, np.inf, -np.inf, 65519.99, 65520.0, 2.9802322e-08, 1e-7, -4e-6]
    y = load(str(out)).run({"a": a, "b": b, "c": c, "x": x})
    with np.errstate(over="ignore", invalid="ignore"):
        s = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
        np.testing.assert_array_equal(y["s"].view(np.uint16), s.view(np.uint16))
        np.testing.assert_array_equal(y["w"].view(np.uint16), np.where(c, a, b).view(np.uint16))
        np.testing.assert_array_equal(y["p"].view(np.uint16), np.pad(a, [(0, 0), (0, 0), (2, 2)]).view(np.uint16))
        np.testing.assert_array_equal(y["rr"].view(np.int32),
                                      np.maximum(x.astype(np.float16).astype(np.float32), 0).view(np.int32))
        s32 = s.astype(np.float64)
        np.testing.assert_allclose(y["silu"].astype(np.float64), s32 / (1 + np.exp(-s32)), rtol=1e-3, atol=1e-7)


# Loops GCC vectorizes with calls of the helpers' vector forms, in functions for each instruction set: over
# floats (4, 8 or 16 lanes) and over doubles (half as many; the 15-long calls leave remainders to narrower forms).
_ABI_LOOPS = r"""
#define SF_ABI_LOOP(NAME, ATTR, TI, TO, CALL)                                                                  \
  SF_EXPORT ATTR void NAME(const TI* __restrict__ x, TO* __restrict__ y, int64_t n) {                          \
    for (int64_t i = 0; i < n; ++i) y[i] = (TO)CALL;                                                           \
  }
#define SF_ABI_LOOPS(ISA, ATTR, T)                                                                             \
  SF_ABI_LOOP(exp_##T##_##ISA, ATTR, T, T, sfv_exp((float)x[i]))                                               \
  SF_ABI_LOOP(nonpos_##T##_##ISA, ATTR, T, T, sfv_exp_nonpos((float)x[i]))                                     \
  SF_ABI_LOOP(round_##T##_##ISA, ATTR, T, T, sfv_f16_round((float)x[i]))                                       \
  SF_ABI_LOOP(f2h_##T##_##ISA, ATTR, T, uint16_t, sfv_f2h((float)x[i]))                                        \
  SF_ABI_LOOP(h2f_##T##_##ISA, ATTR, uint16_t, T, sfv_h2f(x[i]))
#define SF_ABI_ISA(ISA, ATTR) SF_ABI_LOOPS(ISA, ATTR, float) SF_ABI_LOOPS(ISA, ATTR, double)
SF_ABI_ISA(v2, )
SF_ABI_ISA(avx, __attribute__((target("avx"))))
SF_ABI_ISA(v3, __attribute__((target("arch=x86-64-v3"))))
SF_ABI_ISA(v4, __attribute__((target("arch=x86-64-v4"))))
SF_EXPORT int isa_runs(int k) {
  __builtin_cpu_init();
  switch (k) {
    case 0: return 1;
    case 1: return __builtin_cpu_supports("avx");
    case 2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    default: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
                    && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  }
}
"""


def test_every_vector_form_gcc_calls_is_defined_with_the_abis_signature(tmp_path):
    """The forms as GCC calls them, not by our own prototypes: loops at each instruction set (x86-64-v2, AVX,
    x86-64-v3, x86-64-v4) over floats and doubles call all twenty forms, the AVX ones included (``sfv_f2h``'s has
    4 lanes: its characteristic type is the integer it returns, and AVX's integer vectors are 128 bits; ``sfv_h2f``'s
    takes two 128-bit registers), and the library links with no symbol left undefined (a missing
    ``_ZGVcN4v_sfv_f2h`` made a float16 program fail to load, session 98). Run on every instruction set this CPU
    has: the float16 conversions equal numpy's bit for bit, the exponentials float64's within their accuracy."""
    _x86_cxx()
    import ctypes

    from shardflow.compiler.codegen.cpp import _clones_macro
    from shardflow.compiler.codegen.prelude_cpu import PRELUDE
    from shardflow.compiler.codegen.templates_cpu import prebuilt_tables
    from shardflow.compiler.codegen.toolchain import build_shared_library

    lib_path = tmp_path / "abi.so"
    units = {s: t for s, t in prebuilt_tables().items() if s.startswith("sfv_")}
    build_shared_library(PRELUDE + _clones_macro() + _ABI_LOOPS, str(lib_path), prebuilt=units)
    if shutil.which("objdump"):
        text = subprocess.run(["objdump", "-d", str(lib_path)], capture_output=True, text=True).stdout
        called = set(re.findall(r"call\s+[0-9a-f]+ <(_ZGV\w+)", text))
        want = {f"{form}{fn}" for form in ("_ZGVbN4v_", "_ZGVcN8v_", "_ZGVdN8v_", "_ZGVeN16v_")
                for fn in ("sfv_exp", "sfv_exp_nonpos", "sfv_h2f", "sfv_f16_round")}
        want |= {f"{form}sfv_f2h" for form in ("_ZGVbN4v_", "_ZGVcN4v_", "_ZGVdN8v_", "_ZGVeN16v_")}
        assert called == want, (sorted(want - called), sorted(called - want))
    lib = ctypes.CDLL(str(lib_path))
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-110, 95, 2000), rng.standard_normal(1000) * 3e4, rng.standard_normal(500) * 1e-5,
                        [np.nan, np.inf, -np.inf, 0.0, -0.0, 65519.99, 65520.0, 2.9802322e-08, -103.9, -104.5, 88.8,
                         89.5]]).astype(np.float32)
    codes = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        want_exp = np.exp(x.astype(np.float64)).astype(np.float32)
        want_nonpos = np.exp(-np.abs(x.astype(np.float64))).astype(np.float32)
        half = x.astype(np.float16)
    want_h2f = codes.view(np.float16).astype(np.float32)

    def call(name, src, out_dtype, n):
        out = np.zeros(n, out_dtype)
        getattr(lib, name)(src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
        return out

    def same_bits(got, want, what):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.array_equal(np.isnan(got), np.isnan(want)), what
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(got[ok].view(np.int32), want[ok].view(np.int32), err_msg=what)

    for k, isa in enumerate(("v2", "avx", "v3", "v4")):
        if not lib.isa_runs(k):
            continue
        for t in (np.float32, np.float64):
            tn = "float" if t is np.float32 else "double"
            for n in (len(x), 15):  # (15: the vectorized loops' remainders)
                xs, what = x[:n].astype(t), f"{isa} {tn} n={n}"
                with np.errstate(over="ignore", invalid="ignore"):
                    np.testing.assert_allclose(call(f"exp_{tn}_{isa}", xs, t, n), want_exp[:n], rtol=3e-7,
                                               atol=1e-44, err_msg="exp " + what)
                    np.testing.assert_allclose(call(f"nonpos_{tn}_{isa}", -np.abs(xs), t, n), want_nonpos[:n],
                                               rtol=3e-7, atol=1e-44, err_msg="exp_nonpos " + what)
                same_bits(call(f"round_{tn}_{isa}", xs, t, n), half[:n].astype(np.float32), "f16_round " + what)
                f2h = call(f"f2h_{tn}_{isa}", xs, np.uint16, n)
                same_bits(f2h.view(np.float16).astype(np.float32), half[:n].astype(np.float32), "f2h " + what)
            for n in (len(codes), 15):  # (every float16 code)
                same_bits(call(f"h2f_{tn}_{isa}", codes[:n], t, n), want_h2f[:n], f"h2f {isa} {tn} n={n}")
