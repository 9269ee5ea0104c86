"""The Hopper GEMM epilogue (RFC 0005 decision 22) run on the host, without a GPU.

The code generator's epilogue for a fused GEMM (the statements that turn accumulator ``sf_acc``
into the output, with their reads of bias and residual) and the loop that hands a staged tile's
elements to the threads (``cuda_wgmma._epilogue_loop``) are plain C++ apart from a few CUDA types.
Here they are compiled with g++ (``_Float16`` for ``__half``) into a host function that stages
every tile of a given accumulator matrix in shared-memory layout (a TMA kernel's 64 x 32 chunks,
a cp.async kernel's whole 128 x 128 tile) and runs the loop for each thread in turn. The output
must equal numpy's, bit for bit, every element must be written, and every vector access must be
aligned for its width (the GPU would fault where the host does not). The wgmma main loop itself
needs a GPU (test_wgmma.py).
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from shardflow.compiler.codegen import cuda as cg
from shardflow.compiler.codegen.cuda_wgmma import _CHUNK, _LDS, _epilogue_loop
from shardflow.compiler.codegen.fusion import fuse
from shardflow.compiler.ir import Tensor
from shardflow.compiler.ops.elementwise import Binary, CastOp
from shardflow.compiler.ops.linalg import Einsum, Gemm
from shardflow.compiler.ops.transform import Transpose

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

_HOST = r"""
#include <cmath>
#include <cstdint>
typedef _Float16 __half;
struct float4 { float x, y, z, w; };
template <typename T> struct alignas(4 * sizeof(T)) SfVec4 { T v[4]; };
static inline float __half2float(__half x) { return (float)x; }
static inline __half __float2half_rn(float x) { return (__half)x; }
static inline float sf_rh(float x) { return (float)(__half)x; }
static int sf_misaligned = 0;
template <typename V, typename P> static const V* sf_at(const P* p) {
  if ((uintptr_t)p % alignof(V)) ++sf_misaligned;
  return reinterpret_cast<const V*>(p);
}
template <typename V, typename P> static V* sf_at_w(P* p) {
  if ((uintptr_t)p % alignof(V)) ++sf_misaligned;
  return reinterpret_cast<V*>(p);
}
extern "C" int epilogue(PARAMS, const float* sf_product) {
  alignas(16) static float sf_Cw[SF_ROWS * SF_LDS];
  for (int sf_m0 = 0; sf_m0 < SF_M; sf_m0 += SF_ROWS) {
    for (int sf_n0 = 0; sf_n0 < SF_N; sf_n0 += SF_COLS) {
      for (int r = 0; r < SF_ROWS; ++r)
        for (int c = 0; c < SF_LDS; ++c)
          sf_Cw[r * SF_LDS + c] = (c < SF_COLS && sf_m0 + r < SF_M && sf_n0 + c < SF_N)
                                      ? sf_product[(sf_m0 + r) * SF_N + sf_n0 + c] : NAN;
      for (int sf_t = 0; sf_t < SF_THREADS; ++sf_t) {
LOOP
      }
    }
  }
  return sf_misaligned;
}
"""


def _capture(monkeypatch, ops, config):
    """Generate the fused GEMM's kernel; returns what the code generator gave the template."""
    got = {}

    def spy(**kw):
        got.update(kw)
        return real(**kw)

    real = cg.wgmma_gemm_kernel
    monkeypatch.setattr(cg, "wgmma_gemm_kernel", spy)
    src = cg.generate_cuda_source(ops, arch="sm_90", gemm_configs={ops[0].name: config})
    assert src.launches[ops[0].name].kind == "gemm-wgmma-f16"
    assert got["root"].strip() == "" and got["batch_code"].strip() == ""  # nothing else the loop needs
    return got, src.launches[ops[0].name].args


#: how the templates stage accumulators: (rows, columns, row stride, threads) of the TMA kernels'
#: 64 x 32 chunks per warpgroup and of the cp.async 128 x 128 tile (whole tile, two warpgroups)
STAGING = {"tma": (64, _CHUNK, _LDS, 128), "cp": (128, 128, 132, 256)}


def _run_host(tmp_path, kw, args, arrays, out_shape, out_dtype, staging):
    rows, cols, ld, threads = STAGING[staging]
    loop = _epilogue_loop(kw["epilogue"], kw["vec"], groups=rows * cols // kw["vec"], threads=threads,
                          thread="sf_t", cols=cols, smem="sf_Cw", ld=ld, m="sf_m0", n="sf_n0", M=kw["M"], N=kw["N"],
                          unroll=4)
    # vector accesses through a checker of their alignment
    loop = re.sub(r"reinterpret_cast<const ((?:SfVec4<\w+>|float4))\*>\(", r"sf_at<\1>(", loop)
    loop = re.sub(r"reinterpret_cast<(SfVec4<\w+>)\*>\(", r"sf_at_w<\1>(", loop)
    assert "reinterpret_cast" not in loop
    params = kw["params"].replace("__restrict__ ", "")
    sizes = (f"constexpr int SF_M = {kw['M']}, SF_N = {kw['N']}, SF_ROWS = {rows}, SF_COLS = {cols}, SF_LDS = {ld}, "
             f"SF_THREADS = {threads};\n")
    text = sizes + _HOST.replace("PARAMS", params).replace("LOOP", loop)
    (tmp_path / "e.cpp").write_text(text)
    lib = tmp_path / "e.so"
    proc = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-Wno-unknown-pragmas",
                           "-o", str(lib), str(tmp_path / "e.cpp")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n" + text[-3000:]
    fn = ctypes.CDLL(str(lib)).epilogue
    fn.restype = ctypes.c_int
    out = _aligned(out_shape, out_dtype)
    out[...] = np.nan
    ptrs = [out.ctypes.data if n == "out:0" else arrays[n].ctypes.data for n in args]
    bad = fn(*[ctypes.c_void_p(p) for p in ptrs], ctypes.c_void_p(arrays["product"].ctypes.data))
    return out, bad


def _aligned(shape, dtype, alignment=64):
    """An array whose data starts on an ``alignment`` boundary (as the runtime's arena does)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + alignment, np.uint8)
    shift = (-raw.ctypes.data) % alignment
    return raw[shift:shift + n].view(dtype).reshape(shape)


def _case(N, dt, res_t=False, M=200, K=72, heads=None):
    """``x @ w`` in float16, then ``+ bias + res`` in ``dt`` (the product cast to ``dt`` first when
    that is float32). ``w`` is stored ``[N, K]`` when N is odd; with ``heads`` the product's row is
    two axes (``heads``, ``N // heads``), an einsum ``mk,knd->mnd``."""
    row = (heads, N // heads) if heads else (N,)
    x = Tensor("x", (M, K), "float16")
    w = Tensor("w", (N, K) if N % 2 else (K,) + row, "float16")
    bias, res = Tensor("bias", row, dt), Tensor("res", row[::-1] + (M,) if res_t else (M,) + row, dt)
    ops = [Einsum([x, w], name="mm", equation="mk,knd->mnd") if heads else Gemm([x, w], name="mm", trans_b=bool(N % 2))]
    if dt != "float16":
        ops.append(CastOp([ops[-1].outputs[0]], name="cast", to=dt))
    ops.append(Binary([ops[-1].outputs[0], bias], name="add", fn="add"))
    if res_t:
        ops.append(Transpose([res], name="tr", perm=list(range(len(res.shape)))[::-1]))
    ops.append(Binary([ops[-2 if res_t else -1].outputs[0], ops[-1].outputs[0] if res_t else res], name="out",
                      fn="add"))
    return fuse(ops, keep=["out:0"]), {"bias": bias.shape, "res": res.shape}


CASES = {  # name: (N, dtype, residual read across rows, heads, four columns per thread)
    "vec-f32": (136, "float32", False, None, True),
    "vec-f16": (136, "float16", False, None, True),
    "res_t": (136, "float32", True, None, True),
    "odd": (137, "float32", False, None, False),
    "two-axes": (144, "float32", False, 3, True),  # rows of 3 x 48: the lanes step along the 48
    "short-inner": (136, "float32", False, 4, False),  # 4 x 34: N is a multiple of 4, the last axis not
}


@pytest.mark.parametrize("staging", list(STAGING))
@pytest.mark.parametrize("name", list(CASES))
def test_epilogue_on_the_host_matches_numpy(tmp_path, monkeypatch, name, staging):
    N, dt, res_t, heads, vec = CASES[name]
    M = 200
    ops, shapes = _case(N, dt, res_t, M=M, heads=heads)
    assert [o.name for o in ops] == ["out"]
    kw, args = _capture(monkeypatch, ops, "tma64x128")
    assert args == ("x", "w", "bias", "res", "out:0")
    assert kw["vec"] == (4 if vec else 1)
    rng = np.random.default_rng(0)
    arrays = {k: _aligned(v, dt) for k, v in shapes.items()}
    for a in arrays.values():
        a[...] = rng.standard_normal(a.shape).astype(dt)
    product = rng.standard_normal((M, N)).astype(np.float32) * 8
    arrays["product"] = np.ascontiguousarray(product)
    arrays["x"] = arrays["w"] = np.zeros(1, np.float32)  # the product's operands: not read here
    out, misaligned = _run_host(tmp_path, kw, args, arrays, (M,) + shapes["bias"], dt, staging)
    assert misaligned == 0
    # the product is rounded to float16 (the MatMul's type), then the additions in dt
    mm = product.astype(np.float16).reshape(out.shape)
    res = arrays["res"].T if res_t else arrays["res"]
    if dt == "float32":
        want = (mm.astype(np.float32) + arrays["bias"]) + res
    else:
        want = ((mm.astype(np.float32) + arrays["bias"].astype(np.float32)).astype(np.float16).astype(np.float32)
                + res.astype(np.float32)).astype(np.float16)
    assert not np.isnan(out.astype(np.float32)).any()  # every element written
    np.testing.assert_array_equal(out, want.astype(dt))
