"""Products with few rows on CUDA: one kernel template for ``M < 16`` (decoding, small batches).

The tensor-core templates tile 16 rows at least; a product with fewer rows (one token's
projections, a decoding step's attention scores, a 4-bit weight read by one token) is bound by
reading the weight once, so this template streams the larger operand ``B[N, K]`` once with
coalesced loads and keeps the ``M`` rows' sums in registers:

* **k-fast** (``B`` contiguous along ``K``: a K-major weight, the codes of a ``MatMulNBits``, a
  decoding step's keys): a warp per output column, its lanes over ``K`` (consecutive lanes read
  consecutive elements), the ``M`` sums reduced across the warp by shuffles;
* **n-fast** (``B`` contiguous along ``N``: an ONNX ``MatMul`` weight ``[K, N]``, the values of an
  attention): a block per 16 columns, each warp reading two rows of ``K`` at a time (16
  consecutive elements each), the 8 warps on interleaved pairs of rows, their partial sums added
  by a shuffle and then in shared memory.

A ``MatMulNBits`` weight of 2-, 4- or 8-bit codes (:class:`Codes`) is read by the k-fast kernel a
word of 8 codes at a time, each code made a float without a conversion instruction and the block's scale applied
once to the run's sum.

``A``'s element ``(m, k)`` is read (through the caches) by every column's warp; it is small (``M``
rows). Products are float32 (the operands' values converted exactly, as the tensor-core GEMMs
compute half operands) and summed in float32, in another order than the reference (float32
rounding differences only). The operands and the epilogue are code snippets from the GEMM
pattern of :mod:`.cuda` (any expression: a dequantization, a cast, a fused bias or residual).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GEMV_MAX_ROWS", "Codes", "gemv_kernel"]

#: the most rows the template takes (the tensor-core GEMMs start at 16)
GEMV_MAX_ROWS = 15
_WARPS = 8
#: consecutive elements of K a lane of the k-fast kernel takes (when K is a multiple, and long enough
#: for every lane to have some): the reads they share (a low-bit code's byte, its block's scale and
#: zero point) are then one read, and their index arithmetic folds (the static instruction count of
#: a 4-bit code's loop, nvcc 13 for sm_90: 11 per code instead of 15)
_K_RUN = 8
#: columns of a block of the n-fast kernel: 64 bytes of a float32 row of B, 32 of a half one (whole
#: 32-byte sectors either way), and N / 16 blocks (256 for N = 4096: two or more a multiprocessor)
_N_COLS = 16
_MAX_GRID = 65535


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "\n".join(pad + ln if ln else ln for ln in text.split("\n"))


#: the word a run of 8 codes of each width fills
_WORD = {2: "unsigned short", 4: "unsigned", 8: "unsigned long long"}


@dataclass(frozen=True)
class Codes:
    """``B`` as ``bits``-bit codes (2, 4 or 8) in ``MatMulNBits``' layout, read by the k-fast kernel
    8 codes (one word) at a time: ``B[n, k] = (code(n, k) - zp[n, k / block]) * scales[n, k /
    block]``, column ``n``'s codes in ``ceil(K / block)`` blocks of ``block * bits / 8`` bytes, code
    ``k`` in bits ``(k % (8 / bits)) * bits`` of its byte, from a ``bq`` aligned to the word (every
    buffer of a program is 64-byte aligned); ``zp`` ``None`` for the default ``2^(bits - 1)``. The
    names are the kernel's pointer parameters."""

    bq: str
    scales: str
    zp: str | None
    block: int
    #: the zero points are whole numbers under 2^22 (the default, or a constant such table): each code's
    #: ``q - zp`` is then one exact subtraction of ``2^23 + zp`` from ``2^23 + q``
    whole_zp: bool = False
    bits: int = 4


def _codes_run(codes: Codes, K: int, M: int, load_a: str, a_rows: tuple[str, str] | None) -> str:
    """The k-fast kernel's step on a run of 8 codes of column ``sf_n`` (one word): each code
    converted by the float trick (``2^23 + q`` has ``q`` in its low mantissa bits), its zero point
    subtracted, multiplied with ``A``'s elements and summed over the run, the block's scale applied
    once to the run's sum (the reference scales each weight: sums in another order)."""
    blocks, bits = -(-K // codes.block), codes.bits
    zp = f"{codes.zp}[sf_n * {blocks} + sf_blk]" if codes.zp else f"{float(1 << (bits - 1))}f"
    code = f"__uint_as_float(0x4B000000u | ((unsigned)(sf_w >> ({bits} * sf_j)) & {(1 << bits) - 1}u))"
    if codes.whole_zp or not codes.zp:
        zero, q = f"const float sf_z = 8388608.0f + {zp};", f"{code} - sf_z"
    else:
        zero, q = f"const float sf_z = {zp};", f"({code} - 8388608.0f) - sf_z"
    word = _WORD[bits]
    return f"""const int sf_k0 = sf_t * 8;
const int sf_blk = (int)((unsigned)sf_k0 / {codes.block}u);
const {word} sf_w = reinterpret_cast<const {word}*>({codes.bq})[(long long)sf_n * {blocks * codes.block // 8} + sf_t];
const float sf_s = {codes.scales}[sf_n * {blocks} + sf_blk];
{zero}
float sf_q[8];
#pragma unroll
for (int sf_j = 0; sf_j < 8; ++sf_j)
  sf_q[sf_j] = {q};
#pragma unroll
for (int sf_m = 0; sf_m < {M}; ++sf_m) {{
  float sf_r = 0.0f;
{_indent(_run_of_a(load_a, a_rows), 2)}
  sf_accs[sf_m] += sf_r * sf_s;
}}"""


def _run_of_a(load_a: str, a_rows: tuple[str, str] | None) -> str:
    """``sf_r``, the sum over the run of ``A``'s elements times ``sf_q``: element by element through
    ``load_a``, or (``a_rows``: see ``cuda._rows_of_a``) as two 16-byte loads where ``A`` is aligned."""
    scalar = f"""#pragma unroll
for (int sf_j = 0; sf_j < 8; ++sf_j) {{
  const int sf_k = sf_k0 | sf_j;
  float sf_v = 0.0f;
  {{
{_indent(load_a, 4)}
  }}
  sf_r += sf_v * sf_q[sf_j];
}}"""
    if a_rows is None:
        return scalar
    ptr, offset = a_rows
    return f"""if ((reinterpret_cast<unsigned long long>({ptr}) & 15) == 0) {{
  long long sf_ao;
  {{
{_indent(offset, 4)}
  }}
  const float4 sf_a0 = reinterpret_cast<const float4*>({ptr} + sf_ao + sf_k0)[0];
  const float4 sf_a1 = reinterpret_cast<const float4*>({ptr} + sf_ao + sf_k0 + 4)[0];
  const float sf_av[8] = {{sf_a0.x, sf_a0.y, sf_a0.z, sf_a0.w, sf_a1.x, sf_a1.y, sf_a1.z, sf_a1.w}};
  #pragma unroll
  for (int sf_j = 0; sf_j < 8; ++sf_j) sf_r += sf_av[sf_j] * sf_q[sf_j];
}} else {{
{_indent(scalar, 2)}
}}"""


def gemv_kernel(*, symbol: str, params: str, M: int, N: int, K: int, batch: int, root: str, batch_code: str,
                load_a: str, load_b: str, k_fast: bool, epilogue: str, codes: Codes | None = None,
                a_rows: tuple[str, str] | None = None) -> tuple[str, dict]:
    """Source of one product kernel for ``M <= GEMV_MAX_ROWS`` rows and its launch configuration.

    ``load_a`` is code that, given ``sf_m`` (row) and ``sf_k`` (reduction index) in range, sets
    ``float sf_v``; ``load_b`` likewise from ``sf_n`` and ``sf_k``. ``epilogue`` reads ``float
    sf_acc`` for output ``(sf_m, sf_n)`` and stores the result. ``root`` is code run once per
    thread; ``batch_code`` decomposes ``sf_bz`` into the batch axes. ``k_fast``: ``B`` is read
    with unit stride along ``K`` (else along ``N``). ``codes``: ``B`` is 2-, 4- or 8-bit codes read a
    word (8 codes) at a time instead of through ``load_b`` (k-fast; ``K`` a multiple of 8, unbatched);
    ``a_rows``: with ``codes``, ``A`` as a pointer and the code placing row ``sf_m`` (``sf_ao``),
    its runs then read 16 bytes at a time.
    """
    assert 1 <= M <= GEMV_MAX_ROWS and N >= 1 and K >= 1
    assert codes is None or (k_fast and K % 8 == 0 and codes.block % 8 == 0 and batch == 1)
    threads = 32 * _WARPS
    accumulate = f"""float sf_b;
{{
  float sf_v = 0.0f;
  {{
{_indent(load_b, 4)}
  }}
  sf_b = sf_v;
}}
#pragma unroll
for (int sf_m = 0; sf_m < {M}; ++sf_m) {{
  float sf_v = 0.0f;
  {{
{_indent(load_a, 4)}
  }}
  sf_accs[sf_m] += sf_v * sf_b;
}}"""
    zero = f"""float sf_accs[{M}];
#pragma unroll
for (int sf_m = 0; sf_m < {M}; ++sf_m) sf_accs[sf_m] = 0.0f;"""
    if k_fast:
        # a warp per column; lane l sums k = l, l + 32, ...; the warp's lanes then add their sums
        cols = _WARPS
        run = 8 if codes is not None else _K_RUN if K % _K_RUN == 0 and K >= 32 * _K_RUN else 1
        if codes is not None:
            step = _codes_run(codes, K, M, load_a, a_rows)
        else:
            step = f"""#pragma unroll
for (int sf_j = 0; sf_j < {run}; ++sf_j) {{
  const int sf_k = sf_t * {run} | sf_j;  // (an or: the compiler sees which bits sf_j sets)
{_indent(accumulate, 2)}
}}"""
        body = f"""for (int sf_n = blockIdx.x * {_WARPS} + sf_warp; sf_n < {N}; sf_n += gridDim.x * {_WARPS}) {{
{_indent(zero, 2)}
  #pragma unroll {max(1, 4 // run)}
  for (int sf_t = sf_lane; sf_t < {K // run}; sf_t += 32) {{
{_indent(step, 4)}
  }}
  #pragma unroll
  for (int sf_m = 0; sf_m < {M}; ++sf_m) {{
    float sf_acc = sf_accs[sf_m];
    #pragma unroll
    for (int sf_off = 16; sf_off > 0; sf_off >>= 1) sf_acc += __shfl_xor_sync(0xffffffffu, sf_acc, sf_off);
    if (sf_lane == sf_m) {{
{_indent(epilogue, 6)}
    }}
  }}
}}"""
        smem = ""
    else:
        # a block per 16 columns: lane l on column l % 16 and row l / 16 of each pair of K rows, warp
        # w on pairs w, w + 8, ... (16 rows of K a step, each read as 16 consecutive elements); the
        # two halves of a warp add their sums by a shuffle, the warps' sums meet in shared memory,
        # where the block's threads add them and finish the outputs
        cols = _N_COLS
        rows = 32 // cols
        body = f"""for (int sf_n0 = blockIdx.x * {cols}; sf_n0 < {N}; sf_n0 += gridDim.x * {cols}) {{
{_indent(zero, 2)}
  if (sf_n0 + (sf_lane & {cols - 1}) < {N}) {{
    const int sf_n = sf_n0 + (sf_lane & {cols - 1});
    #pragma unroll 4
    for (int sf_k = sf_warp * {rows} + (sf_lane >> {cols.bit_length() - 1}); sf_k < {K}; sf_k += {_WARPS * rows}) {{
{_indent(accumulate, 6)}
    }}
  }}
  #pragma unroll
  for (int sf_m = 0; sf_m < {M}; ++sf_m) {{
    float sf_acc = sf_accs[sf_m];
    #pragma unroll
    for (int sf_off = 16; sf_off >= {cols}; sf_off >>= 1) sf_acc += __shfl_xor_sync(0xffffffffu, sf_acc, sf_off);
    if (sf_lane < {cols}) sf_part[(sf_warp * {M} + sf_m) * {cols} + sf_lane] = sf_acc;
  }}
  __syncthreads();
  for (int sf_e = threadIdx.x; sf_e < {M * cols}; sf_e += {threads}) {{
    const int sf_m = sf_e / {cols};
    const int sf_n = sf_n0 + sf_e % {cols};
    float sf_acc = sf_part[sf_e];
    #pragma unroll
    for (int sf_w = 1; sf_w < {_WARPS}; ++sf_w) sf_acc += sf_part[sf_w * {M * cols} + sf_e];
    if (sf_n < {N}) {{
{_indent(epilogue, 6)}
    }}
  }}
  __syncthreads();
}}"""
        smem = f"  __shared__ float sf_part[{_WARPS * M * cols}];\n"
    src = f"""extern "C" __global__ void __launch_bounds__({threads}) {symbol}({params}) {{
{smem}  const int sf_warp = threadIdx.x >> 5;
  const int sf_lane = threadIdx.x & 31;
{_indent(root, 2)}
  for (int sf_bz = blockIdx.y; sf_bz < {batch}; sf_bz += gridDim.y) {{
{_indent(batch_code, 4)}
{_indent(body, 4)}
  }}
}}
"""
    grid = (max(1, min(_MAX_GRID, -(-N // cols))), max(1, min(batch, _MAX_GRID)), 1)
    return src, {"grid": grid, "block": (threads, 1, 1)}
