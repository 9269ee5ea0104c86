"""TopK on CUDA: the ``k`` first elements of each row along ``axis`` in a total order, and their
int64 positions.

The order is the reference's (``ops.reduce.TopK.numpy`` and the cpu template): for ``largest``
larger values first and NaN before every number, otherwise smaller values first and NaN after
every number; equal values (and NaNs among themselves) by lower position. Ties broken by
position make the order total, so the ``j``-th output is the first element, in that order, of
those that come after output ``j - 1``: the kernel selects the outputs one after another, a
block per row, each selection one pass over the row and a block reduction (shuffles within the
warps, then across them through shared memory). No sort, no scratch memory, no assumption on
``n`` or ``k``: ``k`` passes of ``n / 256`` elements a thread, which suits the forms models take
(a router's 2-8 of 8-256 experts, a sampler's 50 of a vocabulary). A row of at most
:data:`SHARED_ROW` bytes (in the compute type) is read from global memory once, into shared
memory; a longer one is read ``k`` times (through the caches).

Half values are compared as floats (converted exactly), integers as themselves (8- and 16-bit ones
widened to int, exactly).
"""
from __future__ import annotations

import math

__all__ = ["TOPK_DTYPES", "SHARED_ROW", "topk_kernel"]

_THREADS = 256
#: the largest row (bytes, in the compute type) the kernel keeps in shared memory
SHARED_ROW = 16384
#: value type -> (stored C type, compute C type and its bytes, load expression of ``p``, store
#: expression of ``v``)
TOPK_DTYPES = {
    "float16": ("__half", "float", 4, "__half2float({})", "__float2half_rn({})"),
    "bfloat16": ("__nv_bfloat16", "float", 4, "__bfloat162float({})", "__float2bfloat16_rn({})"),
    "float32": ("float", "float", 4, "{}", "{}"),
    "float64": ("double", "double", 8, "{}", "{}"),
    "int8": ("signed char", "int", 4, "(int){}", "(signed char){}"),
    "int16": ("short", "int", 4, "(int){}", "(short){}"),
    "int32": ("int", "int", 4, "{}", "{}"),
    "int64": ("long long", "long long", 8, "{}", "{}"),
    "uint8": ("unsigned char", "int", 4, "(int){}", "(unsigned char){}"),
    "uint16": ("unsigned short", "int", 4, "(int){}", "(unsigned short){}"),
    "uint32": ("unsigned int", "unsigned int", 4, "{}", "{}"),
    "uint64": ("unsigned long long", "unsigned long long", 8, "{}", "{}"),
}


def topk_kernel(symbol: str, dtype: str, shape: tuple[int, ...], k: int, axis: int,
                largest: bool) -> tuple[str, tuple[int, int, int], tuple[int, int, int]]:
    """The kernel ``symbol(const T* in0, T* out0, long long* out1)`` of a TopK of ``x`` (``dtype``,
    ``shape``) keeping ``k`` along ``axis``; returns ``(source, grid, block)``."""
    from .cuda import CudaCodegenError

    if dtype not in TOPK_DTYPES:
        raise CudaCodegenError(f"TopK of {dtype} values has no cuda kernel (it takes {', '.join(TOPK_DTYPES)})")
    st, ct, size, load, store = TOPK_DTYPES[dtype]
    axis %= len(shape)
    n, outer, inner = shape[axis], math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    rows = outer * inner
    if not 0 <= k <= n:
        raise CudaCodegenError(f"TopK: k={k} is outside [0, {n}]")
    head = (f'extern "C" __global__ void __launch_bounds__({_THREADS}) {symbol}(const {st}* __restrict__ in0, '
            f"{st}* __restrict__ out0, long long* __restrict__ out1) {{\n")
    if k * rows == 0:
        return head + "  // TopK: an empty output, nothing to write\n}\n", (1, 1, 1), (_THREADS, 1, 1)
    flt = dtype.startswith("float") or dtype == "bfloat16"
    if largest:
        before = "(a > b) || (isnan(a) && !isnan(b))" if flt else "a > b"
    else:
        before = "(a < b) || (!isnan(a) && isnan(b))" if flt else "a < b"
    shared = n * size <= SHARED_ROW
    read = "row[i]" if shared else load.format(f"xr[(long long)i * {inner}]")
    lines = [
        f"  // TopK: the {k} {'largest' if largest else 'smallest'} of {n} along axis {axis} ({outer} x {inner} rows),",
        "  // one after another: each the first, in the order, of those after the one before",
        f"  __shared__ {ct} sv[32];",
        "  __shared__ int si[32];",
    ]
    if shared:
        lines.append(f"  __shared__ {ct} row[{n}];")
    lines += [
        f"  auto ahead = []({ct} a, {ct} b) {{ return {before}; }};  // value a goes before value b",
        f"  auto first = [ahead]({ct} a, int i, {ct} b, int j) {{  // (a, i) goes before (b, j)",
        "    return ahead(a, b) || (!ahead(b, a) && i < j);",
        "  };",
        "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;",
        f"  for (long long t = blockIdx.x; t < {rows}; t += gridDim.x) {{",
        f"    const long long o = t / {inner}, c = t % {inner};",
        f"    const {st}* __restrict__ xr = in0 + o * {n * inner} + c;",
    ]
    if shared:
        lines += [f"    for (int i = threadIdx.x; i < {n}; i += {_THREADS}) row[i] = "
                  + load.format(f"xr[(long long)i * {inner}]") + ";",
                  "    __syncthreads();"]
    lines += [
        f"    {ct} pv = 0;",
        "    int pi = -1;  // the element selected last (none yet)",
        f"    for (int j = 0; j < {k}; ++j) {{",
        f"      {ct} bv = 0;",
        "      int bi = -1;  // this thread's first element after (pv, pi)",
        f"      for (int i = threadIdx.x; i < {n}; i += {_THREADS}) {{",
        f"        const {ct} v = {read};",
        "        if ((pi < 0 || first(pv, pi, v, i)) && (bi < 0 || first(v, i, bv, bi))) { bv = v; bi = i; }",
        "      }",
        "      for (int m = 16; m > 0; m >>= 1) {  // the warp's first",
        f"        const {ct} ov = __shfl_xor_sync(0xffffffffu, bv, m);",
        "        const int oi = __shfl_xor_sync(0xffffffffu, bi, m);",
        "        if (oi >= 0 && (bi < 0 || first(ov, oi, bv, bi))) { bv = ov; bi = oi; }",
        "      }",
        "      if (lane == 0) { sv[warp] = bv; si[warp] = bi; }",
        "      __syncthreads();",
        "      if (warp == 0) {  // the block's first",
        f"        bv = lane < {_THREADS // 32} ? sv[lane] : ({ct})0;",
        f"        bi = lane < {_THREADS // 32} ? si[lane] : -1;",
        "        for (int m = 16; m > 0; m >>= 1) {",
        f"          const {ct} ov = __shfl_xor_sync(0xffffffffu, bv, m);",
        "          const int oi = __shfl_xor_sync(0xffffffffu, bi, m);",
        "          if (oi >= 0 && (bi < 0 || first(ov, oi, bv, bi))) { bv = ov; bi = oi; }",
        "        }",
        "        if (lane == 0) {",
        f"          out0[(o * {k} + j) * {inner} + c] = " + store.format("bv") + ";",
        f"          out1[(o * {k} + j) * {inner} + c] = bi;",
        "          sv[0] = bv; si[0] = bi;",
        "        }",
        "      }",
        "      __syncthreads();",
        "      pv = sv[0]; pi = si[0];",
        "      __syncthreads();  // (every thread has read the selection before the next one is written)",
        "    }",
        "  }",
        "}",
    ]
    grid = min(rows, 65535)
    return head + "\n".join(lines) + "\n", (grid, 1, 1), (_THREADS, 1, 1)
