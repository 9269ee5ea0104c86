"""Fast CPU kernels for the heavy ops: float32 MatMul, Gemm, PackedMatMul, 2-D/1-D Conv, PackedConv, WinogradConv.

They share one GEMM (in :data:`TEMPLATE_PRELUDE`), written like BLIS: for each block of 256 of the
contracted dim, B is packed into panels of NR columns and A into panels of MR rows (zero padded),
then a register-blocked micro-kernel computes MR×NR tiles of C. The micro-kernel is chosen once,
when first used, from the CPU: AVX-512 (12×32), AVX2+FMA (6×16) or SSE (4×8); each is compiled with
its own ``target`` attribute, so the library still loads on any x86-64. Threads (OpenMP) split the
packing and the C tiles; small products run on the calling thread. Batched matmuls split the batch
across threads when each product is small. ``M == 1`` (a row vector times a matrix) skips packing.
A PackedMatMul (a constant weight, ``passes/prepack.py``) reads B from panels of ``PANEL`` columns
packed at compile time instead of packing it on every call.

Conv is a GEMM per image and group, ``w[OCG, C*KH*KW] @ im2col(x)``, whose B panels are packed
straight from the image (no im2col buffer; a 1×1, stride-1, unpadded conv uses the image as B),
with the bias added in the GEMM's epilogue. With AVX2 a conv of horizontal stride 1 whose output
rows fill a panel is not packed at all: its micro-kernel loads each panel row from the image
through a table of tap offsets. A PackedConv (a 1x1 conv on a small image, ``passes/prepack.py``) is
the prepacked GEMM with the output pixels as rows, transposed back. A WinogradConv (a 3x3 stride-1 conv,
``passes/prepack.py``) transforms its input tiles, runs one prepacked GEMM per transform position (tiles
as rows) and transforms the products back into output tiles. Depthwise and 3-D convolutions
use the generic loop nest. Every other op, and other dtypes, use the generic lowering.
"""
from __future__ import annotations

import math

import numpy as np

from ..ops.linalg import PANEL
from .cpp import literal

__all__ = ["TEMPLATE_PRELUDE", "template_body", "template_kind", "accepts_epilogue", "accepts_group", "CLONED_TEMPLATES"]

TEMPLATE_PRELUDE = r"""
// ---- GEMM (float32) -----------------------------------------------------------------------------
namespace {

constexpr int64_t SF_KC = 256;
// columns per panel of a weight packed at compile time (ops.linalg.PANEL): the AVX2 kernel's width
constexpr int64_t SF_PANEL = @PANEL@;
static_assert(SF_PANEL == 16, "the GEMM kernels read prepacked panels of 16 columns");

// Bp: a panel of B, [kc][ldb] with the tile's columns first in each row (ldb = the kernel's width
// for panels packed per call, SF_PANEL for prepacked weights). The AVX-512 kernel (32 columns) reads
// its columns 16.. at Bp + bnext (+ ldb * k): 16 in a panel packed per call, the next prepacked
// panel, or 0 where the tile has no such columns (it then reads the first ones again and stores none
// of them); the other kernels ignore bnext. Its loads are unaligned: a
// prepacked weight lies wherever the caller put it (the runtime aligns weights to 64 bytes; the kernel
// ABI does not ask it).
typedef void (*SfUkrFn)(int64_t kc, const float* __restrict__ Ap, const float* __restrict__ Bp, int64_t ldb,
                        int64_t bnext, float* __restrict__ C, int64_t ldc, int64_t mr, int64_t nr, bool first);

#if defined(__x86_64__)
// MR x 32 tile, AVX-512 (MR <= 12: the A panels are 12 rows wide; a panel of fewer rows computes
// those only, so M = 8 does not pay for 12 rows)
template <int MR>
__attribute__((target("avx512f")))
static void sf_ukr_avx512(int64_t kc, const float* __restrict__ Ap, const float* __restrict__ Bp, int64_t ldb,
                          int64_t bnext, float* __restrict__ C, int64_t ldc, int64_t mr, int64_t nr, bool first) {
  const float* __restrict__ Bq = Bp + bnext;
  __m512 acc[MR][2];
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    // B's rows 16 ahead: a prepacked weight comes from memory, once per call (measured 10-15% on the
    // GPT-2/Llama projections with weights not in cache; a prefetch never faults past the end)
    constexpr int64_t ahead = MR >= 12 ? 16 : MR >= 8 ? 32 : 64;
    _mm_prefetch(reinterpret_cast<const char*>(Bp + ldb * (k + ahead)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(Bq + ldb * (k + ahead)), _MM_HINT_T0);
    const __m512 b0 = _mm512_loadu_ps(Bp + ldb * k), b1 = _mm512_loadu_ps(Bq + ldb * k);
    const float* a = Ap + 12 * k;
    #pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i]);
      acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
    }
  }
  const __mmask16 m0 = nr >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1u);
  const __mmask16 m1 = nr >= 32 ? (__mmask16)0xffff : (nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1u) : (__mmask16)0);
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    if (i >= mr) break;
    float* cr = C + i * ldc;
    __m512 v0 = acc[i][0], v1 = acc[i][1];
    if (!first) {
      v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, cr));
      v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, cr + 16));
    }
    _mm512_mask_storeu_ps(cr, m0, v0);
    _mm512_mask_storeu_ps(cr + 16, m1, v1);
  }
}

// MR x 16 tile, AVX2 + FMA (MR <= 6: the A panels are 6 rows wide, so a tail panel of MR rows
// computes those only; with the 6-row kernel on every panel, M = 32 computed 36 rows, 12% more
// multiply-adds)
template <int MR>
__attribute__((target("avx2,fma")))
static void sf_ukr_avx2(int64_t kc, const float* __restrict__ Ap, const float* __restrict__ Bp, int64_t ldb, int64_t,
                        float* __restrict__ C, int64_t ldc, int64_t mr, int64_t nr, bool first) {
  __m256 acc[MR][2];
  #pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(Bp + ldb * (k + 64)), _MM_HINT_T0);  // 64 rows (4 KB) ahead; AVX-512: 16
    const __m256 b0 = _mm256_loadu_ps(Bp + ldb * k), b1 = _mm256_loadu_ps(Bp + ldb * k + 8);
    const float* a = Ap + 6 * k;
    #pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i);
      acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
    }
  }
  if (nr == 16) {
    #pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      if (i >= mr) break;
      float* cr = C + i * ldc;
      __m256 v0 = acc[i][0], v1 = acc[i][1];
      if (!first) { v0 = _mm256_add_ps(v0, _mm256_loadu_ps(cr)); v1 = _mm256_add_ps(v1, _mm256_loadu_ps(cr + 8)); }
      _mm256_storeu_ps(cr, v0); _mm256_storeu_ps(cr + 8, v1);
    }
    return;
  }
  alignas(32) float t[MR][16];
  #pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) { _mm256_store_ps(t[i], acc[i][0]); _mm256_store_ps(t[i] + 8, acc[i][1]); }
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) C[i * ldc + j] = first ? t[i][j] : C[i * ldc + j] + t[i][j];
}
#endif

// 4 x 8 tile, any CPU (two SSE registers per row when vectorized)
static void sf_ukr_generic(int64_t kc, const float* __restrict__ Ap, const float* __restrict__ Bp, int64_t ldb,
                           int64_t, float* __restrict__ C, int64_t ldc, int64_t mr, int64_t nr, bool first) {
  float t[4][8] = {};
  for (int64_t k = 0; k < kc; ++k) {
    for (int i = 0; i < 4; ++i) {
      const float a = Ap[4 * k + i];
      for (int j = 0; j < 8; ++j) t[i][j] += a * Bp[ldb * k + j];
    }
  }
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) C[i * ldc + j] = first ? t[i][j] : C[i * ldc + j] + t[i][j];
}

// fn[r - 1]: the kernel for a panel of A with r rows of C (r <= mr; the same function where the ISA's
// kernel takes any count)
struct SfUkr { SfUkrFn fn[12]; int64_t mr, nr; };

static SfUkr sf_ukr_all(SfUkrFn fn, int64_t mr, int64_t nr) {
  SfUkr u = {{}, mr, nr};
  for (auto& f : u.fn) f = fn;
  return u;
}

static SfUkr sf_pick_ukr() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const char* force = std::getenv("SHARDFLOW_CPU_ISA");
  bool allow512 = !force || std::strcmp(force, "avx512") == 0;
  bool allow2 = !force || std::strcmp(force, "avx512") == 0 || std::strcmp(force, "avx2") == 0;
  if (allow512 && __builtin_cpu_supports("avx512f"))
    return {{sf_ukr_avx512<1>, sf_ukr_avx512<2>, sf_ukr_avx512<3>, sf_ukr_avx512<4>, sf_ukr_avx512<5>,
             sf_ukr_avx512<6>, sf_ukr_avx512<7>, sf_ukr_avx512<8>, sf_ukr_avx512<9>, sf_ukr_avx512<10>,
             sf_ukr_avx512<11>, sf_ukr_avx512<12>}, 12, 32};
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {{sf_ukr_avx2<1>, sf_ukr_avx2<2>, sf_ukr_avx2<3>, sf_ukr_avx2<4>, sf_ukr_avx2<5>, sf_ukr_avx2<6>}, 6, 16};
#endif
  return sf_ukr_all(sf_ukr_generic, 4, 8);
}
static const SfUkr& sf_ukr() { static const SfUkr u = sf_pick_ukr(); return u; }

// whether the AVX2 versions of the helper kernels (GEMV, transpositions, Winograd transforms) apply: the
// CPU has AVX2 and FMA and SHARDFLOW_CPU_ISA does not ask for less (the GEMM's kernel is 16+ wide)
static bool sf_avx2_helpers() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && sf_ukr().nr >= SF_PANEL;
  return yes;
#else
  return false;
#endif
}

static inline int sf_max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// the indices [lo, hi) of [0, n_out) whose o * s + off lies in [0, n_in): the output columns that read
// inside an input row (im2col, depthwise), or the input columns a transposed conv's tap lands inside its
// output (lo >= hi: none)
static inline void sf_inside(int64_t off, int64_t s, int64_t n_in, int64_t n_out, int64_t& lo, int64_t& hi) {
  lo = std::min(n_out, off >= 0 ? 0 : (-off + s - 1) / s);
  hi = std::max(lo, std::min(n_out, n_in - off > 0 ? (n_in - off + s - 1) / s : 0));
}

#if defined(__x86_64__)
// r[t] = lane t of each of r[0..7] (an 8 x 8 transposition in registers)
__attribute__((target("avx2,fma"), always_inline))
static inline void sf_tr8x8(__m256 (&r)[8]) {
  __m256 u[8], v[8];
  #pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    u[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    u[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  #pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    v[4 * i] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    v[4 * i + 1] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    v[4 * i + 2] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    v[4 * i + 3] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  #pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x31);
  }
}

// sf_pack_a for the AVX2 kernel's 6-row panels of a row-major A: 8 x 8 transpositions (the scalar copy
// stored one float at a time). Measured on Zen 3 with sf_pack_bt16_avx2: the attention template's kernels
// 8-9% faster (causal 12 x 128 x 64, grouped heads 2 x 32 x 256 x 128), GPT-2's projections 0-4%.
__attribute__((target("avx2,fma")))
static void sf_pack_a6_avx2(const float* __restrict__ A, int64_t rsa, int64_t i0, int64_t rows, int64_t k0,
                            int64_t kc, float* __restrict__ Ap) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    __m256 r[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = i < rows ? _mm256_loadu_ps(A + (i0 + i) * rsa + k0 + k) : _mm256_setzero_ps();
    sf_tr8x8(r);
    // column t's 6 rows at Ap[(k + t) * 6]: 8-wide stores whose last 2 lanes the next store overwrites,
    // the last one as 4 + 2
    #pragma GCC unroll 7
    for (int t = 0; t < 7; ++t) _mm256_storeu_ps(Ap + (k + t) * 6, r[t]);
    _mm_storeu_ps(Ap + (k + 7) * 6, _mm256_castps256_ps128(r[7]));
    _mm_storel_pi(reinterpret_cast<__m64*>(Ap + (k + 7) * 6 + 4), _mm256_extractf128_ps(r[7], 1));
  }
  for (; k < kc; ++k)
    for (int64_t i = 0; i < 6; ++i) Ap[k * 6 + i] = i < rows ? A[(i0 + i) * rsa + k0 + k] : 0.0f;
}

// sf_pack_b for B whose columns are contiguous (B[k, j] at B[j * csb + k]: a K^T read in place) into
// panels of 16: 8 x 8 transpositions
__attribute__((target("avx2,fma")))
static void sf_pack_bt16_avx2(const float* __restrict__ B, int64_t csb, int64_t j0, int64_t cols, int64_t k0,
                              int64_t kc, float* __restrict__ Bp) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8)
    for (int h = 0; h < 2; ++h) {
      __m256 r[8];
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        r[i] = h * 8 + i < cols ? _mm256_loadu_ps(B + (j0 + h * 8 + i) * csb + k0 + k) : _mm256_setzero_ps();
      sf_tr8x8(r);
      #pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) _mm256_storeu_ps(Bp + (k + t) * 16 + h * 8, r[t]);
    }
  for (; k < kc; ++k)
    for (int64_t j = 0; j < 16; ++j) Bp[k * 16 + j] = j < cols ? B[(j0 + j) * csb + k0 + k] : 0.0f;
}

// sf_pack_a where a column of A's panel is contiguous (rsa == 1: a 1x1 conv's image read in place by
// PackedConv, a transposed operand) and the panel has fewer rows than the kernel: one masked load and
// store per k, zeros past `rows` (a masked-out lane is never read, so the last column's tail does not
// fault). Scalar copies of `rows` floats compiled to a memmove call per k: 6% of Inception-v2's run
// (its 1x1 convs at 28x28, 784 pixels, in panels of 11 and 12 rows).
__attribute__((target("avx512f")))
static void sf_pack_a_cols_avx512(const float* __restrict__ src, int64_t csa, int64_t rows, int64_t kc,
                                  float* __restrict__ Ap) {
  const __mmask16 m = (__mmask16)((1u << rows) - 1u);
  for (int64_t k = 0; k < kc; ++k) _mm512_mask_storeu_ps(Ap + k * 12, 0x0fff, _mm512_maskz_loadu_ps(m, src + k * csa));
}

__attribute__((target("avx2,fma")))
static void sf_pack_a_cols_avx2(const float* __restrict__ src, int64_t csa, int64_t rows, int64_t kc,
                                float* __restrict__ Ap) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rows), lane);
  const __m256i six = _mm256_cmpgt_epi32(_mm256_set1_epi32(6), lane);
  for (int64_t k = 0; k < kc; ++k) _mm256_maskstore_ps(Ap + k * 6, six, _mm256_maskload_ps(src + k * csa, m));
}
#endif

// Ap: one panel of A, rows [i0, i0 + rows) (rows <= mr) as [kc][mr], the rows past `rows` zero
static void sf_pack_a(const float* __restrict__ A, int64_t rsa, int64_t csa, int64_t i0, int64_t rows, int64_t mr,
                      int64_t k0, int64_t kc, float* __restrict__ Ap) {
#if defined(__x86_64__)
  if (csa == 1 && mr == 6 && sf_avx2_helpers()) { sf_pack_a6_avx2(A, rsa, i0, rows, k0, kc, Ap); return; }
  // (mr 12 and 6 are the AVX-512 and AVX2 kernels' widths: the instruction sets are there)
  if (rsa == 1 && rows < mr && mr == 12) { sf_pack_a_cols_avx512(A + i0 + k0 * csa, csa, rows, kc, Ap); return; }
  if (rsa == 1 && rows < mr && mr == 6) { sf_pack_a_cols_avx2(A + i0 + k0 * csa, csa, rows, kc, Ap); return; }
#endif
  if (csa == 1) {
    for (int64_t i = 0; i < rows; ++i) {
      const float* src = A + (i0 + i) * rsa + k0;
      for (int64_t k = 0; k < kc; ++k) Ap[k * mr + i] = src[k];
    }
  } else if (rsa == 1 && rows == mr && (mr == 4 || mr == 6 || mr == 12)) {
    // a column of A's panel is contiguous (A^T read in place, e.g. a transposed conv's weights): copies
    // of a constant size, which compile to vector moves (a loop of `rows` floats became a memmove call)
    const float* src = A + i0 + k0 * csa;
    if (mr == 6) { for (int64_t k = 0; k < kc; ++k) std::memcpy(Ap + k * 6, src + k * csa, 6 * sizeof(float)); }
    else if (mr == 12) { for (int64_t k = 0; k < kc; ++k) std::memcpy(Ap + k * 12, src + k * csa, 12 * sizeof(float)); }
    else { for (int64_t k = 0; k < kc; ++k) std::memcpy(Ap + k * 4, src + k * csa, 4 * sizeof(float)); }
  } else {
    for (int64_t k = 0; k < kc; ++k)
      for (int64_t i = 0; i < rows; ++i) Ap[k * mr + i] = A[(i0 + i) * rsa + (k0 + k) * csa];
  }
  for (int64_t i = rows; i < mr; ++i)
    for (int64_t k = 0; k < kc; ++k) Ap[k * mr + i] = 0.0f;
}

// Bp: panels of nr columns, each [kc][nr], columns past N zero
static void sf_pack_b(const float* __restrict__ B, int64_t rsb, int64_t csb, int64_t N, int64_t p, int64_t nr,
                      int64_t k0, int64_t kc, float* __restrict__ Bp) {
  const int64_t j0 = p * nr;
  const int64_t cols = std::min<int64_t>(nr, N - j0);
#if defined(__x86_64__)
  if (csb != 1 && rsb == 1 && nr == 16 && sf_avx2_helpers()) {
    sf_pack_bt16_avx2(B, csb, j0, cols, k0, kc, Bp);
    return;
  }
#endif
  if (csb == 1) {
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = B + (k0 + k) * rsb + j0;
      float* dst = Bp + k * nr;
      // whole panels by copies of a constant size, which compile to vector moves (a loop of nr floats
      // became a call of memmove per row: 4-8% of a transposed conv's or an attention's time)
      if (cols == nr && nr == 16) std::memcpy(dst, src, 16 * sizeof(float));
      else if (cols == nr && nr == 32) std::memcpy(dst, src, 32 * sizeof(float));
      else if (cols == nr && nr == 8) std::memcpy(dst, src, 8 * sizeof(float));
      else if (cols == nr) { for (int64_t j = 0; j < nr; ++j) dst[j] = src[j]; }
      else { for (int64_t j = 0; j < nr; ++j) dst[j] = j < cols ? src[j] : 0.0f; }
    }
  } else {
    for (int64_t j = 0; j < cols; ++j) {
      const float* src = B + (j0 + j) * csb + k0 * rsb;
      for (int64_t k = 0; k < kc; ++k) Bp[k * nr + j] = src[k * rsb];
    }
    for (int64_t j = cols; j < nr; ++j)
      for (int64_t k = 0; k < kc; ++k) Bp[k * nr + j] = 0.0f;
  }
}

// C[i, j] = alpha * C[i, j] + bias[i * rbs + j * cbs] over a block of C
static inline void sf_gemm_epilogue(float* __restrict__ C, int64_t ldc, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                                    float alpha, const float* __restrict__ bias, int64_t rbs, int64_t cbs) {
  for (int64_t i = i0; i < i1; ++i) {
    float* cr = C + i * ldc;
    if (bias) {
      const float* br = bias + i * rbs;
      if (cbs == 0) { const float b = br[0]; for (int64_t j = j0; j < j1; ++j) cr[j] = alpha * cr[j] + b; }
      else if (cbs == 1) { for (int64_t j = j0; j < j1; ++j) cr[j] = alpha * cr[j] + br[j]; }
      else { for (int64_t j = j0; j < j1; ++j) cr[j] = alpha * cr[j] + br[j * cbs]; }
    } else {
      for (int64_t j = j0; j < j1; ++j) cr[j] = alpha * cr[j];
    }
  }
}

// y[1, N] = a[1, K] @ B[K, N] for row-major B (no packing): threads split N
SF_CLONES
static void sf_gemv_row(int64_t N, int64_t K, const float* __restrict__ A, int64_t csa, const float* __restrict__ B,
                        int64_t rsb, float* __restrict__ C, float alpha, const float* __restrict__ bias, int64_t cbs,
                        bool par) {
  const int64_t JB = 256;
  const int64_t nb = (N + JB - 1) / JB;
  #pragma omp parallel for schedule(static) if (par && N * K >= (1 << 16) && nb > 1)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t j0 = b * JB, nj = std::min(N, j0 + JB) - j0;
    float acc[256];
    for (int64_t j = 0; j < nj; ++j) acc[j] = 0.0f;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      const float a0 = A[k * csa], a1 = A[(k + 1) * csa], a2 = A[(k + 2) * csa], a3 = A[(k + 3) * csa];
      const float* b0 = B + k * rsb + j0;
      const float* b1 = b0 + rsb;
      const float* b2 = b1 + rsb;
      const float* b3 = b2 + rsb;
      for (int64_t j = 0; j < nj; ++j) acc[j] += a0 * b0[j] + a1 * b1[j] + a2 * b2[j] + a3 * b3[j];
    }
    for (; k < K; ++k) {
      const float a = A[k * csa];
      const float* br = B + k * rsb + j0;
      for (int64_t j = 0; j < nj; ++j) acc[j] += a * br[j];
    }
    for (int64_t j = 0; j < nj; ++j) C[j0 + j] = alpha * acc[j] + (bias ? bias[(j0 + j) * cbs] : 0.0f);
  }
}

// y[1, N] = a[1, K] @ B where B's columns are contiguous (B[k, j] at j*csb + k: a Gemm's transposed
// weight, K^T read from K): a dot product per column, four columns at a time so that each load of a
// serves four; B streams through once (packing it, as the GEMM does, took 8.8x as long on AlexNet's
// 9216 -> 4096 fully connected layer with a weight made at run time)
static void sf_gemv_dot(int64_t N, int64_t K, const float* __restrict__ A, const float* __restrict__ B, int64_t csb,
                        float* __restrict__ C, float alpha, const float* __restrict__ bias, int64_t cbs, bool par) {
  const int64_t nq = (N + 3) / 4;
  #pragma omp parallel for schedule(static) if (par && N * K >= (1 << 16) && nq > 1)
  for (int64_t q = 0; q < nq; ++q) {
    const int64_t j0 = q * 4;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (j0 + 4 <= N) {
      const float* __restrict__ b0 = B + j0 * csb;
      const float* __restrict__ b1 = b0 + csb;
      const float* __restrict__ b2 = b1 + csb;
      const float* __restrict__ b3 = b2 + csb;
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
      #pragma omp simd reduction(+:s0, s1, s2, s3)
      for (int64_t k = 0; k < K; ++k) {
        const float a = A[k];
        s0 += a * b0[k]; s1 += a * b1[k]; s2 += a * b2[k]; s3 += a * b3[k];
      }
      s[0] = s0; s[1] = s1; s[2] = s2; s[3] = s3;
    } else {
      for (int64_t j = j0; j < N; ++j) {
        const float* __restrict__ bj = B + j * csb;
        float sj = 0.0f;
        #pragma omp simd reduction(+:sj)
        for (int64_t k = 0; k < K; ++k) sj += A[k] * bj[k];
        s[j - j0] = sj;
      }
    }
    for (int64_t j = j0; j < std::min(N, j0 + 4); ++j) C[j] = alpha * s[j - j0] + (bias ? bias[j * cbs] : 0.0f);
  }
}

// C[M, N] = alpha * (A @ B) + bias, A(i, k) = A[i*rsa + k*csa], C row stride ldc, B from a source
// (below). A is packed once for all of K; B comes in chunks of at most SF_NC columns; each thread
// owns C tiles and runs the whole K loop on a tile, so the tile stays in its cache.
// A source of B has: chunk (columns per chunk); prepare(jc, nc, np, nr, nkb), run by every thread
// of the team before the chunk at jc is used (packing it, if it packs); and
// panel(jc, np, nr, cols, pc, kc, jp, ldb, bnext), the [kc][ldb] panel of the chunk's columns jp*nr..
// (cols of them) and rows pc.., with bnext for kernels wider than SF_PANEL (SfUkrFn)
constexpr int64_t SF_NC = 4096;
template <class BSource>
static void sf_sgemm_driver(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
                            const BSource& bsrc, float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs,
                            int64_t cbs, bool par) {
  const SfUkr& u = sf_ukr();
  const int64_t mr = u.mr, nr = u.nr;
  const int64_t nkb = (K + SF_KC - 1) / SF_KC;
  const int64_t mp = (M + mr - 1) / mr;
  // the mp row panels share M's rows evenly (M = 49: five of 5 rows and four of 6, not eight of 6 and
  // one of 1, whose one-row kernel waits on its two sums: measured on Zen 3, 1x1 convs at 7x7 (49 x 512
  // @ 512 x 2048) 4% faster, 32 x 768 @ 768 x 3072 4%); panel p has rows [row0(p), row0(p + 1))
  const int64_t base = M / mp, extra = M % mp;
  auto row0 = [base, extra](int64_t p) { return p * base + std::min(p, extra); };
  float* Ap = static_cast<float*>(sf_workspace(1, sizeof(float) * mp * mr * K));
  const int nt = par ? sf_max_threads() : 1;
  const bool epi = alpha != 1.0f || bias != nullptr;
  #pragma omp parallel num_threads(nt) if (nt > 1)
  {
    #pragma omp for collapse(2) schedule(static)
    for (int64_t kb = 0; kb < nkb; ++kb)
      for (int64_t p = 0; p < mp; ++p) {
        const int64_t pc = kb * SF_KC, kc = std::min<int64_t>(SF_KC, K - pc);
        sf_pack_a(A, rsa, csa, row0(p), row0(p + 1) - row0(p), mr, pc, kc, Ap + mp * mr * pc + p * mr * kc);
      }
    for (int64_t jc = 0; jc < N; jc += bsrc.chunk) {
      const int64_t nc = std::min<int64_t>(bsrc.chunk, N - jc);
      const int64_t np = (nc + nr - 1) / nr;
      bsrc.prepare(jc, nc, np, nr, nkb);
      // tiles of at most ~144 rows x 256 columns, equal sized, and (with threads) at least 4 per thread
      // where the panels allow it, and a multiple of the threads below 8 per thread (9 tiles on 2
      // threads left one thread 5: 128 x 768 @ 768 x 2304 ran 10% slower than onnxruntime's); threads
      // take tiles dynamically. 144 rows keep the 128 tokens of a sequence in one row of tiles, so each B
      // panel is read once (measured: 128 x 768 @ 768 x 50257 12% faster than with 96-row tiles; the
      // other GPT-2 shapes unchanged or up to 4% faster)
      int64_t ntm = (mp * mr + 143) / 144, ntn = (np * nr + 255) / 256;
      ntm = std::max<int64_t>(1, std::min(ntm, mp));
      ntn = std::max<int64_t>(1, std::min(ntn, np));
      auto count = [](int64_t t, int64_t panels) {  // tiles made of `panels` split `t` ways, equal sized
        const int64_t per = (panels + t - 1) / t;
        return (panels + per - 1) / per;
      };
      while (nt > 1 && (ntm < mp || ntn < np)) {
        const int64_t tiles = count(ntm, mp) * count(ntn, np);
        if (tiles >= 4 * nt && (tiles % nt == 0 || tiles >= 8 * nt)) break;
        if (ntn < np && (ntm >= mp || np * ntm >= mp * ntn)) ++ntn; else ++ntm;
      }
      const int64_t mpt = (mp + ntm - 1) / ntm, npt = (np + ntn - 1) / ntn;  // panels per tile
      ntm = (mp + mpt - 1) / mpt;
      ntn = (np + npt - 1) / npt;
      float* Cc = C + jc;
      #pragma omp for collapse(2) schedule(dynamic, 1)
      for (int64_t tm = 0; tm < ntm; ++tm) {
        for (int64_t tn = 0; tn < ntn; ++tn) {
          const int64_t ip0 = tm * mpt, ip1 = std::min(mp, ip0 + mpt);
          const int64_t jp0 = tn * npt, jp1 = std::min(np, jp0 + npt);
          // one K block of one column panel against the tile's rows
          auto block = [&](int64_t kb, int64_t jp) {
            const int64_t pc = kb * SF_KC, kc = std::min<int64_t>(SF_KC, K - pc);
            const float* Ab = Ap + mp * mr * pc;
            const int64_t nrr = std::min(nr, nc - jp * nr);
            int64_t ldb, bnext;
            const float* Bb = bsrc.panel(jc, np, nr, nrr, pc, kc, jp, ldb, bnext);
            for (int64_t ip = ip0; ip < ip1; ++ip) {
              const int64_t mrr = row0(ip + 1) - row0(ip);
              u.fn[mrr - 1](kc, Ab + ip * mr * kc, Bb, ldb, bnext, Cc + row0(ip) * ldc + jp * nr, ldc, mrr, nrr,
                            kb == 0);
            }
          };
          if (ip1 - ip0 <= 2) {
            // few rows: each B panel is read once, so walk it down all of K (one stream from memory)
            for (int64_t jp = jp0; jp < jp1; ++jp)
              for (int64_t kb = 0; kb < nkb; ++kb) block(kb, jp);
          } else {
            for (int64_t kb = 0; kb < nkb; ++kb)
              for (int64_t jp = jp0; jp < jp1; ++jp) block(kb, jp);
          }
          if (epi)
            sf_gemm_epilogue(C, ldc, row0(ip0), row0(ip1), jc + jp0 * nr, jc + std::min(nc, jp1 * nr),
                             alpha, bias, rbs, cbs);
        }
      }
    }
  }
}

// B packed per call into the workspace, a chunk at a time: pack(jc, nc, p, nr, k0, kc, Bp) packs columns
// jc + [p*nr, p*nr + nr) (of the nc-column chunk at jc, zero past nc) and rows [k0, k0 + kc) of B into Bp
// as [kc][nr]
template <class PackB>
struct SfPackPerCall {
  const PackB& pack;
  float* Bp;
  int64_t K, chunk;
  void prepare(int64_t jc, int64_t nc, int64_t np, int64_t nr, int64_t nkb) const {
    #pragma omp for collapse(2) schedule(static)
    for (int64_t kb = 0; kb < nkb; ++kb)
      for (int64_t p = 0; p < np; ++p) {
        const int64_t pc = kb * SF_KC, kc = std::min<int64_t>(SF_KC, K - pc);
        pack(jc, nc, p, nr, pc, kc, Bp + np * nr * pc + p * nr * kc);
      }
  }
  const float* panel(int64_t, int64_t np, int64_t nr, int64_t, int64_t pc, int64_t kc, int64_t jp, int64_t& ldb,
                     int64_t& bnext) const {
    ldb = nr;
    bnext = 16;
    return Bp + np * nr * pc + jp * nr * kc;
  }
};

template <class PackB>
static void sf_sgemm_packed(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
                            const PackB& pack_b, float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs,
                            int64_t cbs, bool par) {
  const int64_t nr = sf_ukr().nr;
  const int64_t npm = (std::min<int64_t>(N, SF_NC) + nr - 1) / nr;
  float* Bp = static_cast<float*>(sf_workspace(2, sizeof(float) * npm * nr * K));
  const SfPackPerCall<PackB> src{pack_b, Bp, K, SF_NC};
  sf_sgemm_driver(M, N, K, A, rsa, csa, src, C, ldc, alpha, bias, rbs, cbs, par);
}

// A weight B[K, N] packed at compile time (PackedMatMul): [ceil(N / SF_PANEL)][K][SF_PANEL], B[k, j] at
// [j / SF_PANEL][k][j % SF_PANEL], zero columns past N. A kernel narrower than a panel reads a part of it
// (ldb = SF_PANEL); the AVX-512 one (32 columns, starting at a panel's first) reads two adjacent
// panels (bnext). Measured on Zen 3 (AVX2), the GPT-2/Llama projections at 1x128 tokens took 5-14%
// less time with panels of 16 columns than with panels of 32 read half at a time.
struct SfPrepacked {
  const float* Bp;
  int64_t K, chunk;
  void prepare(int64_t, int64_t, int64_t, int64_t, int64_t) const {}
  const float* panel(int64_t jc, int64_t, int64_t nr, int64_t cols, int64_t pc, int64_t, int64_t jp, int64_t& ldb,
                     int64_t& bnext) const {
    const int64_t j = jc + jp * nr;
    ldb = SF_PANEL;
    bnext = cols > SF_PANEL ? K * SF_PANEL : 0;
    return Bp + (j / SF_PANEL) * K * SF_PANEL + pc * SF_PANEL + j % SF_PANEL;
  }
};

// whether a product is worth the threads (smaller ones run on the calling thread)
static inline bool sf_gemm_parallel(int64_t M, int64_t N, int64_t K, bool allow) {
  return allow && sf_max_threads() > 1 && (double)M * N * K >= 262144.0;
}

// C = alpha * 0 + bias when nothing is contracted (K == 0)
static void sf_gemm_empty_k(int64_t M, int64_t N, float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs,
                            int64_t cbs) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = 0.0f;
  sf_gemm_epilogue(C, ldc, 0, M, 0, N, alpha, bias, rbs, cbs);
}

static void sf_sgemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
                     const float* B, int64_t rsb, int64_t csb, float* C, int64_t ldc, float alpha,
                     const float* bias, int64_t rbs, int64_t cbs, bool allow_parallel) {
  if (M <= 0 || N <= 0) return;
  const bool par = sf_gemm_parallel(M, N, K, allow_parallel);
  if (K <= 0) {
    sf_gemm_empty_k(M, N, C, ldc, alpha, bias, rbs, cbs);
    return;
  }
  if (M == 1 && csb == 1) {
    sf_gemv_row(N, K, A, csa, B, rsb, C, alpha, bias, cbs, par);
    return;
  }
  if (M == 1 && rsb == 1 && csa == 1) {
    sf_gemv_dot(N, K, A, B, csb, C, alpha, bias, cbs, par);
    return;
  }
  auto pack = [=](int64_t jc, int64_t nc, int64_t p, int64_t nr, int64_t k0, int64_t kc, float* Bp) {
    sf_pack_b(B + jc * csb, rsb, csb, nc, p, nr, k0, kc, Bp);
  };
  sf_sgemm_packed(M, N, K, A, rsa, csa, pack, C, ldc, alpha, bias, rbs, cbs, par);
}

// y[1, N] = a[1, K] @ B for the prepacked panels [p0, p1) of B, four sums per column (k mod 4) so
// that their multiply-adds do not wait on each other
static void sf_gemv_panel_range(int64_t p0, int64_t p1, int64_t N, int64_t K, const float* __restrict__ A,
                                int64_t csa, const float* __restrict__ Bp, float* __restrict__ C, float alpha,
                                const float* __restrict__ bias, int64_t cbs) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* __restrict__ b = Bp + p * K * SF_PANEL;
    float acc[4][SF_PANEL] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float a = A[k * csa];
      for (int64_t j = 0; j < SF_PANEL; ++j) acc[k & 3][j] += a * b[k * SF_PANEL + j];
    }
    const int64_t j0 = p * SF_PANEL, nj = std::min(N - j0, SF_PANEL);
    for (int64_t j = 0; j < nj; ++j)
      C[j0 + j] = alpha * ((acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j])) + (bias ? bias[(j0 + j) * cbs] : 0.0f);
  }
}

#if defined(__x86_64__)
// The same with AVX2 (GCC's own vectorization of the loop above shuffles lanes: about 2x slower on Zen 3)
__attribute__((target("avx2,fma")))
static void sf_gemv_panel_range_avx2(int64_t p0, int64_t p1, int64_t N, int64_t K, const float* __restrict__ A,
                                     int64_t csa, const float* __restrict__ Bp, float* __restrict__ C, float alpha,
                                     const float* __restrict__ bias, int64_t cbs) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* __restrict__ b = Bp + p * K * SF_PANEL;
    __m256 acc[4][2];
    #pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      _mm_prefetch(reinterpret_cast<const char*>(b + (k + 32) * SF_PANEL), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + (k + 34) * SF_PANEL), _MM_HINT_T0);
      #pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m256 a = _mm256_set1_ps(A[(k + u) * csa]);
        acc[u][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + (k + u) * SF_PANEL), acc[u][0]);
        acc[u][1] = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + (k + u) * SF_PANEL + 8), acc[u][1]);
      }
    }
    for (; k < K; ++k) {
      const __m256 a = _mm256_set1_ps(A[k * csa]);
      acc[0][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + k * SF_PANEL), acc[0][0]);
      acc[0][1] = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + k * SF_PANEL + 8), acc[0][1]);
    }
    alignas(32) float t[SF_PANEL];
    for (int v = 0; v < 2; ++v)
      _mm256_store_ps(t + 8 * v, _mm256_add_ps(_mm256_add_ps(acc[0][v], acc[1][v]), _mm256_add_ps(acc[2][v], acc[3][v])));
    const int64_t j0 = p * SF_PANEL, nj = std::min(N - j0, SF_PANEL);
    for (int64_t j = 0; j < nj; ++j) C[j0 + j] = alpha * t[j] + (bias ? bias[(j0 + j) * cbs] : 0.0f);
  }
}
#endif

// y[1, N] = a[1, K] @ B for a prepacked B: threads split the panels
static void sf_gemv_panels(int64_t N, int64_t K, const float* __restrict__ A, int64_t csa, const float* __restrict__ Bp,
                           float* __restrict__ C, float alpha, const float* __restrict__ bias, int64_t cbs, bool par) {
  const int64_t np = (N + SF_PANEL - 1) / SF_PANEL;
  const int64_t nt = par && N * K >= (1 << 16) ? std::min<int64_t>(sf_max_threads(), np) : 1;
  auto range = sf_gemv_panel_range;
#if defined(__x86_64__)
  if (sf_avx2_helpers()) range = sf_gemv_panel_range_avx2;
#endif
  #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t t = 0; t < nt; ++t) range(np * t / nt, np * (t + 1) / nt, N, K, A, csa, Bp, C, alpha, bias, cbs);
}

// C[M, N] = alpha * (A @ B) + bias with B prepacked (SfPrepacked)
static void sf_sgemm_prepacked(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
                               const float* Bp, float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs,
                               int64_t cbs, bool allow_parallel) {
  if (M <= 0 || N <= 0) return;
  const bool par = sf_gemm_parallel(M, N, K, allow_parallel);
  if (K <= 0) {
    sf_gemm_empty_k(M, N, C, ldc, alpha, bias, rbs, cbs);
    return;
  }
  if (M == 1) {
    sf_gemv_panels(N, K, A, csa, Bp, C, alpha, bias, cbs, par);
    return;
  }
  const SfPrepacked src{Bp, K, N};
  sf_sgemm_driver(M, N, K, A, rsa, csa, src, C, ldc, alpha, bias, rbs, cbs, par);
}

// ---- Convolution: the weights read in place ------------------------------------------------------
// A conv is a GEMM per image and group, y[OCG, OH*OW] = w[OCG, K] @ im2col(x) with K = C*KH*KW. Its A,
// the weights, is read where it lies by these micro-kernels (one weight broadcast per row and k), so
// weights are never packed (packing them cost more than the products for small images). B, the im2col
// matrix, is packed per tile into panels of VL*nv columns, [kc][VL*nv]. A kernel computes an MR x (VL*nv)
// block of C, MR = 1..mr and nv = 1..nv_max chosen at the call, so row and column remainders cost no
// padding work; the last nr columns (nr <= VL*nv) and MR rows are stored.
// The im2col matrix of one image (and group) of a 2-D convolution,
// B[(c*KH + kh)*KW + kw][oh*OW + ow] = x[c][oh*SH + kh*DH - PT][ow*SW + kw*DW - PL] (0 in the padding),
// is packed panel by panel from the image; a padded image is first copied into a zero-bordered buffer,
// so that every row of B is a few plain copies of input row pieces.
struct SfConvGeom { int64_t C, H, W, KH, KW, SH, SW, DH, DW, PT, PL, OH, OW; };

// floats a buffer of packed conv panels has past its end: a pack may store whole vectors past a row's
// last column (the AVX2 one, below)
constexpr int64_t SF_PACK_SLACK = 16;

// Rows [k0, k0 + kc) and columns [j0, j0 + cols) of the im2col matrix into Bp as [kc][nr] (zero past cols).
// xp: the image, [C][Hp][Wp] with the padding already in it (no bounds to check); row k of B starts at
// xp + koff[k] (its tap at output pixel (0, 0)).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
static void sf_pack_b_conv(const float* __restrict__ xp, int64_t Hp, int64_t Wp, const SfConvGeom& g,
                           const int32_t* __restrict__ koff, int64_t j0, int64_t cols, int64_t nr, int64_t k0,
                           int64_t kc, float* __restrict__ Bp) {
  const int64_t oh0 = j0 / g.OW, ow0 = j0 % g.OW, sw = g.SW, rstep = g.SH * Wp;
  if ((sw != 1 || g.OW < 16) && nr <= 64) {
    // short or strided row pieces: one gather per row of B, from the offsets of the columns' first tap
    int32_t idx[64];
    for (int64_t j = 0, oh = oh0, ow = ow0; j < cols; ++j) {
      idx[j] = (int32_t)(oh * rstep + ow * sw);
      if (++ow == g.OW) { ow = 0; ++oh; }
    }
    for (int64_t k = 0; k < kc; ++k) {
      const float* base = xp + koff[k0 + k];
      float* dst = Bp + k * nr;
      for (int64_t j = 0; j < cols; ++j) dst[j] = base[idx[j]];
      for (int64_t t = cols; t < nr; ++t) dst[t] = 0.0f;
    }
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    const float* base = xp + koff[k0 + k];
    float* dst = Bp + k * nr;
    const float* row = base + oh0 * rstep;  // input row of output row oh0 at tap (kh, kw)
    for (int64_t j = 0, ow = ow0; j < cols; ow = 0, row += rstep) {
      const int64_t seg = std::min(cols - j, g.OW - ow);
      const float* src = row + ow * sw;
      float* d = dst + j;
      if (sw == 1) { for (int64_t t = 0; t < seg; ++t) d[t] = src[t]; }
      else { for (int64_t t = 0; t < seg; ++t) d[t] = src[t * sw]; }
      j += seg;
    }
    for (int64_t t = cols; t < nr; ++t) dst[t] = 0.0f;
  }
}

#if defined(__x86_64__)
// The same with vectors. Long unit-stride row pieces: masked loads and stores of up to 16 (8) columns
// (AVX2: whole-vector stores, see there).
// Short or strided ones: one gather per 16 (8) columns of a row of B, from the offsets of the columns'
// first tap (the same for every row; the columns past cols are masked off, i.e. zero).
__attribute__((target("avx512f")))
static void sf_pack_b_conv_avx512(const float* __restrict__ xp, int64_t Hp, int64_t Wp, const SfConvGeom& g,
                                  const int32_t* __restrict__ koff, int64_t j0, int64_t cols, int64_t nr, int64_t k0,
                                  int64_t kc, float* __restrict__ Bp) {
  const int64_t oh0 = j0 / g.OW, ow0 = j0 % g.OW, sw = g.SW, rstep = g.SH * Wp;
  if ((sw != 1 || g.OW < 16) && nr <= 64) {
    // per group of 16 columns: their offsets o[t] (increasing) from the first one; when they span at most
    // 32 floats, two masked loads and a two-register permute make the group, else a gather
    int64_t off[4];
    __m512i perm[4];
    __mmask16 m0[4], m1[4], mc[4];
    bool gather[4];
    const int64_t nv = nr / 16;
    for (int64_t v = 0, j = 0, oh = oh0, ow = ow0; v < nv; ++v) {
      alignas(64) int32_t o[16] = {};
      const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, cols - 16 * v));
      int64_t first = 0, last = 0;
      for (int64_t t = 0; t < n; ++t, ++j) {
        const int64_t pos = oh * rstep + ow * sw;
        if (t == 0) first = pos;
        last = pos;
        o[t] = (int32_t)(pos - first);
        if (++ow == g.OW) { ow = 0; ++oh; }
      }
      const int64_t span = n ? last - first + 1 : 0;
      off[v] = first;
      perm[v] = _mm512_load_si512(o);
      gather[v] = span > 32;
      m0[v] = span >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << span) - 1u);
      m1[v] = span <= 16 ? (__mmask16)0 : (span >= 32 ? (__mmask16)0xffff : (__mmask16)((1u << (span - 16)) - 1u));
      mc[v] = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    }
    // groups 0 and 1 with their masks and permutes in registers (nr <= 32 for the 12 x 32 kernels)
    const int64_t w1 = nv > 1 ? 1 : 0;
    const __mmask16 a0 = m0[0], a1 = m1[0], ac = mc[0], b0 = m0[w1], b1 = m1[w1], bc = mc[w1];
    const __m512i pa = perm[0], pb = perm[w1];
    const int64_t oa = off[0], ob = off[w1];
    const bool ga = gather[0], gb = gather[w1];
#define SF_GROUP(SRC, M0, M1, MC, PERM, G, DST)                                                         \
    if (G) {                                                                                           \
      _mm512_store_ps(DST, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), MC, PERM, SRC, 4));            \
    } else {                                                                                           \
      const __m512 lo = _mm512_maskz_loadu_ps(M0, SRC), hi = _mm512_maskz_loadu_ps(M1, (SRC) + 16);     \
      _mm512_store_ps(DST, _mm512_maskz_permutex2var_ps(MC, lo, PERM, hi));                             \
    }
    for (int64_t k = 0; k < kc; ++k) {
      const float* base = xp + koff[k0 + k];
      float* dst = Bp + k * nr;
      SF_GROUP(base + oa, a0, a1, ac, pa, ga, dst)
      if (nv > 1) { SF_GROUP(base + ob, b0, b1, bc, pb, gb, dst + 16) }
      for (int64_t v = 2; v < nv; ++v) {
        SF_GROUP(base + off[v], m0[v], m1[v], mc[v], perm[v], gather[v], dst + 16 * v)
      }
    }
#undef SF_GROUP
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    const float* base = xp + koff[k0 + k];
    float* dst = Bp + k * nr;
    const float* row = base + oh0 * rstep;
    for (int64_t j = 0, ow = ow0; j < cols; ow = 0, row += rstep) {
      const int64_t seg = std::min(cols - j, g.OW - ow);
      const float* src = row + ow * sw;
      float* d = dst + j;
      for (int64_t t = 0; t < seg; t += 16) {
        const int64_t n = std::min<int64_t>(16, seg - t);
        const __mmask16 m = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
        if (sw == 1) _mm512_mask_storeu_ps(d + t, m, _mm512_maskz_loadu_ps(m, src + t));
        else for (int64_t u = 0; u < n; ++u) d[t + u] = src[(t + u) * sw];
      }
      j += seg;
    }
    for (int64_t t = cols; t < nr; t += 16) {
      const int64_t n = std::min<int64_t>(16, nr - t);
      _mm512_mask_storeu_ps(dst + t, n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u), _mm512_setzero_ps());
    }
  }
}

__attribute__((target("avx2,fma")))
static void sf_pack_b_conv_avx2(const float* __restrict__ xp, int64_t Hp, int64_t Wp, const SfConvGeom& g,
                                const int32_t* __restrict__ koff, int64_t j0, int64_t cols, int64_t nr, int64_t k0,
                                int64_t kc, float* __restrict__ Bp) {
  const int64_t oh0 = j0 / g.OW, ow0 = j0 % g.OW, sw = g.SW, rstep = g.SH * Wp;
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  if ((sw != 1 || g.OW < 8) && nr <= 64 && Hp * Wp * g.C < (int64_t(1) << 31)) {
    alignas(32) int32_t idx[64];
    for (int64_t j = 0, oh = oh0, ow = ow0; j < nr; ++j) {
      idx[j] = j < cols ? (int32_t)(oh * rstep + ow * sw) : 0;
      if (++ow == g.OW) { ow = 0; ++oh; }
    }
    const int64_t nv = nr / 8;
    for (int64_t k = 0; k < kc; ++k) {
      const float* base = xp + koff[k0 + k];
      float* dst = Bp + k * nr;
      for (int64_t v = 0; v < nv; ++v) {
        const int n = (int)std::min<int64_t>(8, std::max<int64_t>(0, cols - 8 * v));
        const __m256 m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota));
        const __m256i iv = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx + 8 * v));
        _mm256_store_ps(dst + 8 * v, _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, iv, m, 4));
      }
    }
    return;
  }
  // unit stride: whole-vector stores, also past a row piece's end (up to 7 floats past column nr of row
  // k, i.e. into the next row or panel, which is packed later, or the buffer's SF_PACK_SLACK); AMD's
  // masked stores are slow (measured on Zen 3: 70% of this function's time, 21% of a 3x3 conv at 14x14).
  // Loads are whole vectors too, except (masked) where 8 floats would pass the end of the image.
  const float* xend = xp + g.C * Hp * Wp;
  for (int64_t k = 0; k < kc; ++k) {
    const float* base = xp + koff[k0 + k];
    float* dst = Bp + k * nr;
    const float* row = base + oh0 * rstep;
    for (int64_t j = 0, ow = ow0; j < cols; ow = 0, row += rstep) {
      const int64_t seg = std::min(cols - j, g.OW - ow);
      const float* src = row + ow * sw;
      float* d = dst + j;
      for (int64_t t = 0; t < seg; t += 8) {
        if (sw != 1) {
          for (int64_t u = 0; u < std::min<int64_t>(8, seg - t); ++u) d[t + u] = src[(t + u) * sw];
        } else if (src + t + 8 <= xend) {
          _mm256_storeu_ps(d + t, _mm256_loadu_ps(src + t));
        } else {
          const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(8, seg - t)), iota);
          _mm256_storeu_ps(d + t, _mm256_maskload_ps(src + t, m));
        }
      }
      j += seg;
    }
    for (int64_t t = cols; t < nr; ++t) dst[t] = 0.0f;
  }
}
#endif

typedef void (*SfPackFn)(const float* __restrict__ xp, int64_t Hp, int64_t Wp, const SfConvGeom& g,
                         const int32_t* __restrict__ koff, int64_t j0, int64_t cols, int64_t nr, int64_t k0, int64_t kc,
                         float* __restrict__ Bp);

// The clamp a conv's kernels apply as they store its output, when on: min(max(v, lo), hi) (a fused Relu:
// [0, inf); a fused Clip: its bounds, ReLU6's [0, 6]). A NaN stays NaN, as in Relu and Clip: max and min
// return v when it is NaN (std::max(v, lo), and _mm*_max_ps(lo, v) whose second operand is v).
struct SfClamp { bool on; float lo, hi; };

static inline float sf_clamp(float v, const SfClamp& k) { return k.on ? std::min(std::max(v, k.lo), k.hi) : v; }

// The finish of a conv's output block that the kernels apply as they store its last K block: + bias[i]
// of row i (bias null: none), + res[i * ldc + j] (the residual, laid out as C; null: none), then the
// clamp. One per kernel call, its pointers at the call's first row and column.
struct SfFin { const float* bias; const float* res; SfClamp clamp; };

typedef void (*SfCukrFn)(int64_t kc, const float* __restrict__ A, int64_t lda, const float* __restrict__ Bp,
                         float* __restrict__ C, int64_t ldc, int64_t nr, bool first, const SfFin* fin);

// v + *r (r optional), then clamped: a conv output finished
static inline float sf_fin1(float v, const float* r, const SfClamp& k) {
  if (r) v += *r;
  return sf_clamp(v, k);
}

#if defined(__x86_64__)
// sf_clamp of 16 and 8 lanes
__attribute__((target("avx512f"), always_inline))
static inline __m512 sf_clamp16(__m512 v, const SfClamp& k) {
  return _mm512_min_ps(_mm512_set1_ps(k.hi), _mm512_max_ps(_mm512_set1_ps(k.lo), v));
}
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 sf_clamp8(__m256 v, const SfClamp& k) {
  return _mm256_min_ps(_mm256_set1_ps(k.hi), _mm256_max_ps(_mm256_set1_ps(k.lo), v));
}
#endif

// row i of a kernel's block, t[0..nr), into c (added to it unless first), finished by fin
static inline void sf_store_row(const float* t, float* __restrict__ c, int64_t nr, bool first, const SfFin* fin,
                                int i, int64_t ldc) {
  const float* b = fin && fin->bias ? fin->bias + i : nullptr;
  const float* r = fin && fin->res ? fin->res + i * ldc : nullptr;
  const SfClamp k = fin ? fin->clamp : SfClamp{};
  for (int64_t j = 0; j < nr; ++j) {
    float v = first ? t[j] : c[j] + t[j];
    if (b) v += *b;
    c[j] = sf_fin1(v, r ? r + j : nullptr, k);
  }
}

// the lines of rows [0, MR) x [0, width) of p (row stride ld) asked for, so that a kernel's residual
// arrives while it multiplies (read at the block's store, it stalled on every call)
template <int MR>
static inline void sf_prefetch_rows(const float* p, int64_t ld, int64_t width) {
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    __builtin_prefetch(p + i * ld);
    __builtin_prefetch(p + i * ld + width - 1);
  }
}

#if defined(__x86_64__)
// C[MR][nr] (+)= the accumulators (nr <= 16 * NV), finished by fin, for the AVX-512 conv kernels
template <int MR, int NV>
__attribute__((target("avx512f"), always_inline))
static inline void sf_cukr_store_avx512(const __m512 (&acc)[MR][NV], float* __restrict__ C, int64_t ldc, int64_t nr,
                                        bool first, const SfFin* fin) {
  #pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t rem = nr - 16 * v;
    const __mmask16 m = rem >= 16 ? (__mmask16)0xffff : (rem > 0 ? (__mmask16)((1u << rem) - 1u) : (__mmask16)0);
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      float* c = C + i * ldc + 16 * v;
      __m512 r = acc[i][v];
      if (!first) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, c));
      if (fin) {
        if (fin->bias) r = _mm512_add_ps(r, _mm512_set1_ps(fin->bias[i]));
        if (fin->res) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, fin->res + i * ldc + 16 * v));
        if (fin->clamp.on) r = sf_clamp16(r, fin->clamp);
      }
      _mm512_mask_storeu_ps(c, m, r);
    }
  }
}

template <int MR, int NV>
__attribute__((target("avx512f")))
static void sf_cukr_avx512(int64_t kc, const float* __restrict__ A, int64_t lda, const float* __restrict__ Bp,
                           float* __restrict__ C, int64_t ldc, int64_t nr, bool first, const SfFin* fin) {
  if (fin && fin->res) sf_prefetch_rows<MR>(fin->res, ldc, 16 * NV);
  __m512 acc[MR][NV];
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 b[NV];
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_load_ps(Bp + k * (16 * NV) + 16 * v);
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(A[i * lda + k]);
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(av, b[v], acc[i][v]);
    }
  }
  sf_cukr_store_avx512<MR, NV>(acc, C, ldc, nr, first, fin);
}

// as sf_cukr_avx512 with B read from the image (xb + off[k], nr <= 16 * NV consecutive floats per k)
template <int MR, int NV, bool TAIL>
__attribute__((target("avx512f")))
static void sf_dkr_avx512(int64_t kc, const float* __restrict__ A, int64_t lda, const float* __restrict__ xb,
                          const int32_t* __restrict__ off, float* __restrict__ C, int64_t ldc, int64_t nr, bool first,
                          const SfFin* fin) {
  if (fin && fin->res) sf_prefetch_rows<MR>(fin->res, ldc, 16 * NV);
  __m512 acc[MR][NV];
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const int64_t rem = nr - 16 * (NV - 1);  // the last vector's columns, 1..16
  const __mmask16 tail = rem >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1u);
  for (int64_t k = 0; k < kc; ++k) {
    const float* src = xb + off[k];
    __m512 b[NV];
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      b[v] = TAIL && v == NV - 1 ? _mm512_maskz_loadu_ps(tail, src + 16 * v) : _mm512_loadu_ps(src + 16 * v);
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(A[i * lda + k]);
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(av, b[v], acc[i][v]);
    }
  }
  sf_cukr_store_avx512<MR, NV>(acc, C, ldc, nr, first, fin);
}

// C[MR][nr] (+)= the accumulators (nr <= 8 * NV), for the AVX2 conv kernels below
template <int MR, int NV>
__attribute__((target("avx2,fma"), always_inline))
static inline void sf_cukr_store_avx2(const __m256 (&acc)[MR][NV], float* __restrict__ C, int64_t ldc, int64_t nr,
                                      bool first, const SfFin* fin) {
  if (nr == 8 * NV) {
    #pragma GCC unroll 12
    for (int i = 0; i < MR; ++i)
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* c = C + i * ldc + 8 * v;
        __m256 r = acc[i][v];
        if (!first) r = _mm256_add_ps(r, _mm256_loadu_ps(c));
        if (fin) {
          if (fin->bias) r = _mm256_add_ps(r, _mm256_broadcast_ss(fin->bias + i));
          if (fin->res) r = _mm256_add_ps(r, _mm256_loadu_ps(fin->res + i * ldc + 8 * v));
          if (fin->clamp.on) r = sf_clamp8(r, fin->clamp);
        }
        _mm256_storeu_ps(c, r);
      }
    return;
  }
  // every index of acc a constant (unrolled), else GCC keeps acc in memory and stores all of it on
  // every k step of the caller's loop (measured: a 3x3 conv 3.5x slower)
  alignas(32) float t[MR][8 * NV];
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm256_store_ps(t[i] + 8 * v, acc[i][v]);
  for (int i = 0; i < MR; ++i) sf_store_row(t[i], C + i * ldc, nr, first, fin, i, ldc);
}

template <int MR, int NV>
__attribute__((target("avx2,fma")))
static void sf_cukr_avx2(int64_t kc, const float* __restrict__ A, int64_t lda, const float* __restrict__ Bp,
                         float* __restrict__ C, int64_t ldc, int64_t nr, bool first, const SfFin* fin) {
  if (fin && fin->res) sf_prefetch_rows<MR>(fin->res, ldc, 8 * NV);
  __m256 acc[MR][NV];
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b[NV];
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm256_load_ps(Bp + k * (8 * NV) + 8 * v);
    #pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(A + i * lda + k);
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(av, b[v], acc[i][v]);
    }
  }
  sf_cukr_store_avx2<MR, NV>(acc, C, ldc, nr, first, fin);
}

// The same with B read from the image where it lies (a conv of horizontal stride 1): row k of the
// panel is the nr consecutive pixels at xb + off[k] (off[k]: the offset of tap k, i.e. of channel c at
// (kh, kw)). TAIL: nr < 8 * NV, the last vector's load is masked (never reads past the image).
template <int MR, int NV, bool TAIL>
__attribute__((target("avx2,fma")))
static void sf_dkr_avx2(int64_t kc, const float* __restrict__ A, int64_t lda, const float* __restrict__ xb,
                        const int32_t* __restrict__ off, float* __restrict__ C, int64_t ldc, int64_t nr, bool first,
                        const SfFin* fin) {
  if (fin && fin->res) sf_prefetch_rows<MR>(fin->res, ldc, 8 * NV);
  __m256 acc[MR][NV];
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nr - 8 * (NV - 1))),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t k = 0; k < kc; ++k) {
    const float* src = xb + off[k];
    __m256 b[NV];
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      b[v] = TAIL && v == NV - 1 ? _mm256_maskload_ps(src + 8 * v, tail) : _mm256_loadu_ps(src + 8 * v);
    #pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(A + i * lda + k);
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(av, b[v], acc[i][v]);
    }
  }
  sf_cukr_store_avx2<MR, NV>(acc, C, ldc, nr, first, fin);
}
#endif

template <int MR>
static void sf_cukr_generic(int64_t kc, const float* __restrict__ A, int64_t lda, const float* __restrict__ Bp,
                            float* __restrict__ C, int64_t ldc, int64_t nr, bool first, const SfFin* fin) {
  float t[MR][8] = {};
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < MR; ++i) {
      const float a = A[i * lda + k];
      for (int j = 0; j < 8; ++j) t[i][j] += a * Bp[8 * k + j];
    }
  for (int i = 0; i < MR; ++i) sf_store_row(t[i], C + i * ldc, nr, first, fin, i, ldc);
}

typedef void (*SfDkrFn)(int64_t kc, const float* __restrict__ A, int64_t lda, const float* __restrict__ xb,
                        const int32_t* __restrict__ off, float* __restrict__ C, int64_t ldc, int64_t nr, bool first,
                        const SfFin* fin);

// fn[MR - 1][nv - 1]: an MR x (vl * nv) kernel on packed panels; dfn[MR - 1][nv - 1][tail]: the same
// reading B from the image (null where the ISA has none: those convs pack). Rows per call: mr, or mr1
// for one-vector panels (AVX2: 12 x 8, whose 12 independent sums hide the FMA latency; measured on
// Zen 3, a 1-column panel of a 3x3 conv at 7x7 took 30% less time than with 6 x 8)
struct SfCukr { SfCukrFn fn[12][2]; SfDkrFn dfn[12][2][2]; SfPackFn pack; int64_t mr, mr1, nv, vl; };

static SfCukr sf_pick_cukr() {
  SfCukr u = {};
#if defined(__x86_64__)
  __builtin_cpu_init();
  const char* force = std::getenv("SHARDFLOW_CPU_ISA");
  bool allow512 = !force || std::strcmp(force, "avx512") == 0;
  bool allow2 = !force || std::strcmp(force, "avx512") == 0 || std::strcmp(force, "avx2") == 0;
  if (allow512 && __builtin_cpu_supports("avx512f")) {
#define SF_K(r) u.fn[r - 1][0] = sf_cukr_avx512<r, 1>; u.fn[r - 1][1] = sf_cukr_avx512<r, 2>;                 \
    u.dfn[r - 1][0][0] = sf_dkr_avx512<r, 1, false>; u.dfn[r - 1][0][1] = sf_dkr_avx512<r, 1, true>;             \
    u.dfn[r - 1][1][0] = sf_dkr_avx512<r, 2, false>; u.dfn[r - 1][1][1] = sf_dkr_avx512<r, 2, true>;
    SF_K(1) SF_K(2) SF_K(3) SF_K(4) SF_K(5) SF_K(6) SF_K(7) SF_K(8) SF_K(9) SF_K(10) SF_K(11) SF_K(12)
#undef SF_K
    u.pack = sf_pack_b_conv_avx512;
    u.mr = u.mr1 = 12; u.nv = 2; u.vl = 16;
    return u;
  }
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
#define SF_K1(r) u.fn[r - 1][0] = sf_cukr_avx2<r, 1>;                                                        \
    u.dfn[r - 1][0][0] = sf_dkr_avx2<r, 1, false>; u.dfn[r - 1][0][1] = sf_dkr_avx2<r, 1, true>;
#define SF_K(r) SF_K1(r) u.fn[r - 1][1] = sf_cukr_avx2<r, 2>;                                                   \
    u.dfn[r - 1][1][0] = sf_dkr_avx2<r, 2, false>; u.dfn[r - 1][1][1] = sf_dkr_avx2<r, 2, true>;
    SF_K(1) SF_K(2) SF_K(3) SF_K(4) SF_K(5) SF_K(6) SF_K1(7) SF_K1(8) SF_K1(9) SF_K1(10) SF_K1(11) SF_K1(12)
#undef SF_K
#undef SF_K1
    u.pack = sf_pack_b_conv_avx2;
    u.mr = 6; u.mr1 = 12; u.nv = 2; u.vl = 8;
    return u;
  }
#endif
  u.fn[0][0] = sf_cukr_generic<1>; u.fn[1][0] = sf_cukr_generic<2>;
  u.fn[2][0] = sf_cukr_generic<3>; u.fn[3][0] = sf_cukr_generic<4>;
  u.pack = sf_pack_b_conv;
  u.mr = u.mr1 = 4; u.nv = 1; u.vl = 8;
  return u;
}
static const SfCukr& sf_cukr() { static const SfCukr u = sf_pick_cukr(); return u; }

// dst[Hp][Wp] = src[H][W] at (pt, pl), zero around it (no library calls for the short rows)
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
static void sf_pad_plane(const float* __restrict__ src, int64_t H, int64_t W, int64_t pt, int64_t pl, int64_t Hp,
                         int64_t Wp, float* __restrict__ dst) {
  for (int64_t i = 0; i < pt * Wp; ++i) dst[i] = 0.0f;
  for (int64_t r = 0; r < H; ++r) {
    float* d = dst + (pt + r) * Wp;
    const float* s = src + r * W;
    for (int64_t c = 0; c < pl; ++c) d[c] = 0.0f;
    for (int64_t c = 0; c < W; ++c) d[pl + c] = s[c];
    for (int64_t c = pl + W; c < Wp; ++c) d[c] = 0.0f;
  }
  for (int64_t i = (pt + H) * Wp; i < Hp * Wp; ++i) dst[i] = 0.0f;
}

// The SH x SW phases of one channel of a strided conv's padded image, each [Hh][Wh]: phase (a, b) holds
// xp[i * SH + a][j * SW + b], where xp is src[H][W] placed at (pt, pl) in zeros (0 past its end too). Tap
// (kh, kw) of output pixel (oh, ow) is xp[oh * SH + kh * DH][ow * SW + kw * DW], i.e. pixel (oh + q, ow + r)
// of phase ((kh * DH) % SH, (kw * DW) % SW) with q = kh * DH / SH, r = kw * DW / SW: unit stride in ow.
// t: scratch of SW * Wh floats (a padded input row).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
static void sf_phase_planes(const float* __restrict__ src, int64_t H, int64_t W, int64_t pt, int64_t pl, int64_t SH,
                            int64_t SW, int64_t Hh, int64_t Wh, float* __restrict__ dst, float* __restrict__ t) {
  const int64_t Wt = SW * Wh, n = std::max<int64_t>(0, std::min(W, Wt - pl));  // the row's floats inside t
  for (int64_t c = 0; c < Wt; ++c) t[c] = 0.0f;
  for (int64_t a = 0; a < SH; ++a) {
    for (int64_t i = 0; i < Hh; ++i) {
      const int64_t r = i * SH + a - pt;
      float* d = dst + (a * SW * Hh + i) * Wh;  // row i of phase (a, 0); phase (a, b) is b * Hh * Wh further
      if (r < 0 || r >= H) {
        for (int64_t b = 0; b < SW; ++b)
          for (int64_t j = 0; j < Wh; ++j) d[b * Hh * Wh + j] = 0.0f;
        continue;
      }
      for (int64_t c = 0; c < n; ++c) t[pl + c] = src[r * W + c];  // the padding around stays zero
      if (SW == 2) {  // a constant stride: vectorized (even and odd floats)
        float* __restrict__ d1 = d + Hh * Wh;
        for (int64_t j = 0; j < Wh; ++j) { d[j] = t[2 * j]; d1[j] = t[2 * j + 1]; }
      } else {
        for (int64_t b = 0; b < SW; ++b)
          for (int64_t j = 0; j < Wh; ++j) d[b * Hh * Wh + j] = t[j * SW + b];
      }
    }
  }
}

// dst[OH][OW] = src[oh * SH][ow * SW] of a plane of width W (a stride-2 row vectorized by GCC)
static void sf_pick_plane(const float* __restrict__ src, int64_t W, int64_t SH, int64_t SW, int64_t OH, int64_t OW,
                          float* __restrict__ dst) {
  for (int64_t oh = 0; oh < OH; ++oh) {
    const float* __restrict__ s = src + oh * SH * W;
    float* __restrict__ d = dst + oh * OW;
    if (SW == 2) { for (int64_t ow = 0; ow < OW; ++ow) d[ow] = s[2 * ow]; }
    else { for (int64_t ow = 0; ow < OW; ++ow) d[ow] = s[ow * SW]; }
  }
}

// multiply-adds below which a convolution runs on the calling thread
constexpr double SF_CONV_PAR_WORK = 131072.0;
// the most packed B (bytes) a thread keeps for reuse by its next tile
constexpr double SF_CONV_KEEP_BYTES = 4194304.0;

// y[n, gi*ocg + o, :] = w[gi*ocg + o, :] @ im2col(x[n, gi*C : (gi+1)*C]) + bias[gi*ocg + o] for every image
// n < nimg and group gi < groups (x: [nimg, groups*C, H, W], w: [groups*ocg, C*KH*KW], y: [nimg,
// groups*ocg, OH, OW]). direct: a 1x1, stride-1, unpadded conv. Tasks are tiles of C (up to ~96 rows x
// 256 columns) of every image and group; a thread packs the B panels of its tile into its own buffer
// (once per tile when K fits one block) and runs the K blocks over it, or (unpacked, below) reads them
// from the image.
// epi (optional) finishes a tile of y in place: epi(ctx, n, c0, c1, j0, j1) for image n, output channels
// [c0, c1) and columns [j0, j1) of OH*OW (the bias, then the element-wise ops fused after the conv).
// Without epi, the kernels finish y as they store their last K block: + bias, + res (optional, a tensor
// shaped as y: a residual), then the clamp (a Relu or Clip; measured on Zen 3, rfcs/0002: ResNet's 1x1 convs
// with a Relu, or a residual Add and a Relu, 9-15% faster at 56x56 and 28x28 than with the ops in epi).
typedef void (*SfConvEpi)(const void* ctx, int64_t n, int64_t c0, int64_t c1, int64_t j0, int64_t j1);
struct SfEpiCtx { const void* const* in; void* const* out; };  // what a generated epilogue reads

static void sf_conv2d(const float* x, const float* w, const float* bias, float* y, const SfConvGeom& g,
                      int64_t nimg, int64_t groups, int64_t ocg, bool direct, SfConvEpi epi = nullptr,
                      const void* ctx = nullptr, const float* res = nullptr, SfClamp clamp = {}) {
  const SfCukr& u = sf_cukr();
  const int64_t M = ocg, P = g.OH * g.OW, K = g.C * g.KH * g.KW;
  if (nimg <= 0 || groups <= 0 || M <= 0 || P <= 0) return;
  const int64_t mr = u.mr, vl = u.vl, nrm = u.nv * u.vl;
  const int64_t nkb = std::max<int64_t>(1, (K + SF_KC - 1) / SF_KC), kcb = std::max<int64_t>(1, (K + nkb - 1) / nkb);
  const int64_t mp = (M + mr - 1) / mr, np = (P + nrm - 1) / nrm;
  const int nt = sf_max_threads();
  const bool par = nt > 1 && (double)nimg * groups * M * P * K >= SF_CONV_PAR_WORK;
  // tiles: ntm x ntn per image and group, of at most ~96 rows x 256 columns, the panels split evenly
  // (tile t has panels [p * t / nt, p * (t + 1) / nt)). With threads: more tiles until every thread gets
  // at least two and the count divides evenly (or there are many), splitting the wider side.
  int64_t ntm = (mp + 7) / 8, ntn = (np + 7) / 8;
  auto ntiles = [&]() { return nimg * groups * ntm * ntn; };
  while (par && (ntiles() < 2 * nt || (ntiles() % nt != 0 && ntiles() < 8 * nt)) && (ntm < mp || ntn < np)) {
    if (ntn < np && (ntm >= mp || np * ntm >= mp * ntn)) ++ntn; else ++ntm;
  }
  const int64_t npt = (np + ntn - 1) / ntn;  // the most column panels of a tile
  const int64_t ntask = nimg * groups * ntm * ntn;
  // keep: a thread packs all K rows of its column tile once and reuses them for the next row tiles
  // of the same column tile (consecutive tasks), when they fit SF_CONV_KEEP_BYTES
  const bool keep = ntm > 1 && (nkb == 1 || (double)K * npt * nrm * sizeof(float) <= SF_CONV_KEEP_BYTES);
  // the padded images: [nimg * groups * C][Hp][Wp], the input rows at (PT, PL)
  const int64_t Hp = std::max(g.H + g.PT, (g.OH - 1) * g.SH + (g.KH - 1) * g.DH + 1);
  const int64_t Wp = std::max(g.W + g.PL, (g.OW - 1) * g.SW + (g.KW - 1) * g.DW + 1);
  const int64_t nplanes = nimg * groups * g.C;
  // unpacked: B is read from the image where it lies (no packing), a panel being up to nrm consecutive
  // pixels of one output row, its row k at offset off[k]. Needs the ISA's kernels (AVX2, AVX-512), a
  // unit horizontal stride, and pays off where packing is dear for its reuse, i.e. fewer than 1024
  // output channels, and the rows fill whole panels (a 1x1 conv's one row of P pixels at least 4
  // panels): measured on Zen 3, 3x3 64->64 at 56x56 1.5x faster, 1x1 256->64 at 56x56 1.4x; at 7x7 and
  // at 1024 output channels packing was 10-45% faster. With AVX-512 (Zen 4, paired runs) MobileNetV2's
  // 1x1 convs (M = 16..32, K = 96..192) at 56x56 and 28x28 took 0.73-0.82x the packed time, ResNet-50's
  // 1x1s (M = 64..256) 0.83-0.98x, DenseNet's 3x3 128->32 at 56x56 0.91x and the 7x7 stride-2 stems (K =
  // 147, phased) 0.91-0.95x; but K = 16 1.04x, MobileNetV2's stem (K = 27) 1.09x, SqueezeNet's 3x3 16->64
  // at 55x55 (M = 64) 1.08x and Inception's 1x1s of M = 64..112 at 13x13 1.06-1.11x (M = 24 0.8x). So with
  // 16 lanes: K >= 32 and M <= 32, or a phased conv, or a 1x1 of 512 pixels or more.
  // phased: a strided conv whose taps overlap (a window wider than the stride) reads the SH x SW phases
  // of its padded image (sf_phase_planes, [nimg * groups * C][SH * SW][Hh][Wh]), where each tap's pixels
  // are consecutive: packed with plain copies instead of gathers, or unpacked where output rows are long
  // (at least 3 panels; unpacked at 28 pixels a row was 10-15% slower). Measured on Zen 3 (rfcs/0002):
  // the 7x7 stride-2 stem 1.3x faster, 3x3 stride-2 convs to 56x56 and 112x112 1.15-1.45x; windows as
  // wide as the stride (patches) lost 5% to the extra copy, so they are read as before.
  const int64_t S2 = g.SH * g.SW, Hh = (Hp + g.SH - 1) / g.SH, Wh = (Wp + g.SW - 1) / g.SW;
  const bool phased = !direct && S2 > 1 && ((g.KH - 1) * g.DH >= g.SH || (g.KW - 1) * g.DW >= g.SW) &&
                      (double)nplanes * S2 * Hh * Wh < 2147483647.0;
  // picked: an unpadded strided 1x1 conv reads only every SH-th row and SW-th column; those pixels are
  // copied out first (OH x OW per channel), and the conv becomes a direct one (its B read unpacked
  // where the direct rule says so) instead of gathering B (measured on Zen 3, rfcs/0002: 256->512 at
  // 56x56 stride 2, 5-9% faster)
  const bool picked = !direct && g.KH == 1 && g.KW == 1 && g.PT == 0 && g.PL == 0 && S2 > 1;
  const bool flat = direct || picked;  // B is [C][P]: one row of P pixels per channel
  const bool padded = !flat && !phased && (Hp != g.H || Wp != g.W);
  const bool copied = padded || phased || picked;  // B is read from xpad, the image's copy
  const int64_t plane = phased ? S2 * Hh * Wh : picked ? P : Hp * Wp;  // floats per channel of xpad
  float* xpad = copied ? static_cast<float*>(sf_workspace(3, sizeof(float) * nplanes * plane)) : nullptr;
  const float* xs = copied ? xpad : x;
  // the geometry the B panels are read with: a 1x1, stride-1, unpadded conv's image is one row of P
  // columns per channel; a phased conv's phases are channels of stride 1 (taps located by off[k])
  const SfConvGeom gs = flat     ? SfConvGeom{K, 1, P, 1, 1, 1, 1, 1, 1, 0, 0, 1, P}
                        : phased ? SfConvGeom{g.C * S2, Hh, Wh, g.KH, g.KW, 1, 1, g.DH, g.DW, 0, 0, g.OH, g.OW}
                                 : g;
  const int64_t Hs = flat ? 1 : phased ? Hh : (padded ? Hp : g.H);
  const int64_t Ws = flat ? P : phased ? Wh : (padded ? Wp : g.W);
  const int64_t ximg = gs.C * Hs * Ws;
  const bool unpacked = u.dfn[0][0][0] && gs.SW == 1 && M < 1024 && (double)ximg < 2147483647.0 &&
                        (flat ? P >= 4 * nrm : gs.OW >= (phased ? 3 : 1) * nrm) &&
                        (vl < 16 || (K >= 32 && (M <= 32 || phased || (flat && P >= 512))));
  // off[k]: where row k of B (channel c, tap (kh, kw)) starts in the image read, at output pixel (0, 0)
  int32_t* off = static_cast<int32_t*>(sf_workspace(4, sizeof(int32_t) * K));
  const bool finish = !epi && (bias || res || clamp.on);  // the kernels finish y (SfFin) on the last K block
  for (int64_t c = 0, k = 0; c < (flat ? K : g.C); ++c)
    for (int64_t kh = 0; kh < gs.KH; ++kh)
      for (int64_t kw = 0; kw < gs.KW; ++kw) {
        const int64_t dh = kh * gs.DH, dw = kw * gs.DW;  // phased: phase (dh % SH, dw % SW) at (dh / SH, dw / SW)
        off[k++] = (int32_t)(phased ? ((c * S2 + dh % g.SH * g.SW + dw % g.SW) * Hh + dh / g.SH) * Wh + dw / g.SW
                                    : (c * Hs + dh) * Ws + dw);
      }
  #pragma omp parallel num_threads(nt) if (par)
  {
    if (padded) {
      #pragma omp for schedule(static)
      for (int64_t pl = 0; pl < nplanes; ++pl) sf_pad_plane(x + pl * g.H * g.W, g.H, g.W, g.PT, g.PL, Hp, Wp, xpad + pl * plane);
    } else if (phased) {
      float* t = static_cast<float*>(sf_workspace(2, sizeof(float) * g.SW * Wh));
      #pragma omp for schedule(static)
      for (int64_t pl = 0; pl < nplanes; ++pl)
        sf_phase_planes(x + pl * g.H * g.W, g.H, g.W, g.PT, g.PL, g.SH, g.SW, Hh, Wh, xpad + pl * plane, t);
    } else if (picked) {
      #pragma omp for schedule(static)
      for (int64_t pl = 0; pl < nplanes; ++pl)
        sf_pick_plane(x + pl * g.H * g.W, g.W, g.SH, g.SW, g.OH, g.OW, xpad + pl * P);
    }
    float* Bp = unpacked ? nullptr
                         : static_cast<float*>(
                               sf_workspace(2, sizeof(float) * ((keep ? K : kcb) * npt * nrm + SF_PACK_SLACK)));
    int64_t packed = -1;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < ntask; ++t) {
      const int64_t tm = t % ntm, col = t / ntm;  // col: (image, group, column tile)
      const int64_t tn = col % ntn, ng = col / ntn, gi = ng % groups;
      const float* xg = xs + ng * ximg;
      const float* wg = w + gi * M * K;
      float* yg = y + ng * M * P;
      const float* rg = res ? res + ng * M * P : nullptr;
      SfFin fin = {nullptr, nullptr, clamp};
      // the kernel's finish: on the last K block only, its pointers at the call's first row and column
      auto last = [&](int64_t kb, int64_t i, int64_t j) -> const SfFin* {
        if (!finish || kb != nkb - 1) return nullptr;
        fin.bias = bias ? bias + gi * M + i : nullptr;
        fin.res = rg ? rg + i * P + j : nullptr;
        return &fin;
      };
      const int64_t i0 = mp * tm / ntm * mr, i1 = std::min(M, mp * (tm + 1) / ntm * mr);
      const int64_t j0 = np * tn / ntn * nrm, j1 = std::min(P, np * (tn + 1) / ntn * nrm);
      if (unpacked) {
        for (int64_t kb = 0; kb < nkb; ++kb) {
          const int64_t pc = kb * kcb, kc = std::min(kcb, K - pc);
          for (int64_t j = j0; j < j1;) {
            const int64_t oh = j / gs.OW, ow = j % gs.OW;
            const int64_t cols = std::min(std::min(nrm, gs.OW - ow), j1 - j), nv = (cols + vl - 1) / vl;
            const float* xb = xg + oh * gs.SH * Ws + ow;
            const int64_t step = nv == 1 ? u.mr1 : mr;
            for (int64_t i = i0; i < i1; i += step) {
              const int64_t rows = std::min(step, i1 - i);
              u.dfn[rows - 1][nv - 1][cols < nv * vl](kc, wg + i * K + pc, K, xb, off + pc, yg + i * P + j, P, cols,
                                                      kb == 0, last(kb, i, j));
            }
            j += cols;
          }
        }
      } else {
        const bool pack = !keep || packed != col;
        packed = col;
        for (int64_t kb = 0; kb < nkb; ++kb) {
          const int64_t pc = kb * kcb, kc = std::min(kcb, K - pc);
          float* Bb = Bp + (keep ? pc * npt * nrm : 0);  // this K block's panels, [kc][width] each
          if (pack) {
            for (int64_t j = j0; j < j1; j += nrm) {
              const int64_t cols = std::min(nrm, j1 - j), width = (cols + vl - 1) / vl * vl;
              float* dst = Bb + (j - j0) * kc;
              u.pack(xg, Hs, Ws, gs, off, j, cols, width, pc, kc, dst);
            }
          }
          for (int64_t j = j0; j < j1; j += nrm) {
            const int64_t cols = std::min(nrm, j1 - j), nv = (cols + vl - 1) / vl;
            const float* bp = Bb + (j - j0) * kc;
            const int64_t step = nv == 1 ? u.mr1 : mr;
            for (int64_t i = i0; i < i1; i += step) {
              const int64_t rows = std::min(step, i1 - i);
              u.fn[rows - 1][nv - 1](kc, wg + i * K + pc, K, bp, yg + i * P + j, P, cols, kb == 0, last(kb, i, j));
            }
          }
        }
      }
      if (epi) epi(ctx, ng / groups, gi * M + i0, gi * M + i1, j0, j1);
    }
  }
}

// A conv with its weights packed at compile time as GEMM panels (PackedConv, passes/prepack.py), for small
// images: per image, yt[P, OC] = im2col(x)^T[P, K] @ W^T[K, OC] by the prepacked GEMM (the output pixels are
// its rows, the output channels its columns), then yt is transposed into y[OC, P] and finished by the
// bias or the fused element-wise ops (epi). A 1x1, stride-1, unpadded conv reads the image itself as A
// (column-major: pixel p, channel c at x[c * P + p]); the others first copy their im2col matrix, [K][P].
// Where it pays (1x1 convs at 7x7 and 14x14, rfcs/0002): the conv template's B panels would be rows of 7 or
// 14 pixels packed on every call, while the GEMM streams weights packed once and keeps full 6 x 16 tiles.
static void sf_im2col(const float* __restrict__ x, const SfConvGeom& g, float* __restrict__ col, bool par) {
  const int64_t K = g.C * g.KH * g.KW, P = g.OH * g.OW;
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t k = 0; k < K; ++k) {
    const int64_t kw = k % g.KW, kh = (k / g.KW) % g.KH, c = k / (g.KW * g.KH);
    const float* __restrict__ xc = x + c * g.H * g.W;
    float* __restrict__ dst = col + k * P;
    for (int64_t oh = 0; oh < g.OH; ++oh) {
      const int64_t ih = oh * g.SH + kh * g.DH - g.PT;
      float* __restrict__ d = dst + oh * g.OW;
      if (ih < 0 || ih >= g.H) {
        for (int64_t ow = 0; ow < g.OW; ++ow) d[ow] = 0.0f;
        continue;
      }
      // the columns ow in [lo, hi) read inside the row (iw = ow * SW + kw * DW - PL in [0, W)); zero elsewhere
      const int64_t off = kw * g.DW - g.PL;
      int64_t lo, hi;
      sf_inside(off, g.SW, g.W, g.OW, lo, hi);
      const float* __restrict__ xr = xc + ih * g.W + off;
      for (int64_t ow = 0; ow < lo; ++ow) d[ow] = 0.0f;
      if (g.SW == 1) { for (int64_t ow = lo; ow < hi; ++ow) d[ow] = xr[ow]; }
      else { for (int64_t ow = lo; ow < hi; ++ow) d[ow] = xr[ow * g.SW]; }
      for (int64_t ow = hi; ow < g.OW; ++ow) d[ow] = 0.0f;
    }
  }
}

// y[c * P + p] = t[p * ld + c] for c in [c0, c1), finished: + bias[c] (bias optional), + res[c * P + p]
// (res optional, laid out as y), then clamped
static void sf_transpose_cols_scalar(const float* __restrict__ t, int64_t ld, int64_t P, int64_t c0, int64_t c1,
                                     float* __restrict__ y, const float* __restrict__ bias,
                                     const float* __restrict__ res, SfClamp clamp) {
  for (int64_t c = c0; c < c1; ++c) {
    const float b = bias ? bias[c] : 0.0f;
    for (int64_t p = 0; p < P; ++p)
      y[c * P + p] = sf_fin1(bias ? t[p * ld + c] + b : t[p * ld + c], res ? res + c * P + p : nullptr, clamp);
  }
}

#if defined(__x86_64__)
// y[at..at + 8) = v, finished as in sf_transpose_cols_scalar
__attribute__((target("avx2,fma"), always_inline))
static inline void sf_put8(float* __restrict__ y, const float* __restrict__ bias, const float* __restrict__ res,
                           const SfClamp& clamp, int64_t c, int64_t at, __m256 v) {
  if (bias) v = _mm256_add_ps(v, _mm256_broadcast_ss(bias + c));
  if (res) v = _mm256_add_ps(v, _mm256_loadu_ps(res + at));
  if (clamp.on) v = sf_clamp8(v, clamp);
  _mm256_storeu_ps(y + at, v);
}

// The same in 8 x 8 tiles through AVX2 registers (the scalar loop stores one float at a time, P floats apart)
__attribute__((target("avx2,fma")))
static void sf_transpose_cols_avx2(const float* __restrict__ t, int64_t ld, int64_t P, int64_t c0, int64_t c1,
                                   float* __restrict__ y, const float* __restrict__ bias,
                                   const float* __restrict__ res, SfClamp clamp) {
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    int64_t p = 0;
    for (; p + 8 <= P; p += 8) {
      __m256 r[8];
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(t + (p + i) * ld + c);
      sf_tr8x8(r);
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) sf_put8(y, bias, res, clamp, c + i, (c + i) * P + p, r[i]);
    }
    for (; p < P; ++p)
      for (int64_t i = 0; i < 8; ++i) {
        const float v = t[p * ld + c + i];
        y[(c + i) * P + p] = sf_fin1(bias ? v + bias[c + i] : v, res ? res + (c + i) * P + p : nullptr, clamp);
      }
  }
  if (c < c1) sf_transpose_cols_scalar(t, ld, P, c, c1, y, bias, res, clamp);
}
#endif

static void sf_transpose_cols(const float* t, int64_t ld, int64_t P, int64_t c0, int64_t c1, float* y,
                              const float* bias, const float* res, const SfClamp& clamp) {
#if defined(__x86_64__)
  if (sf_avx2_helpers()) { sf_transpose_cols_avx2(t, ld, P, c0, c1, y, bias, res, clamp); return; }
#endif
  sf_transpose_cols_scalar(t, ld, P, c0, c1, y, bias, res, clamp);
}

// epi, res and clamp as in sf_conv2d (the transposition adds the bias, res and the clamp: the GEMM's own bias
// step is a pass of its own over yt)
static void sf_conv2d_packed(const float* x, const float* wp, const float* bias, float* y, const SfConvGeom& g,
                             int64_t nimg, int64_t OC, bool direct, SfConvEpi epi = nullptr,
                             const void* ctx = nullptr, const float* res = nullptr, SfClamp clamp = {}) {
  const int64_t P = g.OH * g.OW, K = g.C * g.KH * g.KW;
  if (nimg <= 0 || OC <= 0 || P <= 0) return;
  const bool par = sf_max_threads() > 1 && (double)P * OC * K >= SF_CONV_PAR_WORK;
  float* yt = static_cast<float*>(sf_workspace(5, sizeof(float) * P * OC));
  float* col = direct ? nullptr : static_cast<float*>(sf_workspace(3, sizeof(float) * K * P));
  constexpr int64_t CB = 16;  // channels per block of the transposition
  const int64_t ncb = (OC + CB - 1) / CB;
  for (int64_t n = 0; n < nimg; ++n) {
    const float* xi = x + n * g.C * g.H * g.W;
    if (!direct) sf_im2col(xi, g, col, par);
    sf_sgemm_prepacked(P, OC, K, direct ? xi : col, 1, P, wp, yt, OC, 1.0f, nullptr, 0, 0, true);
    float* yi = y + n * OC * P;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t cb = 0; cb < ncb; ++cb) {
      const int64_t c0 = cb * CB, c1 = std::min(OC, c0 + CB);
      sf_transpose_cols(yt, OC, P, c0, c1, yi, epi ? nullptr : bias, res ? res + n * OC * P : nullptr, clamp);
      if (epi) epi(ctx, n, c0, c1, 0, P);
    }
  }
}

// ---- Depthwise convolution (one input channel per group) --------------------------------------------
// Output channel oc = ic * ocm + j of image n reads input channel ic (ocm outputs per input channel).
// Threads take (image, j, block of 16 input channels, band of output rows) items. The band's input rows
// are transposed into xt[row][padded column][16 channels] (zero in the padding and in the lanes of
// missing channels), so that an output pixel's 16 channels are one vector: bias + sum over taps of
// w[tap][16] * xt[row*SH + kh*DH][col*SW + kw*DW], over a run of output columns at a time (any stride or
// dilation, whole-vector loads); each output row is transposed back into its 16 planes (clamped as in
// SfFin) and epi (as in sf_conv2d) finishes the band. Small planes (7x7, 14x14) do whole-vector work where
// a plane's rows would be a vector or less (row by row they took 5x onnxruntime's time).
constexpr int64_t SF_DWC = 16;

// t[j * 16 + c] = src[c * ld + j] for c < nc, 0 for nc <= c < 16; j < n
static void sf_to_vec16_generic(const float* __restrict__ src, int64_t ld, int64_t nc, int64_t n,
                                float* __restrict__ t) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < SF_DWC; ++c) t[j * SF_DWC + c] = c < nc ? src[c * ld + j] : 0.0f;
}

// dst[c * ld + j] = t[j * 16 + c] (clamped) for c < nc, j < n
static void sf_from_vec16_generic(const float* __restrict__ t, int64_t n, int64_t nc, float* __restrict__ dst,
                                  int64_t ld, SfClamp clamp) {
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t j = 0; j < n; ++j) dst[c * ld + j] = sf_clamp(t[j * SF_DWC + c], clamp);
}

// yt[ow * 16 + c] for ow < OW: output row r of the band (xt as above, rows of Wp columns), weights wt[T][16],
// bias bv[16]; runs of 4 columns (the last run reads past the row: xt has room)
SF_CLONES
static void sf_dwc_row_generic(const float* __restrict__ xt, int64_t Wp, const float* __restrict__ wt,
                               const float* __restrict__ bv, const SfConvGeom& g, int64_t r, float* __restrict__ yt) {
  const int64_t S16 = g.SW * SF_DWC;
  for (int64_t ow0 = 0; ow0 < g.OW; ow0 += 4) {
    float a[4][SF_DWC];
    for (int b = 0; b < 4; ++b)
      for (int c = 0; c < SF_DWC; ++c) a[b][c] = bv[c];
    for (int64_t kh = 0; kh < g.KH; ++kh) {
      const float* __restrict__ xr = xt + ((r * g.SH + kh * g.DH) * Wp + ow0 * g.SW) * SF_DWC;
      for (int64_t kw = 0; kw < g.KW; ++kw) {
        const float* __restrict__ wv = wt + (kh * g.KW + kw) * SF_DWC;
        const float* __restrict__ xp = xr + kw * g.DW * SF_DWC;
        for (int b = 0; b < 4; ++b)
          for (int c = 0; c < SF_DWC; ++c) a[b][c] += wv[c] * xp[b * S16 + c];
      }
    }
    for (int64_t b = 0; b < std::min<int64_t>(4, g.OW - ow0); ++b)
      for (int c = 0; c < SF_DWC; ++c) yt[(ow0 + b) * SF_DWC + c] = a[b][c];
  }
}

#if defined(__x86_64__)
// lanes [0, m) set (m in 1..8): the columns of a run of 8 that exist
__attribute__((target("avx2,fma"), always_inline))
static inline __m256i sf_lanes8(int64_t m) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// as sf_to_vec16_generic, in 8 x 8 transpositions (the last run of columns by masked loads)
__attribute__((target("avx2,fma")))
static void sf_to_vec16_avx2(const float* __restrict__ src, int64_t ld, int64_t nc, int64_t n,
                             float* __restrict__ t) {
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t m = std::min<int64_t>(8, n - j);
    const __m256i k = sf_lanes8(m);
    for (int64_t h = 0; h < SF_DWC; h += 8) {
      __m256 r[8];
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        r[i] = h + i >= nc ? _mm256_setzero_ps()
             : m == 8 ? _mm256_loadu_ps(src + (h + i) * ld + j) : _mm256_maskload_ps(src + (h + i) * ld + j, k);
      sf_tr8x8(r);
      for (int64_t i = 0; i < m; ++i) _mm256_storeu_ps(t + (j + i) * SF_DWC + h, r[i]);
    }
  }
}

// as sf_from_vec16_generic, in 8 x 8 transpositions (the last run of columns by masked stores; t has
// room for whole runs)
__attribute__((target("avx2,fma")))
static void sf_from_vec16_avx2(const float* __restrict__ t, int64_t n, int64_t nc, float* __restrict__ dst,
                               int64_t ld, SfClamp clamp) {
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t m = std::min<int64_t>(8, n - j);
    const __m256i k = sf_lanes8(m);
    for (int64_t h = 0; h < nc; h += 8) {
      __m256 r[8];
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(t + (j + i) * SF_DWC + h);
      sf_tr8x8(r);
      const int64_t nh = std::min<int64_t>(8, nc - h);
      for (int64_t i = 0; i < nh; ++i) {
        const __m256 v = clamp.on ? sf_clamp8(r[i], clamp) : r[i];
        if (m == 8) _mm256_storeu_ps(dst + (h + i) * ld + j, v);
        else _mm256_maskstore_ps(dst + (h + i) * ld + j, k, v);
      }
    }
  }
}

// as sf_dwc_row_generic, runs of 4 columns of two 8-lane halves
__attribute__((target("avx2,fma")))
static void sf_dwc_row_avx2(const float* __restrict__ xt, int64_t Wp, const float* __restrict__ wt,
                            const float* __restrict__ bv, const SfConvGeom& g, int64_t r, float* __restrict__ yt) {
  const int64_t S16 = g.SW * SF_DWC;
  for (int64_t ow0 = 0; ow0 < g.OW; ow0 += 4) {
    __m256 a[4][2];
    #pragma GCC unroll 4
    for (int b = 0; b < 4; ++b) { a[b][0] = _mm256_loadu_ps(bv); a[b][1] = _mm256_loadu_ps(bv + 8); }
    for (int64_t kh = 0; kh < g.KH; ++kh) {
      const float* xr = xt + ((r * g.SH + kh * g.DH) * Wp + ow0 * g.SW) * SF_DWC;
      for (int64_t kw = 0; kw < g.KW; ++kw) {
        const float* wk = wt + (kh * g.KW + kw) * SF_DWC;
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        const float* xp = xr + kw * g.DW * SF_DWC;
        #pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) {
          a[b][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + b * S16), a[b][0]);
          a[b][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + b * S16 + 8), a[b][1]);
        }
      }
    }
    const int64_t nb = std::min<int64_t>(4, g.OW - ow0);
    for (int64_t b = 0; b < nb; ++b) {
      _mm256_storeu_ps(yt + (ow0 + b) * SF_DWC, a[b][0]);
      _mm256_storeu_ps(yt + (ow0 + b) * SF_DWC + 8, a[b][1]);
    }
  }
}

// as sf_dwc_row_generic, runs of 8 columns of one 16-lane vector
__attribute__((target("avx512f")))
static void sf_dwc_row_avx512(const float* __restrict__ xt, int64_t Wp, const float* __restrict__ wt,
                              const float* __restrict__ bv, const SfConvGeom& g, int64_t r, float* __restrict__ yt) {
  const int64_t S16 = g.SW * SF_DWC;
  for (int64_t ow0 = 0; ow0 < g.OW; ow0 += 8) {
    __m512 a[8];
    #pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) a[b] = _mm512_loadu_ps(bv);
    for (int64_t kh = 0; kh < g.KH; ++kh) {
      const float* xr = xt + ((r * g.SH + kh * g.DH) * Wp + ow0 * g.SW) * SF_DWC;
      for (int64_t kw = 0; kw < g.KW; ++kw) {
        const __m512 wv = _mm512_loadu_ps(wt + (kh * g.KW + kw) * SF_DWC);
        const float* xp = xr + kw * g.DW * SF_DWC;
        #pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) a[b] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + b * S16), a[b]);
      }
    }
    const int64_t nb = std::min<int64_t>(8, g.OW - ow0);
    for (int64_t b = 0; b < nb; ++b) _mm512_storeu_ps(yt + (ow0 + b) * SF_DWC, a[b]);
  }
}
#endif

// the columns a run of the row kernels reads past its row: 8 runs' strides (xt's room past its last row)
static inline int64_t sf_dwc_room(const SfConvGeom& g) { return 8 * g.SW * SF_DWC; }

// the depthwise kernels' instruction set: 2 AVX-512, 1 AVX2, 0 portable
static inline int sf_dw_isa() {
#if defined(__x86_64__)
  return sf_ukr().nr == 32 ? 2 : (sf_avx2_helpers() ? 1 : 0);
#else
  return 0;
#endif
}

// ---- Depthwise 3x3 convolution at stride 1 with output rows as wide as the input's: flat planes ------
// Output pixel p = oh * W + ow of a channel reads, at tap (kh, kw), input pixel p + e * W + d (e = kh * DH -
// PT, d = kw * DW - PL) when input row oh + e and column ow + d exist. A plane is then runs of 16 output
// pixels across its rows, each tap one masked load and one multiply-add: no transposition, and narrow
// planes (7x7, 14x14) fill their vectors. A run's column masks depend on its first column only, so they
// repeat every W / gcd(W, 16) runs (a table); its row masks cut the runs of the first and last rows.
constexpr int64_t SF_DWF = 16;

// bits [lo, hi) of a run's 16 lanes
static inline uint32_t sf_lane_bits(int64_t lo, int64_t hi) {
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, SF_DWF);
  return hi <= lo ? 0u : ((1u << hi) - 1u) & ~((1u << lo) - 1u);
}

// runs after which the column masks repeat
static inline int64_t sf_dwf_period(int64_t W) {
  int64_t a = W, b = SF_DWF;
  while (b) { const int64_t t = a % b; a = b; b = t; }
  return W / a;
}

// 3x3 only: MobileNetV2's stride-1 3x3s take 0.72-0.84x the blocks' time at 112x112, 56x56 and 28x28,
// 0.65-0.7x at 14x14 and 7x7 (Zen 4), but 5x5s took 1.2-1.6x and a 7x7 (ConvNeXt's, 56x56) 1.8x: the
// masks per tap cost more than the blocks' transpositions there. The blocks keep the other convs.
static inline bool sf_dwf_fits(const SfConvGeom& g) {
  return g.KH == 3 && g.KW == 3 && g.SH == 1 && g.SW == 1 && g.OW == g.W && sf_dwf_period(g.W) * g.KW <= 4096;
}

// the lanes of the run of pixels p0... whose tap row e exists in an input of H rows of W (lanes past the
// plane are not stored)
static inline uint32_t sf_dwf_rows(int64_t H, int64_t W, int64_t p0, int64_t e) {
  return sf_lane_bits(-e * W - p0, (H - e) * W - p0);
}

// y[p] for runs [v0, v1) of one plane (x: its input plane, wc[KH * KW] its weights, b its bias; colm: the
// column masks, period x KW); clamped. Any kernel size (the AVX kernels: 3x3)
SF_CLONES
static void sf_dwf_generic(const float* x, const float* wc, float b, float* y, const SfConvGeom& g,
                           const uint16_t* colm, int64_t period, int64_t v0, int64_t v1, SfClamp clamp) {
  // the geometry in locals: a store to y could alias g, which the taps would read again
  const int64_t KH = g.KH, KW = g.KW, H = g.H, W = g.W, DH = g.DH, DW = g.DW, PT = g.PT, PL = g.PL;
  const int64_t OP = g.OH * g.OW;
  for (int64_t v = v0, q = v0 % period; v < v1; ++v, q = q + 1 == period ? 0 : q + 1) {
    const int64_t p0 = v * SF_DWF;
    float a[SF_DWF];
    for (int l = 0; l < SF_DWF; ++l) a[l] = b;
    for (int64_t kh = 0; kh < KH; ++kh) {
      const int64_t e = kh * DH - PT;
      const uint32_t rm = sf_dwf_rows(H, W, p0, e);
      for (int64_t kw = 0; kw < KW; ++kw) {
        const uint32_t m = rm & colm[q * KW + kw];
        const float wk = wc[kh * KW + kw];
        const float* xr = x + (p0 + e * W + kw * DW - PL);
        for (int l = 0; l < SF_DWF; ++l)
          if (m >> l & 1u) a[l] += wk * xr[l];
      }
    }
    const int64_t n = std::min(SF_DWF, OP - p0);
    for (int64_t l = 0; l < n; ++l) y[p0 + l] = sf_clamp(a[l], clamp);
  }
}

#if defined(__x86_64__)
// lanes l of 8 where bit l of bits is set
__attribute__((target("avx2,fma"), always_inline))
static inline __m256i sf_bits8(uint32_t bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), sel), sel);
}

// as sf_dwf_generic for a 3x3 kernel, a run as two 8-lane halves, the weights in registers
__attribute__((target("avx2,fma")))
static void sf_dwf_avx2(const float* x, const float* wc, float b, float* y, const SfConvGeom& g,
                        const uint16_t* colm, int64_t period, int64_t v0, int64_t v1, SfClamp clamp) {
  // the geometry in locals: a store to y could alias g, which the taps would read again
  const int64_t H = g.H, W = g.W, DH = g.DH, DW = g.DW, PT = g.PT, PL = g.PL;
  constexpr int64_t KH = 3, KW = 3;
  const int64_t OP = g.OH * g.OW;
  __m256 wr[KH * KW];
  for (int t = 0; t < KH * KW; ++t) wr[t] = _mm256_set1_ps(wc[t]);
  for (int64_t v = v0, q = v0 % period; v < v1; ++v, q = q + 1 == period ? 0 : q + 1) {
    const int64_t p0 = v * SF_DWF;
    __m256 a0 = _mm256_set1_ps(b), a1 = a0;
    for (int64_t kh = 0; kh < KH; ++kh) {
      const int64_t e = kh * DH - PT;
      const uint32_t rm = sf_dwf_rows(H, W, p0, e);
      if (!rm) continue;
      const float* xr = x + (p0 + e * W - PL);
      for (int64_t kw = 0; kw < KW; ++kw) {
        const uint32_t m = rm & colm[q * KW + kw];
        const __m256 wk = wr[kh * KW + kw];
        const float* xp = xr + kw * DW;
        if (m == 0xFFFFu) {
          a0 = _mm256_fmadd_ps(wk, _mm256_loadu_ps(xp), a0);
          a1 = _mm256_fmadd_ps(wk, _mm256_loadu_ps(xp + 8), a1);
        } else {
          a0 = _mm256_fmadd_ps(wk, _mm256_maskload_ps(xp, sf_bits8(m & 0xFFu)), a0);
          a1 = _mm256_fmadd_ps(wk, _mm256_maskload_ps(xp + 8, sf_bits8(m >> 8)), a1);
        }
      }
    }
    if (clamp.on) { a0 = sf_clamp8(a0, clamp); a1 = sf_clamp8(a1, clamp); }
    if (OP - p0 >= SF_DWF) {
      _mm256_storeu_ps(y + p0, a0);
      _mm256_storeu_ps(y + p0 + 8, a1);
    } else {  // the plane's last run
      alignas(32) float t[SF_DWF];
      _mm256_store_ps(t, a0);
      _mm256_store_ps(t + 8, a1);
      std::memcpy(y + p0, t, sizeof(float) * (OP - p0));
    }
  }
}

// as sf_dwf_avx2, a run one 16-lane vector
__attribute__((target("avx512f")))
static void sf_dwf_avx512(const float* x, const float* wc, float b, float* y, const SfConvGeom& g,
                          const uint16_t* colm, int64_t period, int64_t v0, int64_t v1, SfClamp clamp) {
  // the geometry in locals: a store to y could alias g, which the taps would read again
  const int64_t H = g.H, W = g.W, DH = g.DH, DW = g.DW, PT = g.PT, PL = g.PL;
  constexpr int64_t KH = 3, KW = 3;
  const int64_t OP = g.OH * g.OW;
  __m512 wr[KH * KW];
  for (int t = 0; t < KH * KW; ++t) wr[t] = _mm512_set1_ps(wc[t]);
  for (int64_t v = v0, q = v0 % period; v < v1; ++v, q = q + 1 == period ? 0 : q + 1) {
    const int64_t p0 = v * SF_DWF;
    __m512 a = _mm512_set1_ps(b);
    for (int64_t kh = 0; kh < KH; ++kh) {
      const int64_t e = kh * DH - PT;
      const uint32_t rm = sf_dwf_rows(H, W, p0, e);
      if (!rm) continue;
      const float* xr = x + (p0 + e * W - PL);
      for (int64_t kw = 0; kw < KW; ++kw) {
        const __m512 wk = wr[kh * KW + kw];
        a = _mm512_fmadd_ps(wk, _mm512_maskz_loadu_ps((__mmask16)(rm & colm[q * KW + kw]), xr + kw * DW), a);
      }
    }
    if (clamp.on) a = sf_clamp16(a, clamp);
    _mm512_mask_storeu_ps(y + p0, (__mmask16)sf_lane_bits(0, OP - p0), a);
  }
}
#endif

static void sf_conv_depthwise_flat(const float* x, const float* w, const float* bias, float* y, const SfConvGeom& g,
                                   int64_t nimg, int64_t C, int64_t ocm, SfConvEpi epi, const void* ctx,
                                   SfClamp clamp) {
  const int64_t T = g.KH * g.KW, HW = g.H * g.W, OP = g.OH * g.OW, OC = C * ocm;
  const int64_t nv = (OP + SF_DWF - 1) / SF_DWF, period = sf_dwf_period(g.W);
  uint16_t* colm = static_cast<uint16_t*>(sf_workspace(4, sizeof(uint16_t) * period * g.KW));
  for (int64_t q = 0; q < period; ++q)
    for (int64_t kw = 0; kw < g.KW; ++kw) {
      uint32_t m = 0;
      for (int64_t l = 0; l < SF_DWF; ++l) {
        const int64_t c = (q * SF_DWF + l) % g.W + kw * g.DW - g.PL;
        if (c >= 0 && c < g.W) m |= 1u << l;
      }
      colm[q * g.KW + kw] = (uint16_t)m;
    }
  // bands of up to 256 runs (16 KB of output), so that large planes of few channels still share out
  const int64_t nbands = (nv + 255) / 256, BV = (nv + nbands - 1) / nbands, items = nimg * OC * nbands;
  const int isa = sf_dw_isa();
  const bool par = sf_max_threads() > 1 && items > 1 && (double)nimg * OC * OP * T >= SF_CONV_PAR_WORK;
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t band = it % nbands, oc = it / nbands % OC, n = it / (nbands * OC);
    const int64_t v0 = band * BV, v1 = std::min(nv, v0 + BV);
    const float* xc = x + (n * C + oc / ocm) * HW;
    const float* wc = w + oc * T;
    const float b = bias ? bias[oc] : 0.0f;
    float* yc = y + (n * OC + oc) * OP;
#if defined(__x86_64__)
    if (isa == 2) sf_dwf_avx512(xc, wc, b, yc, g, colm, period, v0, v1, clamp);
    else if (isa == 1) sf_dwf_avx2(xc, wc, b, yc, g, colm, period, v0, v1, clamp);
    else
#endif
      sf_dwf_generic(xc, wc, b, yc, g, colm, period, v0, v1, clamp);
    if (epi) epi(ctx, n, oc, oc + 1, v0 * SF_DWF, std::min(v1 * SF_DWF, OP));
  }
}

// ---- Depthwise 3x3 convolution at horizontal stride 2 (AVX-512): rows of runs ------------------------
// Output row oh of a channel is runs of 16 pixels. At kernel row kh, a run starting at output column ow0
// reads input row oh * SH + kh * DH - PT at columns c0 + 2l + kw (c0 = 2 * ow0 - PL, lane l, tap kw): two
// masked loads of columns c0 + [0, 32) whose even and odd lanes (two permutes) are the taps kw = 0 and 1,
// and the even lanes one lane on with column c0 + 32 after them (a third permute) the taps kw = 2; the
// masks zero the columns outside the input. No transposition: the blocks transpose every input pixel
// into 16-channel vectors, four per output pixel at stride 2. MobileNetV2's stride-2 3x3s took 0.61-0.62x
// the blocks' time to 56x56 and 28x28, 0.8x to 14x14, but 1.04x to 7x7 (rows of 7 leave 9 of 16 lanes
// idle; paired runs, Zen 4): output rows of 8 or more.
static inline bool sf_dws2_fits(const SfConvGeom& g) {
  return g.KH == 3 && g.KW == 3 && g.SW == 2 && g.DW == 1 && g.OW >= 8 && sf_dw_isa() == 2;
}

#if defined(__x86_64__)
// A run of 16 outputs at horizontal stride 2 starting at input column c0 of rows W wide: the masks of its
// loads (columns c0 + [0, 16), c0 + [16, 32) and column c0 + 32), and of one input row xr (at column c0)
// the taps kw = 0, 1, 2 of its outputs (t2 only when KW3), columns outside the row taking the value fill.
// Shared by the stride-2 depthwise conv and max pool kernels.
struct SfS2Run { __mmask16 m0, m1, m2; };

static inline SfS2Run sf_s2_run(int64_t c0, int64_t W) {
  return {(__mmask16)sf_lane_bits(-c0, W - c0), (__mmask16)sf_lane_bits(-c0 - 16, W - c0 - 16),
          (__mmask16)(sf_lane_bits(-c0 - 32, W - c0 - 32) & 1u)};
}

template <bool KW3>
__attribute__((target("avx512f"), always_inline))
static inline void sf_s2_taps(const float* xr, const SfS2Run& r, __m512 fill, __m512& t0, __m512& t1, __m512& t2) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512 lo = _mm512_mask_loadu_ps(fill, r.m0, xr), hi = _mm512_mask_loadu_ps(fill, r.m1, xr + 16);
  t0 = _mm512_permutex2var_ps(lo, even, hi);
  t1 = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
  if (KW3) {
    const __m512i next = _mm512_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16);
    t2 = _mm512_permutex2var_ps(t0, next, _mm512_mask_loadu_ps(fill, r.m2, xr + 32));
  }
}

// rows [r0, r1) of one output plane (x: its input plane, wc[9] its weights, b its bias), clamped
__attribute__((target("avx512f")))
static void sf_dws2_avx512(const float* x, const float* wc, float b, float* y, const SfConvGeom& g, int64_t r0,
                           int64_t r1, SfClamp clamp) {
  // the geometry in locals: a store to y could alias g, which the taps would read again
  const int64_t H = g.H, W = g.W, OW = g.OW, SH = g.SH, DH = g.DH, PT = g.PT, PL = g.PL;
  __m512 wr[9];
  for (int t = 0; t < 9; ++t) wr[t] = _mm512_set1_ps(wc[t]);
  for (int64_t oh = r0; oh < r1; ++oh)
    for (int64_t ow0 = 0; ow0 < OW; ow0 += SF_DWF) {
      const int64_t c0 = 2 * ow0 - PL;
      const SfS2Run run = sf_s2_run(c0, W);
      __m512 a = _mm512_set1_ps(b);
      for (int64_t kh = 0; kh < 3; ++kh) {
        const int64_t ih = oh * SH + kh * DH - PT;
        if (ih < 0 || ih >= H) continue;
        __m512 t0, t1, t2;
        sf_s2_taps<true>(x + ih * W + c0, run, _mm512_setzero_ps(), t0, t1, t2);
        a = _mm512_fmadd_ps(wr[kh * 3], t0, a);
        a = _mm512_fmadd_ps(wr[kh * 3 + 1], t1, a);
        a = _mm512_fmadd_ps(wr[kh * 3 + 2], t2, a);
      }
      if (clamp.on) a = sf_clamp16(a, clamp);
      _mm512_mask_storeu_ps(y + oh * OW + ow0, (__mmask16)sf_lane_bits(0, OW - ow0), a);
    }
}
#endif

// ---- Max pools of windows 2 or 3 wide at horizontal stride 2 (AVX-512) ------------------------------
// As the stride-2 depthwise kernel above: a run of 16 outputs of output row oh reads, from each input row
// of its window, columns c0 + [0, 33) (c0 = 2 * ow0 - PL) by masked loads filled with -inf where the
// columns lie outside the input; their even, odd and next-even lanes (permutes) are the taps kw = 0, 1,
// 2. A NaN anywhere in a window makes its output NaN (unordered compares), as numpy's max does. Planes
// [p0, p1) of x ([H][W] each) into y ([OH][OW] each); KW 2 or 3, dilation 1.
#if defined(__x86_64__)
__attribute__((target("avx512f")))
static void sf_maxpool_s2_avx512(const float* x, float* y, int64_t p0, int64_t p1, int64_t H, int64_t W, int64_t OH,
                                 int64_t OW, int64_t KH, int64_t KW, int64_t SH, int64_t PT, int64_t PL) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 qnan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (int64_t pl = p0; pl < p1; ++pl) {
    const float* xp = x + pl * H * W;
    float* yp = y + pl * OH * OW;
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow0 = 0; ow0 < OW; ow0 += SF_DWF) {
        const int64_t c0 = 2 * ow0 - PL;
        const SfS2Run run = sf_s2_run(c0, W);
        __m512 m = ninf;
        __mmask16 nan = 0;
        for (int64_t kh = 0; kh < KH; ++kh) {
          const int64_t ih = oh * SH + kh - PT;
          if (ih < 0 || ih >= H) continue;
          __m512 t0, t1, t2;
          if (KW == 3) {
            sf_s2_taps<true>(xp + ih * W + c0, run, ninf, t0, t1, t2);
            nan |= _mm512_cmp_ps_mask(t2, t2, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, t2);
          } else {
            sf_s2_taps<false>(xp + ih * W + c0, run, ninf, t0, t1, t2);
          }
          nan |= _mm512_cmp_ps_mask(t0, t1, _CMP_UNORD_Q);
          m = _mm512_max_ps(m, _mm512_max_ps(t0, t1));
        }
        const __mmask16 st = (__mmask16)sf_lane_bits(0, OW - ow0);
        _mm512_mask_storeu_ps(yp + oh * OW + ow0, st, _mm512_mask_mov_ps(m, nan, qnan));
      }
  }
}
#endif

// whether sf_maxpool_s2 runs (AVX-512), and its loop over planes (threads when par)
static inline bool sf_maxpool_s2_fits() { return sf_dw_isa() == 2; }

static void sf_maxpool_s2(const float* x, float* y, int64_t planes, int64_t H, int64_t W, int64_t OH, int64_t OW,
                          int64_t KH, int64_t KW, int64_t SH, int64_t PT, int64_t PL, bool par) {
#if defined(__x86_64__)
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t pl = 0; pl < planes; ++pl) sf_maxpool_s2_avx512(x, y, pl, pl + 1, H, W, OH, OW, KH, KW, SH, PT, PL);
#else
  (void)x; (void)y; (void)planes; (void)H; (void)W; (void)OH; (void)OW; (void)KH; (void)KW; (void)SH; (void)PT;
  (void)PL; (void)par;
#endif
}

// items: (image, output channel, band of rows), bands of up to 256 runs
static void sf_conv_depthwise_s2(const float* x, const float* w, const float* bias, float* y, const SfConvGeom& g,
                                 int64_t nimg, int64_t C, int64_t ocm, SfConvEpi epi, const void* ctx,
                                 SfClamp clamp) {
#if defined(__x86_64__)
  const int64_t HW = g.H * g.W, OP = g.OH * g.OW, OC = C * ocm, nrun = (g.OW + SF_DWF - 1) / SF_DWF;
  const int64_t BR = std::clamp<int64_t>(256 / nrun, 1, g.OH), nbands = (g.OH + BR - 1) / BR;
  const int64_t items = nimg * OC * nbands;
  const bool par = sf_max_threads() > 1 && items > 1 && (double)nimg * OC * OP * 9 >= SF_CONV_PAR_WORK;
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t band = it % nbands, oc = it / nbands % OC, n = it / (nbands * OC);
    const int64_t r0 = band * BR, r1 = std::min(g.OH, r0 + BR);
    sf_dws2_avx512(x + (n * C + oc / ocm) * HW, w + oc * 9, bias ? bias[oc] : 0.0f, y + (n * OC + oc) * OP, g, r0, r1,
                   clamp);
    if (epi) epi(ctx, n, oc, oc + 1, r0 * g.OW, r1 * g.OW);
  }
#else
  (void)x; (void)w; (void)bias; (void)y; (void)g; (void)nimg; (void)C; (void)ocm; (void)epi; (void)ctx; (void)clamp;
#endif
}

static void sf_conv_depthwise(const float* x, const float* w, const float* bias, float* y, const SfConvGeom& g,
                              int64_t nimg, int64_t C, int64_t ocm, SfConvEpi epi = nullptr, const void* ctx = nullptr,
                              SfClamp clamp = {}) {
  const int64_t T = g.KH * g.KW, ncb = (C + SF_DWC - 1) / SF_DWC, HW = g.H * g.W, OP = g.OH * g.OW, OC = C * ocm;
  if (nimg <= 0 || OC <= 0 || OP <= 0) return;
  if (sf_dwf_fits(g)) { sf_conv_depthwise_flat(x, w, bias, y, g, nimg, C, ocm, epi, ctx, clamp); return; }
  if (sf_dws2_fits(g)) { sf_conv_depthwise_s2(x, w, bias, y, g, nimg, C, ocm, epi, ctx, clamp); return; }
  const int64_t Wp = (g.OW - 1) * g.SW + (g.KW - 1) * g.DW + 1, reach = (g.KH - 1) * g.DH + 1;
  // bands: about 32K floats (128 KB) of transposed input rows
  const int64_t rows = std::max<int64_t>(reach, 32768 / (Wp * SF_DWC));
  const int64_t BR = std::clamp<int64_t>((rows - reach) / g.SH + 1, 1, g.OH), nbands = (g.OH + BR - 1) / BR;
  const int64_t xsz = ((BR - 1) * g.SH + reach) * Wp * SF_DWC + sf_dwc_room(g);
  const int64_t per = xsz + (g.OW + 8) * SF_DWC + T * SF_DWC + SF_DWC;
  const int64_t jlo = std::min(g.PL, Wp), jhi = std::clamp(g.PL + g.W, jlo, Wp);  // xt's columns inside the input
  const int isa = sf_dw_isa();
  const int64_t items = nimg * ocm * ncb * nbands;
  const bool par = sf_max_threads() > 1 && items > 1 && (double)nimg * OC * OP * T >= SF_CONV_PAR_WORK;
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t band = it % nbands, cb = it / nbands % ncb, j = it / (nbands * ncb) % ocm;
    const int64_t n = it / (nbands * ncb * ocm);
    const int64_t c0 = cb * SF_DWC, nc = std::min(SF_DWC, C - c0), oh0 = band * BR, nb = std::min(BR, g.OH - oh0);
    float* xt = static_cast<float*>(sf_workspace(3, sizeof(float) * per));
    float* yt = xt + xsz;
    float* wt = yt + (g.OW + 8) * SF_DWC;
    float* bv = wt + T * SF_DWC;
    for (int64_t t = 0; t < T; ++t)  // output channel (c0 + c) * ocm + j
      for (int64_t c = 0; c < SF_DWC; ++c) wt[t * SF_DWC + c] = c < nc ? w[((c0 + c) * ocm + j) * T + t] : 0.0f;
    for (int64_t c = 0; c < SF_DWC; ++c) bv[c] = c < nc && bias ? bias[(c0 + c) * ocm + j] : 0.0f;
    const int64_t ih0 = oh0 * g.SH - g.PT, nrows = (nb - 1) * g.SH + reach;
    const float* xc = x + (n * C + c0) * HW;
    for (int64_t rr = 0; rr < nrows; ++rr) {
      const int64_t ih = ih0 + rr;
      float* d = xt + rr * Wp * SF_DWC;
      if (ih < 0 || ih >= g.H || jlo >= jhi) { std::memset(d, 0, sizeof(float) * Wp * SF_DWC); continue; }
      std::memset(d, 0, sizeof(float) * jlo * SF_DWC);
      const float* src = xc + ih * g.W + (jlo - g.PL);
#if defined(__x86_64__)
      if (isa) sf_to_vec16_avx2(src, HW, nc, jhi - jlo, d + jlo * SF_DWC);
      else
#endif
        sf_to_vec16_generic(src, HW, nc, jhi - jlo, d + jlo * SF_DWC);
      std::memset(d + jhi * SF_DWC, 0, sizeof(float) * (Wp - jhi) * SF_DWC);
    }
    std::memset(xt + nrows * Wp * SF_DWC, 0, sizeof(float) * sf_dwc_room(g));
    float* yc = y + (n * OC + c0 * ocm + j) * OP;  // its channels ocm planes apart
    for (int64_t r = 0; r < nb; ++r) {
#if defined(__x86_64__)
      if (isa == 2) sf_dwc_row_avx512(xt, Wp, wt, bv, g, r, yt);
      else if (isa == 1) sf_dwc_row_avx2(xt, Wp, wt, bv, g, r, yt);
      else
#endif
        sf_dwc_row_generic(xt, Wp, wt, bv, g, r, yt);
#if defined(__x86_64__)
      if (isa) sf_from_vec16_avx2(yt, g.OW, nc, yc + (oh0 + r) * g.OW, ocm * OP, clamp);
      else
#endif
        sf_from_vec16_generic(yt, g.OW, nc, yc + (oh0 + r) * g.OW, ocm * OP, clamp);
    }
    if (epi && ocm == 1) epi(ctx, n, c0, c0 + nc, oh0 * g.OW, (oh0 + nb) * g.OW);
    else if (epi)
      for (int64_t c = c0; c < c0 + nc; ++c) epi(ctx, n, c * ocm + j, c * ocm + j + 1, oh0 * g.OW, (oh0 + nb) * g.OW);
  }
}

// ---- 3-D convolution --------------------------------------------------------------------------------
// Per image and group, a slab of output depth slices at a time: its im2col matrix col[K][slab pixels]
// (K = C*KD*KH*KW, zero where a tap reads the padding) is copied, then y[OCG, slab] = w[OCG, K] @ col by
// the GEMM with the bias as its epilogue. Slabs keep col within 2 MB (or one slice), so that the GEMM
// packs it from the cache: 3x3x3 16 -> 32 channels at 16x32x32 took 5.3 ms with slabs of 16 MB, 4.05 ms
// with one slice (1.7 MB) each (Zen 4, onnxruntime 2.97 ms).
struct SfConv3Geom { int64_t C, D, H, W, KD, KH, KW, SD, SH, SW, DD, DH, DW, PF, PT, PL, OD, OH, OW; };

static void sf_conv3d(const float* x, const float* w, const float* bias, float* y, const SfConv3Geom& g,
                      int64_t nimg, int64_t groups, int64_t ocg) {
  const int64_t K = g.C * g.KD * g.KH * g.KW, P2 = g.OH * g.OW, P = g.OD * P2, IP = g.D * g.H * g.W;
  if (nimg <= 0 || groups <= 0 || ocg <= 0 || P <= 0) return;
  const int64_t slab = std::clamp<int64_t>((int64_t(1) << 19) / std::max<int64_t>(K * P2, 1), 1, g.OD);  // slices
  float* col = static_cast<float*>(sf_workspace(3, sizeof(float) * K * slab * P2));
  const bool par = sf_max_threads() > 1 && (double)K * slab * P2 >= 65536.0;
  for (int64_t ng = 0; ng < nimg * groups; ++ng) {
    const float* xg = x + ng * g.C * IP;
    for (int64_t d0 = 0; d0 < g.OD; d0 += slab) {
      const int64_t nd = std::min(slab, g.OD - d0), ld = nd * P2;
      #pragma omp parallel for schedule(static) if (par)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t kw = k % g.KW, kh = (k / g.KW) % g.KH, kd = (k / (g.KW * g.KH)) % g.KD;
        const int64_t c = k / (g.KW * g.KH * g.KD);
        const int64_t off = kw * g.DW - g.PL;
        int64_t lo, hi;
        sf_inside(off, g.SW, g.W, g.OW, lo, hi);
        for (int64_t od = d0; od < d0 + nd; ++od) {
          const int64_t id = od * g.SD - g.PF + kd * g.DD;
          for (int64_t oh = 0; oh < g.OH; ++oh) {
            const int64_t ih = oh * g.SH - g.PT + kh * g.DH;
            float* __restrict__ dst = col + k * ld + (od - d0) * P2 + oh * g.OW;
            if (id < 0 || id >= g.D || ih < 0 || ih >= g.H) {
              for (int64_t ow = 0; ow < g.OW; ++ow) dst[ow] = 0.0f;
              continue;
            }
            const float* __restrict__ xr = xg + (c * g.D + id) * g.H * g.W + ih * g.W + off;
            for (int64_t ow = 0; ow < lo; ++ow) dst[ow] = 0.0f;
            if (g.SW == 1) { for (int64_t ow = lo; ow < hi; ++ow) dst[ow] = xr[ow]; }
            else { for (int64_t ow = lo; ow < hi; ++ow) dst[ow] = xr[ow * g.SW]; }
            for (int64_t ow = hi; ow < g.OW; ++ow) dst[ow] = 0.0f;
          }
        }
      }
      const int64_t gi = ng % groups;
      sf_sgemm(ocg, ld, K, w + gi * ocg * K, K, 1, col, ld, 1, y + ng * ocg * P + d0 * P2, P, 1.0f,
               bias ? bias + gi * ocg : nullptr, 1, 0, true);
    }
  }
}

// ---- Transposed convolution (ConvTranspose over 1 or 2 spatial dims) ------------------------------
// Per image and group, cols[OCG*KH*KW, H*W] = W_g^T @ x_g by the GEMM (W_g^T read in place from w [C, OCG,
// KH, KW]: A[m, k] = w[(g*ICG + k) * OCG*KH*KW + m], so the GEMM packs it; the image's channels are B's
// rows as they lie), then each output plane is its bias plus the columns folded back (col2im): tap (kh, kw)
// of input pixel (ih, iw) adds to output pixel (ih*SH - PT + kh*DH, iw*SW - PL + kw*DW) where that lies in
// the output. g holds ICG as C, the input H x W and the output OH x OW. epi as in sf_conv2d (bias then
// nullptr: the epilogue adds it), called once per folded plane.
// y[2i] += a[i], y[2i + 1] += b[i] for i < n (two taps of a stride-2 transposed conv, interleaved)
SF_CLONES
static void sf_fold_pair(float* __restrict__ y, const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    y[2 * i] += a[i];
    y[2 * i + 1] += b[i];
  }
}

static void sf_conv_transpose2d(const float* x, const float* w, const float* bias, float* y, const SfConvGeom& g,
                                int64_t nimg, int64_t groups, int64_t ocg, SfConvEpi epi = nullptr,
                                const void* ctx = nullptr) {
  const int64_t ICG = g.C, P = g.H * g.W, M = ocg * g.KH * g.KW, OP = g.OH * g.OW;
  if (nimg <= 0 || groups <= 0 || ocg <= 0 || OP <= 0) return;
  float* cols = static_cast<float*>(sf_workspace(3, sizeof(float) * M * P));
  const bool par = sf_max_threads() > 1 && (double)M * P * ICG >= SF_CONV_PAR_WORK;
  for (int64_t n = 0; n < nimg; ++n)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t ng = n * groups + gi;
      sf_sgemm(M, P, ICG, w + gi * ICG * M, 1, M, x + ng * ICG * P, P, 1, cols, P, 1.0f, nullptr, 0, 0, true);
      #pragma omp parallel for schedule(static) if (par)
      for (int64_t oc = 0; oc < ocg; ++oc) {
        float* __restrict__ yp = y + (ng * ocg + oc) * OP;
        const float bv = bias ? bias[gi * ocg + oc] : 0.0f;
        for (int64_t i = 0; i < OP; ++i) yp[i] = bv;
        for (int64_t kh = 0; kh < g.KH; ++kh) {
          // the input rows [h0, h1) whose tap kh lands inside: 0 <= ih*SH + ro < OH
          const int64_t ro = kh * g.DH - g.PT;
          int64_t h0, h1;
          sf_inside(ro, g.SH, g.OH, g.H, h0, h1);
          // tap kw lands the input columns [w0, w1) on output columns iw*SW + co
          auto cols_of = [&](int64_t kw, int64_t& w0, int64_t& w1, int64_t& co) {
            co = kw * g.DW - g.PL;
            sf_inside(co, g.SW, g.OW, g.W, w0, w1);
          };
          auto add = [&](float* __restrict__ yr, const float* __restrict__ cr, int64_t i0, int64_t i1) {
            if (g.SW == 1) { for (int64_t iw = i0; iw < i1; ++iw) yr[iw] += cr[iw]; }
            else { for (int64_t iw = i0; iw < i1; ++iw) yr[iw * g.SW] += cr[iw]; }
          };
          const float* __restrict__ c = cols + (oc * g.KH + kh) * g.KW * P;
          for (int64_t kw = 0; kw < g.KW; ++kw) {
            int64_t w0, w1, co;
            cols_of(kw, w0, w1, co);
            if (g.SW == 2 && g.DW == 1 && kw + 1 < g.KW) {
              // taps kw and kw + 1 fill the even and odd columns of one range: added interleaved, in vectors
              int64_t v0, v1, co1;
              cols_of(kw + 1, v0, v1, co1);
              const int64_t a = std::max(w0, v0), b = std::min(w1, v1);
              for (int64_t ih = h0; ih < h1; ++ih) {
                float* yr = yp + (ih * g.SH + ro) * g.OW + co;
                const float* cr = c + kw * P + ih * g.W;
                if (a < b) {
                  add(yr, cr, w0, a); add(yr, cr, b, w1);
                  add(yr + 1, cr + P, v0, a); add(yr + 1, cr + P, b, v1);
                  sf_fold_pair(yr + 2 * a, cr + a, cr + P + a, b - a);
                } else {
                  add(yr, cr, w0, w1); add(yr + 1, cr + P, v0, v1);
                }
              }
              ++kw;
              continue;
            }
            for (int64_t ih = h0; ih < h1; ++ih) add(yp + (ih * g.SH + ro) * g.OW + co, c + kw * P + ih * g.W, w0, w1);
          }
        }
        if (epi) epi(ctx, n, gi * ocg + oc, gi * ocg + oc + 1, 0, OP);
      }
    }
}

// ---- Attention (ONNX Attention, float32) ----------------------------------------------------------
// softmax(c^2 Q K^T [softcapped] + bias) V per batch and query head, a block of query rows at a time: the
// scores of the block's keys by the GEMM into a [rows][keys] workspace, the rows' softmax there, then their
// output rows by a second GEMM. Keys that no row of the block may see (causal, windows, nonpad_kv_seqlen,
// a mask with fewer keys) are left out of both GEMMs. Blocks are the threads' tasks (each GEMM on one
// thread), taken dynamically: causal blocks grow with their rows.
struct SfAttn {
  int64_t B, Hq, Hk, S, L, D, Dv;
  int64_t qs[3], ks[3], vs[3], ys[3];  // element strides of (batch, head, row); a row's elements are contiguous
  float c2, cap;                       // the scale of the sums (scale_sqrt squared); softcap, 0 for none
  bool causal;
  int64_t past, left, right;           // causal offset without nonpad (past_len); windows, -1 = unbounded
  int mkind;                           // mask: 0 none, 1 float (added), 2 bool (false excludes the key)
  int64_t ms[3], mlen;                 // the mask's strides along (batch, head, row), 0 = broadcast; its key
                                       // count (its keys are contiguous)
  bool nonpad;                         // nonpad_kv_seqlen given: keys j < nonpad[b]; offset nonpad[b] - S
};

// the keys [lo, hi) row i may see before the mask's values (lo >= hi: none)
static inline void sf_attn_range(const SfAttn& a, int64_t i, int64_t off, int64_t npb, int64_t& lo, int64_t& hi) {
  lo = 0; hi = a.L;
  if (a.mkind) hi = std::min(hi, a.mlen);
  if (npb >= 0) hi = std::min(hi, npb);
  if (a.causal) hi = std::min(hi, i + off + 1);
  if (a.right >= 0) hi = std::min(hi, i + off + a.right + 1);
  if (a.left >= 0) lo = std::max(lo, i + off - a.left);
}

// one row of scores s[c0 .. c1) (key j at s[j - c0]) into probabilities, 0 outside the row's keys; the row is
// 0 where every key is excluded (the mask's values -inf included), as ONNX's reference computes; a NaN anywhere
// makes the row NaN (through the sum). Each step is its own loop, the reductions `omp simd` (vectorized).
SF_CLONES
static void sf_attn_row(float* __restrict__ s, int64_t c0, int64_t c1, int64_t lo, int64_t hi, const SfAttn& a,
                        const float* __restrict__ fm, const uint8_t* __restrict__ bm) {
  float* __restrict__ r = s - c0;
  lo = std::max(lo, c0); hi = std::min(hi, c1);
  for (int64_t j = c0; j < std::min(lo, c1); ++j) r[j] = 0.0f;
  for (int64_t j = std::max(hi, lo); j < c1; ++j) r[j] = 0.0f;
  if (lo >= hi) return;
  const float ninf = -std::numeric_limits<float>::infinity(), c2 = a.c2, cap = a.cap;
  if (cap > 0.0f) {
    const float inv = 1.0f / cap;
    for (int64_t j = lo; j < hi; ++j) r[j] = sf_tanh(r[j] * c2 * inv) * cap;
  } else {
    for (int64_t j = lo; j < hi; ++j) r[j] *= c2;
  }
  bool nan = false, keep = true;  // keep: some key is left (the mask's values are not all -inf)
  if (a.mkind == 1) {
    float bmax = ninf;
    #pragma omp simd reduction(max:bmax) reduction(|:nan)
    for (int64_t j = lo; j < hi; ++j) {
      const float b = fm[j];
      nan |= b != b;
      bmax = b > bmax ? b : bmax;
      r[j] += b;
    }
    keep = nan || bmax != ninf;
  } else if (a.mkind == 2) {
    int any = 0;
    #pragma omp simd reduction(|:any)
    for (int64_t j = lo; j < hi; ++j) {
      any |= bm[j];
      r[j] = bm[j] ? r[j] : ninf;
    }
    keep = any != 0;
  }
  if (!keep) {
    for (int64_t j = lo; j < hi; ++j) r[j] = 0.0f;
    return;
  }
  float m = ninf;
  #pragma omp simd reduction(max:m)
  for (int64_t j = lo; j < hi; ++j) m = r[j] > m ? r[j] : m;
  float sum = 0.0f;
  #pragma omp simd reduction(+:sum)
  for (int64_t j = lo; j < hi; ++j) {
    const float e = r[j] == ninf ? 0.0f : sf_exp(r[j] - m);
    r[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
  for (int64_t j = lo; j < hi; ++j) r[j] *= inv;
}

static void sf_attention(const float* q, const float* k, const float* v, const void* mask, const int64_t* nonpad,
                         float* y, const SfAttn& a) {
  if (a.B <= 0 || a.Hq <= 0 || a.S <= 0 || a.Dv <= 0) return;
  const int64_t rep = a.Hq / a.Hk;
  // rows per block: the block's scores stay near 1 MB (at most 64 rows, at least 8)
  const int64_t R = std::max<int64_t>(8, std::min<int64_t>(64, 262144 / std::max<int64_t>(a.L, 1)));
  const int64_t nblk = (a.S + R - 1) / R, tasks = a.B * a.Hq * nblk;
  const int nt = (double)a.B * a.Hq * a.S * a.L * (a.D + a.Dv) >= 262144.0 ? sf_max_threads() : 1;
  const float* fm = a.mkind == 1 ? static_cast<const float*>(mask) : nullptr;
  const uint8_t* bm = a.mkind == 2 ? static_cast<const uint8_t*>(mask) : nullptr;
  #pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t blk = t % nblk, h = (t / nblk) % a.Hq, b = t / (nblk * a.Hq), hk = h / rep;
    const int64_t i0 = blk * R, rows = std::min(R, a.S - i0);
    const int64_t npb = a.nonpad ? nonpad[b] : -1;
    const int64_t off = a.nonpad && a.past == 0 ? npb - a.S : a.past;
    float* yb = y + b * a.ys[0] + h * a.ys[1] + i0 * a.ys[2];
    // the keys [c0, c1) some row of the block may see
    int64_t c0 = a.L, c1 = 0;
    for (int64_t i = i0; i < i0 + rows; ++i) {
      int64_t lo, hi;
      sf_attn_range(a, i, off, npb, lo, hi);
      if (lo < hi) { c0 = std::min(c0, lo); c1 = std::max(c1, hi); }
    }
    if (c0 >= c1) {  // no row sees a key: the block's output is 0
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < a.Dv; ++e) yb[r * a.ys[2] + e] = 0.0f;
      continue;
    }
    const int64_t n = c1 - c0;
    float* sc = static_cast<float*>(sf_workspace(0, sizeof(float) * rows * n));
    const float* qb = q + b * a.qs[0] + h * a.qs[1] + i0 * a.qs[2];
    const float* kb = k + b * a.ks[0] + hk * a.ks[1] + c0 * a.ks[2];
    const float* vb = v + b * a.vs[0] + hk * a.vs[1] + c0 * a.vs[2];
    sf_sgemm(rows, n, a.D, qb, a.qs[2], 1, kb, 1, a.ks[2], sc, n, 1.0f, nullptr, 0, 0, false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      int64_t lo, hi;
      sf_attn_range(a, i, off, npb, lo, hi);
      const int64_t mo = b * a.ms[0] + h * a.ms[1] + i * a.ms[2];
      sf_attn_row(sc + r * n, c0, c1, lo, hi, a, fm ? fm + mo : nullptr, bm ? bm + mo : nullptr);
    }
    sf_sgemm(rows, a.Dv, n, sc, n, 1, vb, a.vs[2], 1, yb, a.ys[2], 1.0f, nullptr, 0, 0, false);
  }
}

// ---- Winograd convolution: F(m x m, 3 x 3) (WinogradConv, passes/prepack.py) ------------------------
// A 3x3, stride-1 conv computes each m x m tile of its output from an (m+2) x (m+2) tile d of its input
// as A^T [ sum_c (G w G^T) .* (B^T d B) ] A (Lavin and Gray): (m+2)^2 products per tile and channel pair
// instead of 9 m^2. The weights' side U = G w G^T is made at compile time; per image the kernel
// transforms the input tiles, V[xi][t][c] = (B^T d_{t,c} B)[xi], runs one GEMM per position xi,
// M[xi][t][oc] = V[xi] @ U[xi] (the prepacked GEMM: tiles as rows, U[xi] as panels [C][OC]), and
// transforms M back into the output tiles, adding the bias (or the epilogue, epi, finishes them).
// Rows of tiles go in chunks (V and M of a chunk stay in the caches); threads take whole chunks when
// there are enough of them, else they share each step of one chunk (lanes of 8 channels, the GEMMs).
template <int M> struct SfWino;
template <> struct SfWino<2> {  // interpolation points 0, 1, -1 and infinity
  static constexpr int A = 4;
  template <class V> static inline void in(const V* d, V* r) {  // r = B^T d
    r[0] = d[0] - d[2]; r[1] = d[1] + d[2]; r[2] = d[2] - d[1]; r[3] = d[1] - d[3];
  }
  template <class V> static inline void out(const V* s, V* o) {  // o = A^T s
    o[0] = s[0] + s[1] + s[2]; o[1] = s[1] - s[2] - s[3];
  }
};
template <> struct SfWino<4> {  // points 0, 1, -1, 2, -2 and infinity
  static constexpr int A = 6;
  template <class V> static inline void in(const V* d, V* r) {
    const V a = d[4] - 4.0f * d[2], b = d[3] - 4.0f * d[1], c = d[4] - d[2], e = 2.0f * (d[3] - d[1]);
    r[0] = 4.0f * d[0] - 5.0f * d[2] + d[4]; r[1] = a + b; r[2] = a - b; r[3] = c + e; r[4] = c - e;
    r[5] = 4.0f * d[1] - 5.0f * d[3] + d[5];
  }
  template <class V> static inline void out(const V* s, V* o) {
    const V a = s[1] + s[2], b = s[1] - s[2], c = s[3] + s[4], e = s[3] - s[4];
    o[0] = s[0] + a + c; o[1] = b + 2.0f * e; o[2] = a + 4.0f * c; o[3] = b + 8.0f * e + s[5];
  }
};

typedef float SfV8 __attribute__((vector_size(32)));  // 8 channels, one per lane
typedef int SfI8 __attribute__((vector_size(32)));
#if defined(__clang__)
#define SF_SHUF8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define SF_SHUF8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shuffle(a, b, SfI8{i0, i1, i2, i3, i4, i5, i6, i7})
#endif

// r[j][l] = the old r[l][j]: an 8 x 8 transposition in registers (unpack, shuffle, swap of halves)
__attribute__((always_inline)) static inline void sf_tr8(SfV8 (&r)[8]) {
  SfV8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = SF_SHUF8(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = SF_SHUF8(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = SF_SHUF8(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 1] = SF_SHUF8(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[i + 2] = SF_SHUF8(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 3] = SF_SHUF8(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = SF_SHUF8(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = SF_SHUF8(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// floats a padded image for sf_wino_in_body has past its end (it loads 8 columns from a tile's first)
constexpr int64_t SF_WINO_SLACK = 8;

// V[xi][t - t0][c] (row stride C, xi stride (t1 - t0) * C) for the tiles [t0, t1) and channels [c0, c1)
// of the padded image xp ([C][Hp][Wp] + SF_WINO_SLACK; tile t = (th, tw) reads rows th*m.. and columns
// tw*m..): per tile and 8 channels, each row of the tile is 8 loads of 8 floats transposed into
// vectors of one column's 8 channels
template <int M>
__attribute__((always_inline)) static inline void sf_wino_in_body(const float* __restrict__ xp, int64_t Hp, int64_t Wp,
                                                                   int64_t C, int64_t TW, int64_t t0, int64_t t1,
                                                                   int64_t c0, int64_t c1, float* __restrict__ V) {
  constexpr int A = SfWino<M>::A;
  const int64_t plane = Hp * Wp, xs = (t1 - t0) * C;
  for (int64_t c = c0; c < c1; c += 8) {
    const int nl = (int)std::min<int64_t>(8, c1 - c);
    for (int64_t t = t0; t < t1; ++t) {
      const float* src = xp + c * plane + (t / TW) * M * Wp + (t % TW) * M;
      SfV8 d[A][A], r[A][A], col[A], rc[A];
      for (int i = 0; i < A; ++i) {
        SfV8 rows[8];
        for (int l = 0; l < 8; ++l) {
          if (l < nl) std::memcpy(&rows[l], src + l * plane + i * Wp, sizeof(SfV8));
          else rows[l] = SfV8{};
        }
        sf_tr8(rows);
        for (int j = 0; j < A; ++j) d[i][j] = rows[j];
      }
      for (int j = 0; j < A; ++j) {  // columns: r[.][j] = B^T d[.][j]
        for (int i = 0; i < A; ++i) col[i] = d[i][j];
        SfWino<M>::in(col, rc);
        for (int i = 0; i < A; ++i) r[i][j] = rc[i];
      }
      float* dst = V + (t - t0) * C + c;
      for (int i = 0; i < A; ++i) {  // rows: (r B)[i] = B^T r[i]^T
        SfWino<M>::in(r[i], rc);
        for (int j = 0; j < A; ++j) {
          float* o = dst + (i * A + j) * xs;
          if (nl == 8) std::memcpy(o, &rc[j], sizeof(SfV8));
          else for (int l = 0; l < nl; ++l) o[l] = rc[j][l];
        }
      }
    }
  }
}

// The output tiles [t0, t1) for the channels [o0, o1) from Mt[xi][t - t0][oc] (row stride OC), + bias,
// + res (optional, laid out as y), then clamped
template <int M>
__attribute__((always_inline)) static inline void sf_wino_out_body(const float* __restrict__ Mt, int64_t OC, int64_t TW,
                                                                    int64_t OH, int64_t OW, int64_t t0, int64_t t1,
                                                                    int64_t o0, int64_t o1, const float* bias,
                                                                    float* __restrict__ y,
                                                                    const float* __restrict__ res, SfClamp clamp) {
  constexpr int A = SfWino<M>::A;
  const int64_t xs = (t1 - t0) * OC, P = OH * OW;
  for (int64_t oc = o0; oc < o1; oc += 8) {
    const int nl = (int)std::min<int64_t>(8, o1 - oc);
    SfV8 b = {};
    if (bias) for (int l = 0; l < nl; ++l) b[l] = bias[oc + l];
    for (int64_t t = t0; t < t1; ++t) {
      const float* src = Mt + (t - t0) * OC + oc;
      SfV8 s[A][A], r[M][A], col[A], rc[M];
      for (int i = 0; i < A; ++i)
        for (int j = 0; j < A; ++j) {
          if (nl == 8) std::memcpy(&s[i][j], src + (i * A + j) * xs, sizeof(SfV8));
          else { SfV8 v = {}; for (int l = 0; l < nl; ++l) v[l] = src[(i * A + j) * xs + l]; s[i][j] = v; }
        }
      for (int j = 0; j < A; ++j) {
        for (int i = 0; i < A; ++i) col[i] = s[i][j];
        SfWino<M>::out(col, rc);
        for (int i = 0; i < M; ++i) r[i][j] = rc[i];
      }
      const int64_t oh0 = (t / TW) * M, ow0 = (t % TW) * M;
      const int mh = (int)std::min<int64_t>(M, OH - oh0), mw = (int)std::min<int64_t>(M, OW - ow0);
      const int64_t at = oc * P + oh0 * OW + ow0;
      for (int i = 0; i < mh; ++i) {
        SfWino<M>::out(r[i], rc);
        for (int j = 0; j < mw; ++j) {
          SfV8 v = rc[j] + b;
          if (res) for (int l = 0; l < nl; ++l) v[l] += res[at + l * P + i * OW + j];
          if (clamp.on) {  // a NaN stays NaN (the comparisons are false)
            const SfV8 lo = clamp.lo - SfV8{}, hi = clamp.hi - SfV8{};
            v = v < lo ? lo : v;
            v = hi < v ? hi : v;
          }
          for (int l = 0; l < nl; ++l) y[at + l * P + i * OW + j] = v[l];
        }
      }
    }
  }
}

template <int M>
static void sf_wino_in_generic(const float* xp, int64_t Hp, int64_t Wp, int64_t C, int64_t TW, int64_t t0, int64_t t1,
                               int64_t c0, int64_t c1, float* V) {
  sf_wino_in_body<M>(xp, Hp, Wp, C, TW, t0, t1, c0, c1, V);
}
template <int M>
static void sf_wino_out_generic(const float* Mt, int64_t OC, int64_t TW, int64_t OH, int64_t OW, int64_t t0,
                                int64_t t1, int64_t o0, int64_t o1, const float* bias, float* y, const float* res,
                                SfClamp clamp) {
  sf_wino_out_body<M>(Mt, OC, TW, OH, OW, t0, t1, o0, o1, bias, y, res, clamp);
}
#if defined(__x86_64__)
template <int M>
__attribute__((target("avx2,fma")))
static void sf_wino_in_avx2(const float* xp, int64_t Hp, int64_t Wp, int64_t C, int64_t TW, int64_t t0, int64_t t1,
                            int64_t c0, int64_t c1, float* V) {
  sf_wino_in_body<M>(xp, Hp, Wp, C, TW, t0, t1, c0, c1, V);
}
template <int M>
__attribute__((target("avx2,fma")))
static void sf_wino_out_avx2(const float* Mt, int64_t OC, int64_t TW, int64_t OH, int64_t OW, int64_t t0, int64_t t1,
                             int64_t o0, int64_t o1, const float* bias, float* y, const float* res,
                             SfClamp clamp) {
  sf_wino_out_body<M>(Mt, OC, TW, OH, OW, t0, t1, o0, o1, bias, y, res, clamp);
}
#endif

// y[n] = conv3x3(x[n], w) + bias for n < nimg (x: [nimg, C, H, W], y: [nimg, OC, OH, OW], stride 1, pads
// g.PT/g.PL at the start), from U = [A*A][ceil(OC / SF_PANEL)][C][SF_PANEL] (the weights' transform, its
// [C][OC] matrix per position in GEMM panels); epi, res and clamp as in sf_conv2d (res and clamp applied by
// the output transform)
template <int M>
static void sf_conv2d_winograd(const float* x, const float* U, const float* bias, float* y, const SfConvGeom& g,
                               int64_t nimg, int64_t OC, SfConvEpi epi = nullptr, const void* ctx = nullptr,
                               const float* res = nullptr, SfClamp clamp = {}) {
  constexpr int A = SfWino<M>::A, A2 = A * A;
  auto in = sf_wino_in_generic<M>;
  auto out = sf_wino_out_generic<M>;
#if defined(__x86_64__)
  if (sf_avx2_helpers()) { in = sf_wino_in_avx2<M>; out = sf_wino_out_avx2<M>; }
#endif
  const int64_t C = g.C, OH = g.OH, OW = g.OW, P = OH * OW;
  if (nimg <= 0 || OC <= 0 || P <= 0) return;
  // the padded image holds whole tiles: Hp >= OH + 2 = H + PT + PB (and Wp likewise), so the input fits at (PT, PL)
  const int64_t TH = (OH + M - 1) / M, TW = (OW + M - 1) / M, Hp = TH * M + 2, Wp = TW * M + 2;
  const int64_t upos = (OC + SF_PANEL - 1) / SF_PANEL * SF_PANEL * C;  // floats of U per position
  const int nt = sf_max_threads();
  const bool par = nt > 1 && (double)nimg * P * OC * C * 9 >= SF_CONV_PAR_WORK;
  // chunks of an image's T tiles (row-major), equal sized: V and M of a chunk within about 512 KiB, and
  // with threads a multiple of their count per image (whole rows of tiles instead, 7 chunks of 2 rows
  // at 56x56 on 2 threads, left one thread idle an eighth of the time: measured on Zen 3, 3x3 64->64
  // at 56x56 5-6% faster split evenly, at 28x28 4-9%, rfcs/0002)
  const int64_t T = TH * TW, tmax = std::max<int64_t>(1, 131072 / (A2 * (C + OC)));
  int64_t nch = (T + tmax - 1) / tmax;
  if (par) nch = std::min(T, (nch + nt - 1) / nt * nt);
  const int64_t nwork = nimg * nch, R = (T + nch - 1) / nch;  // R: the most tiles of a chunk
  auto tile0 = [T, nch](int64_t k) { return T * k / nch; };  // chunk k holds tiles [tile0(k), tile0(k + 1))
  const bool whole = !par || nwork >= 2 * nt;  // threads take whole chunks
  float* xpad = static_cast<float*>(sf_workspace(3, sizeof(float) * (nimg * C * Hp * Wp + SF_WINO_SLACK)));
  const int64_t vsz = A2 * R * C, msz = A2 * R * OC;
  float* shared = whole ? nullptr : static_cast<float*>(sf_workspace(4, sizeof(float) * (vsz + msz)));
  // the epilogue of image n's output channels [o0, o1) over the pixels of tiles [t0, t1): one call per
  // run of whole tile rows, one per pixel row of a partial one
  auto finish = [&](int64_t n, int64_t o0, int64_t o1, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1;) {
      const int64_t th = t / TW, tw = t % TW, oh0 = th * M, oh1 = std::min(OH, oh0 + M);
      if (tw == 0 && t1 - t >= TW) {
        const int64_t rows = (t1 - t) / TW;
        epi(ctx, n, o0, o1, oh0 * OW, std::min(OH, (th + rows) * M) * OW);
        t += rows * TW;
      } else {
        const int64_t tw1 = std::min(TW, tw + (t1 - t)), w0 = tw * M, w1 = std::min(OW, tw1 * M);
        for (int64_t oh = oh0; oh < oh1; ++oh) epi(ctx, n, o0, o1, oh * OW + w0, oh * OW + w1);
        t += tw1 - tw;
      }
    }
  };
  auto gemms = [&](int64_t tb, const float* V, float* Mt, int64_t x0, int64_t x1) {
    for (int64_t xi = x0; xi < x1; ++xi)
      sf_sgemm_prepacked(tb, OC, C, V + xi * tb * C, C, 1, U + xi * upos, Mt + xi * tb * OC, OC, 1.0f, nullptr, 0, 0,
                         false);
  };
  #pragma omp parallel num_threads(nt) if (par)
  {
    #pragma omp for schedule(static)
    for (int64_t pl = 0; pl < nimg * C; ++pl) sf_pad_plane(x + pl * g.H * g.W, g.H, g.W, g.PT, g.PL, Hp, Wp, xpad + pl * Hp * Wp);
    if (whole) {
      float* V = static_cast<float*>(sf_workspace(4, sizeof(float) * (vsz + msz)));
      float* Mt = V + vsz;
      #pragma omp for schedule(static)
      for (int64_t wk = 0; wk < nwork; ++wk) {
        const int64_t n = wk / nch, t0 = tile0(wk % nch), t1 = tile0(wk % nch + 1), tb = t1 - t0;
        in(xpad + n * C * Hp * Wp, Hp, Wp, C, TW, t0, t1, 0, C, V);
        gemms(tb, V, Mt, 0, A2);
        float* yn = y + n * OC * P;
        out(Mt, OC, TW, OH, OW, t0, t1, 0, OC, epi ? nullptr : bias, yn, res ? res + n * OC * P : nullptr, clamp);
        if (epi) finish(n, 0, OC, t0, t1);
      }
    } else {
      float* V = shared;
      float* Mt = V + vsz;
      const int64_t ncb = (C + 7) / 8, nob = (OC + 7) / 8;
      for (int64_t wk = 0; wk < nwork; ++wk) {
        const int64_t n = wk / nch, t0 = tile0(wk % nch), t1 = tile0(wk % nch + 1), tb = t1 - t0;
        #pragma omp for schedule(static)
        for (int64_t cb = 0; cb < ncb; ++cb) in(xpad + n * C * Hp * Wp, Hp, Wp, C, TW, t0, t1, 8 * cb, std::min(C, 8 * cb + 8), V);
        #pragma omp for schedule(static)
        for (int64_t xi = 0; xi < A2; ++xi) gemms(tb, V, Mt, xi, xi + 1);
        float* yn = y + n * OC * P;
        #pragma omp for schedule(static)
        for (int64_t ob = 0; ob < nob; ++ob) {
          const int64_t o0 = 8 * ob, o1 = std::min(OC, o0 + 8);
          out(Mt, OC, TW, OH, OW, t0, t1, o0, o1, epi ? nullptr : bias, yn, res ? res + n * OC * P : nullptr, clamp);
          if (epi) finish(n, o0, o1, t0, t1);
        }
      }
    }
  }
}

// Batched GEMM over nb broadcast batch dims (extents bshape, element strides astr/bstr/cstr; 0 = broadcast)
static void sf_sgemm_batched(int nb, const int64_t* bshape, const int64_t* astr, const int64_t* bstr,
                             const int64_t* cstr, int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa,
                             int64_t csa, const float* B, int64_t rsb, int64_t csb, float* C, int64_t ldc, float alpha,
                             const float* bias, int64_t rbs, int64_t cbs) {
  int64_t batch = 1;
  for (int d = 0; d < nb; ++d) batch *= bshape[d];
  if (batch == 0) return;
  auto offsets = [&](int64_t b, int64_t& ao, int64_t& bo, int64_t& co) {
    ao = bo = co = 0;
    for (int d = nb - 1; d >= 0; --d) {
      const int64_t i = b % bshape[d];
      b /= bshape[d];
      ao += i * astr[d]; bo += i * bstr[d]; co += i * cstr[d];
    }
  };
  const int nt = sf_max_threads();
  if (batch > 1 && nt > 1 && batch >= nt && (double)M * N * K <= 4194304.0) {
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < batch; ++b) {
      int64_t ao, bo, co;
      offsets(b, ao, bo, co);
      sf_sgemm(M, N, K, A + ao, rsa, csa, B + bo, rsb, csb, C + co, ldc, alpha, bias, rbs, cbs, false);
    }
  } else {
    for (int64_t b = 0; b < batch; ++b) {
      int64_t ao, bo, co;
      offsets(b, ao, bo, co);
      sf_sgemm(M, N, K, A + ao, rsa, csa, B + bo, rsb, csb, C + co, ldc, alpha, bias, rbs, cbs, true);
    }
  }
}

}  // namespace
""".replace("@PANEL@", str(PANEL))


def _prod(xs) -> int:
    return int(math.prod(xs))


def _args(op) -> list[str]:
    lines = []
    for k, t in enumerate(op.inputs):
        lines.append(f"  const float* __restrict__ in{k} = static_cast<const float*>(inputs[{k}]);")
    lines.append("  float* __restrict__ out0 = static_cast<float*>(outputs[0]);")
    return lines


def _all_f32(op) -> bool:
    return all(t.dtype == "float32" for t in list(op.inputs) + list(op.outputs))


def _arr(xs) -> str:
    return "{" + ", ".join(str(int(x)) for x in xs) + "}" if xs else "{0}"


def _matmul(op) -> str | None:
    a, b = op.inputs[0].shape, op.inputs[1].shape
    out = op.outputs[0].shape
    if len(a) == 0 or len(b) == 0:
        return None
    K = a[-1]
    M = a[-2] if len(a) >= 2 else 1
    N = b[-1] if len(b) >= 2 else 1
    nb = len(out) - (len(a) >= 2) - (len(b) >= 2)
    batch = tuple(out[:nb])
    a_batch, b_batch = tuple(a[:-2]), tuple(b[:-2])
    lines = _args(op)
    rsa, csa = K, 1
    rsb, csb = (N, 1) if len(b) >= 2 else (1, 1)
    if not b_batch and len(a) >= 2 and a_batch:
        # B is a plain matrix: fold A's batch dims into M (one big GEMM)
        Mt = _prod(a_batch) * M
        lines.append(f"  // MatMul: [{Mt}, {K}] @ [{K}, {N}] (batch dims of A folded into M)")
        lines.append(f"  sf_sgemm({Mt}, {N}, {K}, in0, {rsa}, {csa}, in1, {rsb}, {csb}, out0, {N}, 1.0f, nullptr, 0, 0, true);")
        return "\n".join(lines)

    def bstrides(shape, mat):
        # element strides of each output batch dim in an operand with batch dims `shape` (0 = broadcast)
        full = list(shape) + list(mat)
        st, acc = [], 1
        for d in reversed(full):
            st.append(acc)
            acc *= d
        st = list(reversed(st))[: len(shape)]
        res = []
        off = nb - len(shape)
        for d in range(nb):
            if d < off:
                res.append(0)
            else:
                res.append(0 if shape[d - off] == 1 and batch[d] != 1 else st[d - off])
        return res
    a_mat = a[-2:] if len(a) >= 2 else a[-1:]
    b_mat = b[-2:] if len(b) >= 2 else b[-1:]
    astr = bstrides(a_batch, a_mat)
    bstr = bstrides(b_batch, b_mat)
    cst, acc = [], M * N
    for d in reversed(batch):
        cst.append(acc)
        acc *= d
    cstr = list(reversed(cst))
    lines.append(f"  // MatMul: batch {list(batch)} of [{M}, {K}] @ [{K}, {N}]")
    if nb == 0:
        lines.append(f"  sf_sgemm({M}, {N}, {K}, in0, {rsa}, {csa}, in1, {rsb}, {csb}, out0, {N}, 1.0f, nullptr, 0, 0, true);")
    else:
        lines.append(f"  static const int64_t bshape[] = {_arr(batch)}, astr[] = {_arr(astr)}, bstr[] = {_arr(bstr)}, "
                     f"cstr[] = {_arr(cstr)};")
        lines.append(f"  sf_sgemm_batched({nb}, bshape, astr, bstr, cstr, {M}, {N}, {K}, in0, {rsa}, {csa}, in1, {rsb}, "
                     f"{csb}, out0, {N}, 1.0f, nullptr, 0, 0);")
    return "\n".join(lines)


def _einsum(op) -> str | None:
    """A two-operand Einsum that is a (batched) matrix product: every label is a batch label (both
    operands and the output), the one row label (A and the output), the one column label (B and the
    output; either may be absent) or the one contracted label (both operands, not the output), with
    the row or the column label last in the output. It runs as ``sf_sgemm_batched`` with each
    operand read in place through its labels' strides (a transposed operand is just other strides);
    the output's matrix is written row by row, or transposed (``C^T = B^T A^T``) when the row label
    is the last. Other equations (several labels of a kind, a label summed within one operand,
    repeated or broadcast labels) keep the generic nest, which sums one output element at a time
    ("bij,bjk->bik" at 8 x 128 x 64 x 128: 3.8 ms against onnxruntime's 0.19)."""
    from ..ops.linalg import parse_einsum

    if len(op.inputs) != 2:
        return None
    x0, x1 = op.inputs
    (la, lb), out, ext, _ = parse_einsum(op.attrs["equation"], [x0.shape, x1.shape], op.name)
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(out)) != len(out) or not out:
        return None
    if any(ext[lab] != e for labs, t in ((la, x0), (lb, x1)) for lab, e in zip(labs, t.shape)):
        return None  # a broadcast (extent-1) dim

    def strides(labs, shape):
        st, acc = {}, 1
        for lab, e in zip(reversed(labs), reversed(shape)):
            st[lab] = acc
            acc *= e
        return st
    sa, sb, so = strides(la, x0.shape), strides(lb, x1.shape), strides(out, op.outputs[0].shape)
    batch = [lab for lab in out if lab in sa and lab in sb]
    rows = [lab for lab in out if lab in sa and lab not in sb]
    cols = [lab for lab in out if lab in sb and lab not in sa]
    red = [lab for lab in la if lab in sb and lab not in out]
    if len(rows) > 1 or len(cols) > 1 or len(red) != 1 or set(la) | set(lb) != set(out) | set(red):
        return None
    m, n, k = (rows or [None])[0], (cols or [None])[0], red[0]
    if n is not None and out[-1] == n:  # C = A B, rows of C at stride so[m]
        first, fs, ss, r, c = x0, sa, sb, m, n
    elif m is not None and out[-1] == m:  # C^T = B^T A^T: B's column label is C's row
        first, fs, ss, r, c = x1, sb, sa, n, m
    elif m is None and n is None:
        first, fs, ss, r, c = x0, sa, sb, None, None
    else:
        return None
    M, N, K = ext[r] if r else 1, ext[c] if c else 1, ext[k]
    ldc = so[r] if r else N
    ia, ib = (0, 1) if first is x0 else (1, 0)
    lines = _args(op)
    lines.append(f"  // Einsum {op.attrs['equation']!r}: batch {[ext[lab] for lab in batch]} of [{M}, {K}] @ [{K}, {N}]"
                 + (" (the output transposed: B^T A^T)" if first is x1 else ""))
    rsa, csa = (fs[r] if r else 0), fs[k]
    rsb, csb = ss[k], (ss[c] if c else 0)
    if not batch:
        lines.append(f"  sf_sgemm({M}, {N}, {K}, in{ia}, {rsa}, {csa}, in{ib}, {rsb}, {csb}, out0, {ldc}, 1.0f, "
                     "nullptr, 0, 0, true);")
    else:
        lines.append(f"  static const int64_t bshape[] = {_arr([ext[lab] for lab in batch])}, "
                     f"astr[] = {_arr([fs[lab] for lab in batch])}, bstr[] = {_arr([ss[lab] for lab in batch])}, "
                     f"cstr[] = {_arr([so[lab] for lab in batch])};")
        lines.append(f"  sf_sgemm_batched({len(batch)}, bshape, astr, bstr, cstr, {M}, {N}, {K}, in{ia}, {rsa}, {csa}, "
                     f"in{ib}, {rsb}, {csb}, out0, {ldc}, 1.0f, nullptr, 0, 0);")
    return "\n".join(lines)


def _gemm_bias(op, beta: float, lines: list[str]) -> tuple[str, int, int]:
    """The bias operand ``C`` (input 2, broadcasting to ``[M, N]``) of a GEMM as the template's
    ``(pointer, row stride, column stride)``; ``beta != 1`` scales it once into a temporary."""
    cs = op.inputs[2].shape
    full = (1,) * (2 - len(cs)) + tuple(cs)
    rbs = 0 if full[0] == 1 else full[1]
    cbs = 0 if full[1] == 1 else 1
    if beta == 1:
        return "in2", rbs, cbs
    n = _prod(cs)
    lines.append(f"  float* __restrict__ cb_ = static_cast<float*>(sf_workspace(0, {max(n, 1) * 4}));")
    lines.append(f"  for (int64_t i = 0; i < {n}; ++i) cb_[i] = {_flt(beta)} * in2[i];")
    return "cb_", rbs, cbs


def _gemm(op) -> str | None:
    ta, tb = bool(op.attrs.get("trans_a", False)), bool(op.attrs.get("trans_b", False))
    alpha, beta = float(op.attrs.get("alpha", 1.0)), float(op.attrs.get("beta", 1.0))
    a = op.inputs[0].shape
    M, N = op.outputs[0].shape
    K = a[0] if ta else a[1]
    rsa, csa = (1, M) if ta else (K, 1)
    rsb, csb = (1, K) if tb else (N, 1)
    lines = _args(op)
    has_c = len(op.inputs) > 2 and beta != 0
    bias, rbs, cbs = _gemm_bias(op, beta, lines) if has_c else ("nullptr", 0, 0)
    lines.append(f"  // Gemm: {_flt(alpha)} * [{M}, {K}]{'ᵀ' if ta else ''} @ [{K}, {N}]{'ᵀ' if tb else ''}"
                 + (f" + {_flt(beta)} * C{list(op.inputs[2].shape)}" if has_c else ""))
    lines.append(f"  sf_sgemm({M}, {N}, {K}, in0, {rsa}, {csa}, in1, {rsb}, {csb}, out0, {N}, {_flt(alpha)}, {bias}, "
                 f"{rbs}, {cbs}, true);")
    return "\n".join(lines)


def _packed_matmul(op) -> str | None:
    """PackedMatMul: ``a`` with its leading dims folded into M, times the weight packed at compile
    time (``passes/prepack.py``), plus Gemm's bias."""
    a = op.inputs[0].shape
    K, N = a[-1], int(op.attrs["n"])
    M = _prod(a[:-1])
    alpha, beta = float(op.attrs.get("alpha", 1.0)), float(op.attrs.get("beta", 1.0))
    lines = _args(op)
    bias, rbs, cbs = "nullptr", 0, 0
    if len(op.inputs) > 2 and beta != 0:
        cs = op.inputs[2].shape
        if len(cs) > 2 or (len(cs) == 2 and len(a) != 2):
            return None  # a bias over more than one matrix of rows: the generic lowering
        bias, rbs, cbs = _gemm_bias(op, beta, lines)
    lines.append(f"  // PackedMatMul: {_flt(alpha)} * [{M}, {K}] @ [{K}, {N}] (packed)"
                 + (f" + {_flt(beta)} * C{list(op.inputs[2].shape)}" if bias != "nullptr" else ""))
    lines.append(f"  sf_sgemm_prepacked({M}, {N}, {K}, in0, {K}, 1, in1, out0, {N}, {_flt(alpha)}, {bias}, {rbs}, "
                 f"{cbs}, true);")
    return "\n".join(lines)


def _flt(v: float) -> str:
    return literal(v, "float32")


def _conv3d(op) -> str | None:
    """Conv over 3 spatial dims through :func:`sf_conv3d` (im2col slabs and the GEMM); no fused ops."""
    x, w, out = op.inputs[0].shape, op.inputs[1].shape, op.outputs[0].shape
    g = int(op.attrs.get("group", 1))
    oc, icg = w[0], w[1]
    strides = tuple(op.attrs.get("strides") or (1, 1, 1))
    dil = tuple(op.attrs.get("dilations") or (1, 1, 1))
    pads = tuple(op.attrs.get("pads") or (0,) * 6)
    geom = (icg, *x[2:], *w[2:], *strides, *dil, *pads[:3], *out[2:])
    lines = _args(op)
    lines.append(f"  // Conv 3-D: {x[0]} images, {g} group(s) of [{oc // g}, {icg * _prod(w[2:])}] @ im2col "
                 f"[{icg * _prod(w[2:])}, {_prod(out[2:])}] (kernel {list(w[2:])}, strides {list(strides)}, "
                 f"dilations {list(dil)}, pads {list(pads)})")
    lines.append(f"  static const SfConv3Geom geom = {_arr(geom)};")
    bias = "in2" if len(op.inputs) > 2 else "nullptr"
    lines.append(f"  sf_conv3d(in0, in1, {bias}, out0, geom, {x[0]}, {g}, {oc // g});")
    return "\n".join(lines)


def _conv_io(op, fused) -> tuple[dict[int, int], str, str, str | None]:
    """``(index, x, w, bias)``: the kernel's names of a conv's input, weight and bias (``None`` without
    one), arguments of ``op``'s own kernel or of ``fused``'s (``index``: tensor id -> argument)."""
    index = {id(t): k for k, t in enumerate((fused or op).inputs)}
    x, w = f"in{index[id(op.inputs[0])]}", f"in{index[id(op.inputs[1])]}"
    return index, x, w, f"in{index[id(op.inputs[2])]}" if len(op.inputs) > 2 else None


def _conv(op, fused=None) -> str | None:
    """Conv over 1 or 2 spatial dims through :func:`sf_conv2d`; with ``fused`` (a fused op whose first
    member is ``op``, the others element-wise ops on its output), the kernel of the whole group: its
    tiles are finished by the bias and those ops (:func:`_conv_epilogue`)."""
    x = op.inputs[0].shape
    n_sp = len(x) - 2
    if n_sp == 3 and op.op_type == "Conv" and fused is None:
        return _conv3d(op)
    if n_sp not in (1, 2):
        return None
    g = int(op.attrs.get("group", 1))
    packed = op.op_type == "PackedConv"  # weights in GEMM panels: sf_conv2d_packed
    wino = int(op.attrs["m"]) if op.op_type == "WinogradConv" else 0  # sf_conv2d_winograd<m>
    if packed:
        oc, icg, kern = int(op.attrs["oc"]), x[1], tuple(int(k) for k in op.attrs["kernel"])
    elif wino:
        if n_sp != 2:
            return None
        oc, icg, kern = int(op.attrs["oc"]), x[1], (3, 3)
    else:
        w = op.inputs[1].shape
        oc, icg, kern = w[0], w[1], tuple(w[2:])
    ocg = oc // g
    depthwise = not packed and not wino and icg == 1 and g == x[1]  # sf_conv_depthwise
    if (icg * _prod(kern) < 4 or ocg < 4) and not depthwise:
        return None  # thin groups that are not depthwise: the generic nest
    strides = tuple(op.attrs.get("strides") or (1,) * n_sp)
    dil = tuple(op.attrs.get("dilations") or (1,) * n_sp)
    pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
    out = op.outputs[0].shape
    if n_sp == 1:
        H, W, KH, KW = 1, x[2], 1, kern[0]
        SH, SW, DH, DW, PT, PL = 1, strides[0], 1, dil[0], 0, pads[0]
        OH, OW = 1, out[2]
    else:
        H, W = x[2], x[3]
        KH, KW = kern
        SH, SW = strides
        DH, DW = dil
        PT, PL = pads[0], pads[1]
        OH, OW = out[2], out[3]
    Nb = x[0]
    P = OH * OW
    KK = icg * KH * KW
    direct = KH == 1 and KW == 1 and SH == 1 and SW == 1 and PT == 0 and PL == 0 and OH == H and OW == W
    epi, finish = None, ""
    index, xin, win, bias = _conv_io(op, fused)
    bias = bias or "nullptr"
    if fused is None:
        lines = _args(op)
    else:
        simple = _kernel_finish(fused, index)
        if simple is not None and depthwise and simple[0] != "nullptr":
            simple = None  # the depthwise kernels apply a clamp only; a residual add goes to the epilogue
        if simple is not None:  # the kernels (PackedConv's transposition, Winograd's output transform) finish
            res, clamp = simple
            finish = f", nullptr, nullptr, {clamp}" if depthwise else f", nullptr, nullptr, {res}, {clamp}"
        else:
            epi = _conv_epilogue(fused, oc, OH, OW, None if bias == "nullptr" else f"{bias}[c_]")
            if epi is None:
                return None
            bias = "nullptr"
        lines = _args(fused)
    geometry = f"{KH}x{KW}, stride {SH}x{SW}, dilation {DH}x{DW}, pad {PT},{PL}"
    if depthwise:
        lines.append(f"  // depthwise Conv: {Nb} images, {g} channels, {ocg} output(s) each ({geometry})")
    elif wino:
        a = wino + 2
        lines.append(f"  // WinogradConv F({wino}x{wino}, 3x3): {Nb} images, {a * a} GEMMs [tiles, {icg}] @ [{icg}, {oc}] "
                     f"per chunk of tiles (pad {PT},{PL})")
    elif packed:
        lines.append(f"  // PackedConv: {Nb} images of [{P}, {KK}] @ [{KK}, {oc}] (weights packed), transposed; "
                     + ("1x1: the image is A" if direct else f"A = im2col of the image ({geometry})"))
    else:
        lines.append(f"  // Conv: {Nb} images, {g} group(s) of [{ocg}, {KK}] @ [{KK}, {P}]"
                     + (" (1x1: the image is B)" if direct else f", B = im2col packed from the image ({geometry})"))
    lines.append(f"  static const SfConvGeom geom = {{{icg}, {H}, {W}, {KH}, {KW}, {SH}, {SW}, {DH}, {DW}, {PT}, {PL}, "
                 f"{OH}, {OW}}};")
    direct_arg = "true" if direct else "false"
    if depthwise:
        fn, args = "sf_conv_depthwise", f"{xin}, {win}, {bias}, out0, geom, {Nb}, {g}, {ocg}"
    elif wino:
        fn, args = f"sf_conv2d_winograd<{wino}>", f"{xin}, {win}, {bias}, out0, geom, {Nb}, {oc}"
    elif packed:
        fn, args = "sf_conv2d_packed", f"{xin}, {win}, {bias}, out0, geom, {Nb}, {oc}, {direct_arg}"
    else:
        fn, args = "sf_conv2d", f"{xin}, {win}, {bias}, out0, geom, {Nb}, {g}, {ocg}, {direct_arg}"
    if finish:
        members = list(fused.members)[1:]
        lines.append("  // the tiles are finished as they are stored: bias -> "
                     + " -> ".join(f"{m.op_type}({m.attrs.get('fn') or m.attrs.get('kind')})" for m in members))
        lines.append(f"  {fn}({args}{finish});")
    elif epi is None:
        lines.append(f"  {fn}({args});")
    else:
        lines += epi
        lines.append(f"  {fn}({args}, epi_, &ctx_);")
    return "\n".join(lines)


def _conv_transpose(op, fused=None) -> str | None:
    """ConvTranspose over 1 or 2 spatial dims through :func:`sf_conv_transpose2d` (a GEMM into columns,
    then col2im); with ``fused``, element-wise ops after it finish each output plane (:func:`_conv_epilogue`).
    ``None`` (the generic nest) when a group's product is too thin for the GEMM (depthwise-like)."""
    x, w = op.inputs[0].shape, op.inputs[1].shape
    n_sp = len(x) - 2
    if n_sp not in (1, 2):
        return None
    g = int(op.attrs.get("group", 1))
    icg, ocg, kern = x[1] // g, w[1], tuple(w[2:])
    if icg < 4 or ocg * _prod(kern) < 8:
        return None
    strides = tuple(op.attrs.get("strides") or (1,) * n_sp)
    dil = tuple(op.attrs.get("dilations") or (1,) * n_sp)
    pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
    out = tuple(op.attrs["output_shape"])
    if n_sp == 1:
        geom = (icg, 1, x[2], 1, kern[0], 1, strides[0], 1, dil[0], 0, pads[0], 1, out[0])
    else:
        geom = (icg, x[2], x[3], *kern, *strides, *dil, pads[0], pads[1], *out)
    epi = None
    _, xin, win, bias = _conv_io(op, fused)
    if fused is None:
        lines = _args(op)
        bias = bias or "nullptr"
    else:
        epi = _conv_epilogue(fused, g * ocg, geom[-2], geom[-1], bias and f"{bias}[c_]")
        if epi is None:
            return None
        lines = _args(fused) + epi
        bias = "nullptr"
    lines.append(f"  // ConvTranspose: {x[0]} images, {g} group(s) of columns [{ocg * _prod(kern)}, {icg}] @ "
                 f"[{icg}, {_prod(x[2:])}], folded into [{ocg}, {'x'.join(map(str, out))}] "
                 f"(kernel {'x'.join(map(str, kern))}, strides {list(strides)}, dilations {list(dil)}, "
                 f"pads {list(pads)})")
    lines.append(f"  static const SfConvGeom geom = {_arr(geom)};")
    extra = "" if epi is None else ", epi_, &ctx_"
    lines.append(f"  sf_conv_transpose2d({xin}, {win}, {bias}, out0, geom, {x[0]}, {g}, {ocg}{extra});")
    return "\n".join(lines)


def _attention(op) -> str | None:
    """Attention (float32 Q/K/V and output; an optional float or bool mask, ``nonpad_kv_seqlen``, causal,
    windows, softcap, grouped K/V heads, 3-D or 4-D forms) through :func:`sf_attention`. The mixed-precision
    form made by FuseAttention, extra biases and the ``qk_matmul_output`` modes keep the generic nest."""
    a = op.attrs
    if a.get("acc_dtype") or a.get("probs_dtype") or a.get("qk_mode") is not None or a.get("extra_biases", 0) \
            or a.get("softmax_dtype") not in (None, "float32") or not isinstance(a.get("past_len", 0), int):
        return None
    q, k, v = op.inputs[:3]
    y = op.outputs[0]
    if any(t.dtype != "float32" for t in (q, k, v, y)):
        return None
    b_, hq, hk, s_len, l_len, d, dv = op._geometry(q, k, v)
    extra = list(op.inputs[3:])
    mask = extra.pop(0) if a.get("has_mask") else None
    nonpad = extra.pop(0) if a.get("has_nonpad") else None
    if (mask is not None and mask.dtype not in ("float32", "bool")) or (nonpad is not None and nonpad.dtype != "int64"):
        return None

    def strides(t, heads, rows, width):  # (batch, head, row) element strides of a 4-D or 3-D [B, N, H*E] tensor
        return (heads * rows * width, rows * width, width) if t.ndim == 4 else (rows * heads * width, width,
                                                                               heads * width)
    ys = strides(y, hq, s_len, dv)
    ms, mlen, mkind = (0, 0, 0), 0, 0
    if mask is not None:
        mkind = 1 if mask.dtype == "float32" else 2
        full, acc, st = (1,) * (4 - mask.ndim) + tuple(mask.shape), 1, []
        for e in reversed(full):
            st.append(0 if e == 1 else acc)
            acc *= e
        ms, mlen = tuple(reversed(st))[:3], int(mask.shape[-1])  # keys contiguous (a key dim of 1: mlen 1)
    c = np.float32(a.get("scale_sqrt", 1.0))
    lines = _args(op)
    mask_arg = "inputs[3]" if mask is not None else "nullptr"
    np_arg = f"static_cast<const int64_t*>(inputs[{3 + (mask is not None)}])" if nonpad is not None else "nullptr"
    what = (", causal" if a.get("is_causal") else "") + (", mask" if mask is not None else "")
    lines.append(f"  // Attention: {b_} x {hq} heads (K/V {hk}) of softmax([{s_len}, {d}] @ [{d}, {l_len}]) @ "
                 f"[{l_len}, {dv}]{what}")
    lines.append(f"  static const SfAttn cfg = {{{b_}, {hq}, {hk}, {s_len}, {l_len}, {d}, {dv}, "
                 f"{_arr(strides(q, hq, s_len, d))}, {_arr(strides(k, hk, l_len, d))}, "
                 f"{_arr(strides(v, hk, l_len, dv))}, {_arr(ys)}, {_flt(c * c)}, {_flt(a.get('softcap', 0.0))}, "
                 f"{'true' if a.get('is_causal') else 'false'}, {int(a.get('past_len', 0))}, "
                 f"{int(a.get('left_window', -1))}, {int(a.get('right_window', -1))}, {mkind}, {_arr(ms)}, {mlen}, "
                 f"{'true' if nonpad is not None else 'false'}}};")
    lines.append(f"  sf_attention(in0, in1, in2, {mask_arg}, {np_arg}, out0, cfg);")
    return "\n".join(lines)


def _kernel_finish(fused, index: dict[int, int]) -> tuple[str, str] | None:
    """``(residual, clamp)`` where the ops after ``fused``'s conv are those the conv kernels apply as
    they store their output (``SfFin`` in :func:`sf_conv2d`, ``PackedConv``'s transposition,
    Winograd's output transform, the depthwise kernels' stores): an Add of a tensor shaped as the
    output (``residual``: its argument, else ``"nullptr"``), then a Relu or a Clip (``clamp``: an
    ``SfClamp`` literal, ``"SfClamp{}"`` without), either optional; else ``None`` (the generic
    epilogue)."""
    members = list(fused.members)
    prev = members[0].outputs[0]
    shape = tuple(prev.shape)
    res, clamp = "nullptr", None
    for m in members[1:]:
        out = m.outputs[0]
        if clamp or len(m.outputs) != 1 or tuple(out.shape) != shape or out.dtype != "float32":
            return None  # nothing after the clamp
        if m.op_type == "Activation" and m.attrs.get("kind") == "relu" and m.inputs[0] is prev:
            clamp = (0.0, math.inf)
        elif m.op_type == "Clip" and m.inputs[0] is prev:
            lo, hi = m.attrs.get("lo"), m.attrs.get("hi")
            clamp = (-math.inf if lo is None else lo, math.inf if hi is None else hi)
        elif m.op_type == "Binary" and m.attrs.get("fn") == "add" and res == "nullptr" and len(m.inputs) == 2:
            other = [t for t in m.inputs if t is not prev]
            if len(other) != 1 or tuple(other[0].shape) != shape or other[0].dtype != "float32" \
                    or id(other[0]) not in index:
                return None
            res = f"in{index[id(other[0])]}"
        else:
            return None
        prev = out
    if clamp is None:
        return res, "SfClamp{}"
    lo, hi = (_flt(v) for v in clamp)
    return res, f"SfClamp{{true, {lo}, {hi}}}"


def _flat_plane(value, axes, shape):
    """``value`` (an epilogue member's element, over ``axes`` of a 4-D output ``shape``) with the row
    axis replaced by 0, so that the column axis runs over a channel's flat pixels; ``None`` unless the
    two axes appear only as the last two indices of reads of tensors whose last two dims are the
    output's (there the flat index is the same)."""
    from ..ir.expr import Const, TensorElement, Var
    from .lower import substitute

    h, w = axes[-2], axes[-1]
    memo: dict[int, bool] = {}

    def ok(e) -> bool:
        k = id(e)
        if k not in memo:
            if isinstance(e, Var):
                memo[k] = e is not h and e is not w
            elif isinstance(e, TensorElement) and len(e.indices) >= 2 and e.indices[-2] is h \
                    and e.indices[-1] is w and tuple(e.tensor.shape[-2:]) == tuple(shape[-2:]):
                memo[k] = all(ok(i) for i in e.indices[:-2])
            else:
                memo[k] = all(ok(c) for c in e.children())
        return memo[k]

    return substitute(value, {h: Const(0)}) if ok(value) else None


def _conv_epilogue(fused, oc: int, OH: int, OW: int, bias: str | None) -> list[str] | None:
    """C++ defining ``epi_`` and ``ctx_`` for :func:`sf_conv2d`: per element of a tile, ``v_`` = the
    conv's value (+ ``bias``), then each later member of ``fused`` as ``v_ = f(v_, other inputs)``.
    ``None`` unless every later member is element-wise in the previous one's output (read only at
    its own index) and reads the group's inputs only at output indices or constants, with nothing
    that needs lowering (no reductions)."""
    from ..ir.expr import Const, Reduce, TensorElement
    from ..ir.task import GridCompute
    from .cpp import _Printer
    from .lower import Buffer, Local, transform

    members = list(fused.members)
    shape = tuple(members[0].outputs[0].shape)
    index = {id(t): k for k, t in enumerate(fused.inputs)}
    names = ("n_", "c_", "h_", "w_") if len(shape) == 4 else ("n_", "c_", "w_")
    v = Local("v_", "float32")
    printer = _Printer(None)
    stmts: list[str] = []
    flat: list[str] | None = [] if len(shape) == 4 else None  # the statements over flat pixels w_ = j
    prev = members[0].outputs[0]
    for m in members[1:]:
        task = m.task
        if len(m.outputs) != 1 or tuple(m.outputs[0].shape) != shape or m.outputs[0].dtype != "float32" \
                or task.is_extern or len(task.outputs) != 1 or not isinstance(task.outputs[0], GridCompute):
            return None
        gc = task.outputs[0]
        axes = list(gc.axes)
        if len(axes) != len(shape):
            return None
        source = {id(ph): t for ph, t in zip(task.inputs, m.inputs)}
        ok = [True]

        def read(old, new, prev=prev, axes=axes, source=source, ok=ok):
            if isinstance(old, Reduce):
                ok[0] = False
                return None
            if not (isinstance(new, TensorElement) and id(new.tensor) in source):
                return None
            t = source[id(new.tensor)]
            if t is prev:
                if len(new.indices) != len(axes) or not all(i is a for i, a in zip(new.indices, axes)):
                    ok[0] = False
                return v
            k = index.get(id(t))
            if k is None:  # another member's output: not a plain chain
                ok[0] = False
                return None
            for i, d in zip(new.indices, t.shape):
                pos = next((p for p, a in enumerate(axes) if i is a), None)
                inside = (pos is not None and shape[pos] <= d) or \
                    (isinstance(i, Const) and isinstance(i.value, (int, np.integer)) and 0 <= int(i.value) < d)
                if not inside:
                    ok[0] = False
            return TensorElement(Buffer(f"in{k}", t.shape, t.dtype, "input", k), new.indices)

        value = transform(gc.value, read)
        if not ok[0]:
            return None
        flat_value = _flat_plane(value, axes, shape) if flat is not None else None
        if flat_value is None:
            flat = None
        for a, name in zip(axes, names):
            printer.var_names[id(a)] = name
            printer.used_names.add(name)
        try:
            stmts.append(f"v_ = {printer.expr(value, 'float32')};")
            if flat is not None:
                flat.append(f"v_ = {printer.expr(flat_value, 'float32')};")
        except Exception:  # noqa: BLE001 - anything the printer cannot print stays generic
            return None
        prev = m.outputs[0]
    P = OH * OW
    # the epilogue is a function of the file (marked for kernel_source), so that it is compiled for the
    # kernel's instruction sets too (a lambda's body would not be: SSE loops)
    lines = ["  // the conv's tiles are finished in place by: " + " -> ".join(m.op_type for m in members[1:]),
             "  const SfEpiCtx ctx_ = {inputs, outputs};",
             "  const SfConvEpi epi_ = SF_SYM_epi;",
             FILE_SCOPE_BEGIN,
             "SF_ATTR static void SF_SYM_epi(const void* p, int64_t n_, int64_t c0, int64_t c1, int64_t j0, "
             "int64_t j1) {",
             "  const void* const* inputs = static_cast<const SfEpiCtx*>(p)->in;",
             "  void* const* outputs = static_cast<const SfEpiCtx*>(p)->out;"]
    lines += _args(fused)
    if flat is not None:  # one loop over the tile's pixels of a channel (rows of OW would be short)
        lines += ["  for (int64_t c_ = c0; c_ < c1; ++c_) {",
                  f"    const float b_ = {bias or '0.0f'};",
                  f"    float* __restrict__ yr = out0 + (n_ * {oc} + c_) * {P};",
                  "    for (int64_t w_ = j0; w_ < j1; ++w_) {",
                  "      float v_ = yr[w_] + b_;"]
        lines += ["      " + st for st in flat]
        lines += ["      yr[w_] = v_;", "    }", "  }", "}", FILE_SCOPE_END]
        return lines
    lines += [f"  const int64_t h0 = j0 / {OW}, h1 = (j1 - 1) / {OW};",
              "  for (int64_t c_ = c0; c_ < c1; ++c_) {",
              f"    const float b_ = {bias or '0.0f'};",
              f"    float* __restrict__ yr = out0 + (n_ * {oc} + c_) * {P};",
              "    for (int64_t h_ = h0; h_ <= h1; ++h_) {",
              f"      const int64_t wa = h_ == h0 ? j0 - h0 * {OW} : 0, wb = h_ == h1 ? j1 - h1 * {OW} : {OW};",
              "      for (int64_t w_ = wa; w_ < wb; ++w_) {",
              f"        float v_ = yr[h_ * {OW} + w_] + b_;"]
    lines += ["        " + st for st in stmts]
    lines += [f"        yr[h_ * {OW} + w_] = v_;", "      }", "    }", "  }", "}", FILE_SCOPE_END]
    return lines


def _fused(op) -> str | None:
    """A fused group (:mod:`.fusion`) of a Conv and element-wise ops after it: the conv template with
    the ops in its epilogue (see :func:`accepts_epilogue`)."""
    members = list(getattr(op, "members", ()))
    if len(members) < 2 or not accepts_epilogue(members[0]):
        return None
    if members[0].op_type == "ConvTranspose":
        return _conv_transpose(members[0], fused=op)
    if members[0].op_type == "Resize":
        return _resize(members[0], fused=op)
    return _conv(members[0], fused=op)


def accepts_epilogue(op) -> bool:
    """Whether ``op``'s template can apply element-wise ops to its output (a float32 conv, transposed
    conv or Resize of a 3-D or 4-D tensor): a fused group of ``op`` and such ops compiles to the
    template with the ops in its epilogue."""
    return op.op_type in ("Conv", "PackedConv", "WinogradConv", "ConvTranspose", "Resize") \
        and op.inputs[0].ndim in (3, 4) and template_kind(op) == op.op_type


def accepts_group(group) -> bool:
    """Whether a fused group compiles on the cpu target: one of ops without templates, or a
    template op with the element-wise ops its template applies as its epilogue."""
    return not any(template_kind(m) for m in group.members) or template_kind(group) == "Fused"


def _pool(op) -> str | None:
    """MaxPool / AveragePool over 1 or 2 spatial dims (no indices output). Each output element
    reduces its window in a register; the windows that lie inside the input (ranges computed here)
    run a loop over output columns with the taps unrolled, which vectorizes; windows at the borders
    take only their valid taps."""
    kind = op.attrs.get("kind")
    x, y = op.inputs[0].shape, op.outputs[0].shape
    n_sp = len(x) - 2
    if kind not in ("max", "avg") or op.attrs.get("with_indices", False) or n_sp not in (1, 2) or len(op.inputs) != 1:
        return None
    kern = tuple(op.attrs["kernel"])
    strides = tuple(op.attrs.get("strides") or (1,) * n_sp)
    dil = tuple(op.attrs.get("dilations") or (1,) * n_sp)
    pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
    if n_sp == 1:
        kern, strides, dil, pads = (1,) + kern, (1,) + strides, (1,) + dil, (0, pads[0], 0, pads[1])
        H, W, OH, OW = 1, x[2], 1, y[2]
    else:
        H, W, OH, OW = x[2], x[3], y[2], y[3]
    KH, KW = kern
    SH, SW = strides
    DH, DW = dil
    PT, PL, PB, PR = pads
    planes = x[0] * x[1]
    if KH * KW > 1024:
        return None

    def taps(o, k, s, d, p, n):  # taps kk of window o whose position o*s + kk*d - p lies in [0, n)
        return [kk for kk in range(k) if 0 <= o * s + kk * d - p < n]

    kh_lo, kh_hi = [], []
    for oh in range(OH):
        v = taps(oh, KH, SH, DH, PT, H)
        kh_lo.append(v[0] if v else 0)
        kh_hi.append(v[-1] + 1 if v else 0)
    kw_lo, kw_hi = [], []
    for ow in range(OW):
        v = taps(ow, KW, SW, DW, PL, W)
        kw_lo.append(v[0] if v else 0)
        kw_hi.append(v[-1] + 1 if v else 0)
    full_w = [ow for ow in range(OW) if kw_lo[ow] == 0 and kw_hi[ow] == KW]
    # interior columns: one run [ow_a, ow_b) of windows with every tap inside (empty when none)
    ow_a, ow_b = (full_w[0], full_w[-1] + 1) if full_w else (0, 0)
    if full_w and len(full_w) != ow_b - ow_a:
        ow_a = ow_b = 0
    is_max = kind == "max"
    init = "-std::numeric_limits<float>::infinity()" if is_max else "0.0f"

    # max: maxss-shaped selects and a NaN flag (numpy propagates NaN), so nothing branches on data
    def acc(v):
        return f"m = {v} > m ? {v} : m; nan |= {v} != {v};" if is_max else f"m += {v};"
    start = f"float m = {init};" + (" int nan = 0;" if is_max else "")
    fin = "nan ? std::numeric_limits<float>::quiet_NaN() : m" if is_max else "m"
    lines = _args(op)
    lines.append(f"  // {'max' if is_max else 'average'} pool {KH}x{KW}, stride {SH}x{SW}, dilation {DH}x{DW}, pads "
                 f"{list(pads)}: {planes} planes [{H}, {W}] -> [{OH}, {OW}]; columns [{ow_a}, {ow_b}) of the full rows "
                 "have every tap inside")
    lines.append(f"  static const int32_t kh_lo[] = {_arr(kh_lo)}, kh_hi[] = {_arr(kh_hi)};")
    lines.append(f"  static const int32_t kw_lo[] = {_arr(kw_lo)}, kw_hi[] = {_arr(kw_hi)};")
    div = ""
    if not is_max:
        if op.attrs.get("count_include_pad", False):
            lo_h, hi_h, lo_w, hi_w = -PT, H + PB, -PL, W + PR
        else:
            lo_h, hi_h, lo_w, hi_w = 0, H, 0, W
        cnt_h = [sum(1 for k in range(KH) if lo_h <= oh * SH + k * DH - PT < hi_h) for oh in range(OH)]
        cnt_w = [sum(1 for k in range(KW) if lo_w <= ow * SW + k * DW - PL < hi_w) for ow in range(OW)]
        lines.append(f"  static const float cnt_h[] = {{{', '.join(f'{c}.0f' for c in cnt_h)}}};")
        lines.append(f"  static const float cnt_w[] = {{{', '.join(f'{c}.0f' for c in cnt_w)}}};")
        div = " / (cnt_h[oh] * cnt_w[ow])"
    work = planes * OH * OW * KH * KW
    cond = "sf_max_threads() > 1" if work >= (1 << 14) and planes > 1 else "false"
    if is_max and n_sp == 2 and KW in (2, 3) and SW == 2 and DW == 1 and DH == 1 and OW >= 8:
        lines.append("  if (sf_maxpool_s2_fits()) {  // AVX-512: runs of 16 outputs, even and odd columns by permutes")
        lines.append(f"    sf_maxpool_s2(in0, out0, {planes}, {H}, {W}, {OH}, {OW}, {KH}, {KW}, {SH}, {PT}, {PL}, "
                     f"{cond});")
        lines.append("    return;")
        lines.append("  }")
    lines.append(f"  #pragma omp parallel for schedule(static) if ({cond})")
    lines.append(f"  for (int64_t pl = 0; pl < {planes}; ++pl) {{")
    # small planes (rows shorter than a vector have no interior run to vectorize): copied into a buffer
    # padded with the neutral value, where every window is whole and one loop does all of them
    Hq = max(H + PT, (OH - 1) * SH + (KH - 1) * DH + 1)
    Wq = max(W + PL, (OW - 1) * SW + (KW - 1) * DW + 1)
    if OW < 16 and Hq * Wq <= 4096 and (PT or PL or Hq > H or Wq > W):
        fill = init
        lines.append(f"    alignas(64) float xq[{Hq * Wq}];  // the plane at ({PT}, {PL}) of [{Hq}, {Wq}], {fill} around")
        lines.append(f"    for (int64_t i = 0; i < {Hq * Wq}; ++i) xq[i] = {fill};")
        lines.append(f"    for (int64_t r = 0; r < {H}; ++r)")
        lines.append(f"      for (int64_t c = 0; c < {W}; ++c) xq[(r + {PT}) * {Wq} + {PL} + c] = in0[(pl * {H} + r) * {W} + c];")
        lines.append(f"    for (int64_t oh = 0; oh < {OH}; ++oh) {{")
        lines.append(f"      float* __restrict__ yr = out0 + (pl * {OH} + oh) * {OW};")
        lines.append(f"      for (int64_t ow = 0; ow < {OW}; ++ow) {{")
        lines.append(f"        {start}")
        lines.append("        #pragma GCC unroll 8")
        lines.append(f"        for (int64_t kh = 0; kh < {KH}; ++kh)")
        lines.append("          #pragma GCC unroll 8")
        lines.append(f"          for (int64_t kw = 0; kw < {KW}; ++kw) {{ const float v = "
                     f"xq[(oh * {SH} + kh * {DH}) * {Wq} + ow * {SW} + kw * {DW}]; {acc('v')} }}")
        lines.append(f"        yr[ow] = {fin}{div};")
        lines.append("      }")
        lines.append("    }")
        lines.append("  }")
        return "\n".join(lines)
    lines.append(f"    const float* __restrict__ xp = in0 + pl * {H * W};")
    if KH > 1:
        lines += _pool_separable(is_max, init, div, H, W, OH, OW, KH, KW, SH, SW, DH, DW, PT, PL, ow_a, ow_b)
        return "\n".join(lines)
    lines.append(f"    for (int64_t oh = 0; oh < {OH}; ++oh) {{")
    lines.append(f"      float* __restrict__ yr = out0 + (pl * {OH} + oh) * {OW};")
    lines.append("      auto border = [&](int64_t ow) {")
    lines.append(f"        {start}")
    lines.append("        for (int64_t kh = kh_lo[oh]; kh < kh_hi[oh]; ++kh)")
    lines.append(f"          for (int64_t kw = kw_lo[ow]; kw < kw_hi[ow]; ++kw) {{ const float v = "
                 f"xp[(oh * {SH} + kh * {DH} - {PT}) * {W} + ow * {SW} + kw * {DW} - {PL}]; {acc('v')} }}")
    lines.append(f"        yr[ow] = {fin}{div};")
    lines.append("      };")
    if ow_b > ow_a:
        lines.append(f"      if (kh_lo[oh] == 0 && kh_hi[oh] == {KH}) {{")
        lines.append(f"        const float* __restrict__ xr = xp + (oh * {SH} - {PT}) * {W} - {PL};  // tap (0, 0) of column 0")
        lines.append(f"        for (int64_t ow = 0; ow < {ow_a}; ++ow) border(ow);")
        lines.append(f"        for (int64_t ow = {ow_a}; ow < {ow_b}; ++ow) {{")
        lines.append(f"          {start}")
        lines.append(f"          for (int64_t kh = 0; kh < {KH}; ++kh)")
        lines.append(f"            for (int64_t kw = 0; kw < {KW}; ++kw) {{ const float v = "
                     f"xr[kh * {DH * W} + ow * {SW} + kw * {DW}]; {acc('v')} }}")
        lines.append(f"          yr[ow] = {fin}{div};")
        lines.append("        }")
        lines.append(f"        for (int64_t ow = {ow_b}; ow < {OW}; ++ow) border(ow);")
        lines.append("        continue;")
        lines.append("      }")
    lines.append(f"      for (int64_t ow = 0; ow < {OW}; ++ow) border(ow);")
    lines.append("    }")
    lines.append("  }")
    return "\n".join(lines)


def _pool_separable(is_max, init, div, H, W, OH, OW, KH, KW, SH, SW, DH, DW, PT, PL, ow_a, ow_b) -> list[str]:
    """The body of :func:`_pool`'s plane loop for windows of several rows: a max (or sum) is taken
    along each input row first (``hb[r][ow]``, the KW taps of column ``ow``), then down the KH rows
    of each output row, so that an input row shared by several windows (3x3 stride 2: 112 rows for
    56 x 3 windows) is reduced once, and the second pass reads contiguous rows. The max is a plain
    ``v > m ? v : m`` (a vmaxps) with a NaN flag on the side, so a NaN is kept, as numpy does;
    an average divides the window's sum by its count. Measured on Zen 3 (rfcs/0002, kernel time):
    ResNet's 3x3 stride-2 max pool at 112x112, 64 channels, 0.20 -> 0.13 ms; 3x3 stride 1 at 56x56,
    256 channels, 0.52 -> 0.20 ms."""
    red = "m = v > m ? v : m; nan |= v != v;" if is_max else "m += v;"
    start = f"float m = {init};" + (" int nan = 0;" if is_max else "")
    done = "nan ? std::numeric_limits<float>::quiet_NaN() : m" if is_max else "m"
    return [
        f"    float* __restrict__ hb = static_cast<float*>(sf_workspace(0, sizeof(float) * {H * OW}));  // [{H}][{OW}]",
        f"    for (int64_t r = 0; r < {H}; ++r) {{  // along the rows: the taps kw_lo[ow]..kw_hi[ow] of each column",
        f"      const float* __restrict__ xr = xp + r * {W};",
        f"      float* __restrict__ hr = hb + r * {OW};",
        "      auto border = [&](int64_t ow) {",
        f"        {start}",
        f"        for (int64_t kw = kw_lo[ow]; kw < kw_hi[ow]; ++kw) {{ "
        f"const float v = xr[ow * {SW} + kw * {DW} - {PL}]; {red} }}",
        f"        hr[ow] = {done};",
        "      };",
        f"      for (int64_t ow = 0; ow < {ow_a}; ++ow) border(ow);",
        f"      for (int64_t ow = {ow_a}; ow < {ow_b}; ++ow) {{",
        f"        {start}",
        "        #pragma GCC unroll 8",
        f"        for (int64_t kw = 0; kw < {KW}; ++kw) {{ const float v = xr[ow * {SW} + kw * {DW} - {PL}]; {red} }}",
        f"        hr[ow] = {done};",
        "      }",
        f"      for (int64_t ow = {max(ow_b, ow_a)}; ow < {OW}; ++ow) border(ow);",
        "    }",
        f"    for (int64_t oh = 0; oh < {OH}; ++oh) {{  // down the rows kh_lo[oh]..kh_hi[oh] of each window",
        f"      float* __restrict__ yr = out0 + (pl * {OH} + oh) * {OW};",
        f"      const int64_t r0 = oh * {SH} - {PT};  // the input row of tap kh = 0",
        f"      if (kh_lo[oh] == 0 && kh_hi[oh] == {KH}) {{",
        f"        for (int64_t ow = 0; ow < {OW}; ++ow) {{",
        f"          {start}",
        "          #pragma GCC unroll 8",
        f"          for (int64_t kh = 0; kh < {KH}; ++kh) {{ "
        f"const float v = hb[(r0 + kh * {DH}) * {OW} + ow]; {red} }}",
        f"          yr[ow] = {done}{div};",
        "        }",
        "      } else {",
        f"        for (int64_t ow = 0; ow < {OW}; ++ow) {{",
        f"          {start}",
        f"          for (int64_t kh = kh_lo[oh]; kh < kh_hi[oh]; ++kh) {{ "
        f"const float v = hb[(r0 + kh * {DH}) * {OW} + ow]; {red} }}",
        f"          yr[ow] = {done}{div};",
        "        }",
        "      }",
        "    }",
        "  }",
    ]


def _resize(op, fused=None) -> str | None:
    """Resize (nearest, linear, cubic; any coordinate transformation, antialias, crop) of the last
    one or two dims, from per-axis tap tables computed here (:meth:`Resize.axis_taps`, float64,
    stored as int32 indices and float weights): each output row is a weighted sum of ``TH`` input
    rows already resized along W (``hb``, a cache of ``TH`` such rows; row ``r`` lives in slot
    ``r % TH``, and the taps of one output row are consecutive rows, so they never share a slot;
    2x upsampling resizes each input row along W once). A row resized along W gathers ``TW``
    columns per output. Nearest rows are gathers (or copies of the previous output row). Work is
    split over planes, and over bands of rows when there are few planes. ``fused``: a group whose
    later members run per band as the conv template's epilogue does (:func:`_conv_epilogue`)."""
    x, y = op.inputs[0].shape, op.outputs[0].shape
    r = len(x)
    if len(op.inputs) != 1 or r < 1 or op.attrs.get("mode") not in ("nearest", "linear", "cubic"):
        return None
    taps = op.axis_taps(x)
    if any(t is not None for t in taps[:-2]):
        return None  # a leading dim resized: the generic nest
    H, OH = (x[-2], y[-2]) if r >= 2 else (1, 1)
    W, OW = x[-1], y[-1]
    th = taps[-2] if r >= 2 else None
    tw = taps[-1]
    TH = 1 if th is None else th[0].shape[1]
    TW = 1 if tw is None else tw[0].shape[1]
    if TH > 32 or TW > 32 or max(H, W, OH, OW) >= 2 ** 31 \
            or not math.isfinite(float(op.attrs.get("extrapolation_value", 0.0))):
        return None
    planes = _prod(x[:-2]) if r >= 2 else 1
    nearest = op.attrs["mode"] == "nearest"
    epi = None
    if fused is not None:
        if r not in (3, 4):
            return None
        # 4-D: a band is rows r0..r1 of channel pl % C of image pl / C; 3-D [N, C, W]: the kernel's
        # rows are the channels (H = C, copied), so a band is channels r0..r1 of image pl
        epi = _conv_epilogue(fused, x[1], OH if r == 4 else 1, OW, None)
        if epi is None:
            return None
        epi_call = (f"epi_(&ctx_, pl / {x[1]}, pl % {x[1]}, pl % {x[1]} + 1, r0 * OW, r1 * OW);" if r == 4
                    else "epi_(&ctx_, pl, r0, r1, 0, OW);")
    xin = f"in{[id(t) for t in (fused or op).inputs].index(id(op.inputs[0]))}"
    lines = _args(fused or op)
    lines.append(f"  // resize ({op.attrs['mode']}, {op.attrs['coordinate_transformation_mode']}): {planes} planes "
                 f"[{H}, {W}] -> [{OH}, {OW}], {TH} x {TW} taps")
    if epi:
        lines += epi

    def table(name, v, tap_major=True):  # [taps][out] so that a loop over outputs reads it in order
        vals = list(v.T.reshape(-1) if tap_major else v.reshape(-1))
        if v.dtype.kind == "f":
            return f"  static const float {name}[] = {{{', '.join(_flt(w) for w in vals)}}};"
        return f"  static const int32_t {name}[] = {_arr(vals)};"

    outside = []
    if th is not None:
        lines.append(table("ih", th[0], tap_major=False))  # [OH][TH]: the rows of one output row together
        if not nearest:
            lines.append(table("wh", th[1], tap_major=False))
        if th[2] is not None and th[2].any():
            lines.append(table("oh_out", th[2].astype(np.int64)))
            outside.append("oh_out[oh]")
    if tw is not None:
        lines.append(table("iw", tw[0]))
        if not nearest:
            lines.append(table("ww", tw[1]))
        if tw[2] is not None and tw[2].any():
            lines.append(table("ow_out", tw[2].astype(np.int64)))
            outside.append("ow_out[ow]")
    # the row src resized along W into dst
    if tw is None:
        hrow = None
    elif nearest:
        hrow = ["for (int64_t ow = 0; ow < OW; ++ow) dst[ow] = src[iw[ow]];"]
    elif TW <= 4:
        terms = " + ".join(f"ww[{k} * OW + ow] * src[iw[{k} * OW + ow]]" for k in range(TW))
        hrow = [f"for (int64_t ow = 0; ow < OW; ++ow) dst[ow] = {terms};"]
    else:
        hrow = ["for (int64_t ow = 0; ow < OW; ++ow) dst[ow] = ww[ow] * src[iw[ow]];",
                "for (int64_t k = 1; k < TW; ++k)",
                "  for (int64_t ow = 0; ow < OW; ++ow) dst[ow] += ww[k * OW + ow] * src[iw[k * OW + ow]];"]
    lines.append(f"  constexpr int64_t H = {H}, W = {W}, OH = {OH}, OW = {OW}, TH = {TH}, TW = {TW};")
    if hrow is not None:
        lines.append("  auto hrow = [](const float* __restrict__ src, float* __restrict__ dst) {")
        lines += ["    " + ln for ln in hrow]
        lines.append("  };")
    bands = 1 if planes >= 16 else min(OH, -(-16 // planes))
    work = planes * OH * OW * (TH + TW)
    cond = "sf_max_threads() > 1" if work >= (1 << 14) and planes * bands > 1 else "false"
    lines.append(f"  #pragma omp parallel for schedule(static) if ({cond})")
    lines.append(f"  for (int64_t item = 0; item < {planes * bands}; ++item) {{")
    lines.append(f"    const int64_t pl = item / {bands}, band = item % {bands};")
    lines.append(f"    const int64_t r0 = band * OH / {bands}, r1 = (band + 1) * OH / {bands};")
    lines.append(f"    const float* __restrict__ xp = {xin} + pl * H * W;")
    lines.append("    float* __restrict__ yp = out0 + pl * OH * OW;")
    row_of = "ih[oh]" if th is not None else "oh"
    if TH == 1:
        lines.append("    for (int64_t oh = r0; oh < r1; ++oh) {")
        lines.append("      float* __restrict__ yr = yp + oh * OW;")
        if th is not None:
            fresh = f"hrow(xp + {row_of} * W, yr);" if hrow else \
                f"std::memcpy(yr, xp + {row_of} * W, sizeof(float) * OW);"
            if "oh_out[oh]" in outside:  # the previous row may hold the extrapolation value: no copies
                lines.append(f"      {fresh}")
            else:  # a row that repeats the previous one (nearest upsampling) is copied
                lines.append(f"      if (oh > r0 && {row_of} == ih[oh - 1]) "
                             "std::memcpy(yr, yr - OW, sizeof(float) * OW);")
                lines.append(f"      else {fresh}")
        else:
            lines.append(f"      hrow(xp + {row_of} * W, yr);")
    else:
        if hrow is not None:
            lines.append("    float* __restrict__ hb = static_cast<float*>(sf_workspace(0, sizeof(float) * TH * OW));")
            lines.append("    int64_t cached[TH];")
            lines.append("    for (int64_t k = 0; k < TH; ++k) cached[k] = -1;")
        lines.append("    for (int64_t oh = r0; oh < r1; ++oh) {")
        lines.append("      float* __restrict__ yr = yp + oh * OW;")
        lines.append("      const float* rows[TH];")
        lines.append("      for (int64_t k = 0; k < TH; ++k) {")
        lines.append("        const int64_t row = ih[oh * TH + k];")
        if hrow is not None:
            lines.append("        float* slot = hb + (row % TH) * OW;")
            lines.append("        if (cached[row % TH] != row) { hrow(xp + row * W, slot); cached[row % TH] = row; }")
            lines.append("        rows[k] = slot;")
        else:
            lines.append("        rows[k] = xp + row * W;")
        lines.append("      }")
        if TH <= 4:
            terms = " + ".join(f"wh[oh * TH + {k}] * rows[{k}][ow]" for k in range(TH))
            lines.append(f"      for (int64_t ow = 0; ow < OW; ++ow) yr[ow] = {terms};")
        else:
            lines.append("      for (int64_t ow = 0; ow < OW; ++ow) yr[ow] = wh[oh * TH] * rows[0][ow];")
            lines.append("      for (int64_t k = 1; k < TH; ++k) {")
            lines.append("        const float wk = wh[oh * TH + k];")
            lines.append("        const float* __restrict__ rk = rows[k];")
            lines.append("        for (int64_t ow = 0; ow < OW; ++ow) yr[ow] += wk * rk[ow];")
            lines.append("      }")
    if outside:
        ev = _flt(float(op.attrs.get("extrapolation_value", 0.0)))
        lines.append(f"      for (int64_t ow = 0; ow < OW; ++ow) if ({' | '.join(outside)}) yr[ow] = {ev};")
    lines.append("    }")
    if epi:
        lines.append(f"    {epi_call}")
    lines.append("  }")
    return "\n".join(lines)


def _lrn(op) -> str | None:
    """LRN across channels: per image and channel, the window's squares summed into a row of the
    plane's pixels (channel by channel, in the window's order, as the definition sums them), then
    ``x / (bias + alpha / size * s) ** beta`` along the row. Plain loops over contiguous pixels
    that vectorize (``sf_pow`` is branch-free); the generic lowering checked every tap's channel
    per pixel and did not (Inception-v1's 192 x 55 x 55 LRN: rfcs/0002)."""
    x = op.inputs[0].shape
    if len(x) < 3:
        return None
    size, N, C = int(op.attrs["size"]), x[0], x[1]
    P, lo = _prod(x[2:]), (int(op.attrs["size"]) - 1) // 2
    alpha, beta, bias = (float(op.attrs["alpha"]) / size, float(op.attrs["beta"]), float(op.attrs["bias"]))
    lines = _args(op)
    lines += [
        f"  // LRN over {C} channels of {P} pixels ({N} images): window channels [c - {lo}, c + {size - 1 - lo}]",
        f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {N * C * P * size} >= 65536)",
        f"  for (int64_t t = 0; t < {N * C}; ++t) {{",
        f"    const int64_t c = t % {C};",
        f"    const int64_t k0 = std::max<int64_t>(0, {lo} - c), k1 = std::min<int64_t>({size}, {C + lo} - c);",
        f"    const float* __restrict__ xc = in0 + t * {P};",
        f"    float* __restrict__ yc = out0 + t * {P};",
        f"    float* __restrict__ ss = static_cast<float*>(sf_workspace(0, sizeof(float) * {P}));",
        f"    for (int64_t p = 0; p < {P}; ++p) ss[p] = 0.0f;",
        "    for (int64_t k = k0; k < k1; ++k) {",
        f"      const float* __restrict__ xk = xc + (k - {lo}) * {P};",
        f"      for (int64_t p = 0; p < {P}; ++p) ss[p] += xk[p] * xk[p];",
        "    }",
        f"    for (int64_t p = 0; p < {P}; ++p)",
        f"      yc[p] = xc[p] / sf_pow({_flt(bias)} + {_flt(alpha)} * ss[p], {_flt(beta)});",
        "  }",
    ]
    return "\n".join(lines)


def _pad(op) -> str | None:
    """Pad in ``reflect``, ``edge`` or ``wrap`` mode of the last two dims (no cropping): each output row
    copies its source row (a table made with ``np.pad`` of the indices, so every mode means what numpy
    says) with the interior in one run and the borders through a column table. The generic lowering
    computed each element's source index with a modulo or a clamp per dim (reflect 64 x 128 x 128 by 3:
    0.5-0.9 ms against onnxruntime's 0.2). Constant pads keep it (they are fast there, and fuse)."""
    x, y = op.inputs[0].shape, op.outputs[0].shape
    begin, end, mode = list(op.attrs["begin"]), list(op.attrs["end"]), op.attrs["mode"]
    if mode not in ("reflect", "edge", "wrap") or len(op.inputs) != 1 or not x or min(begin + end) < 0 \
            or any(begin[:-2]) or any(end[:-2]) or _prod(y) == 0 or _prod(x) == 0:
        return None
    H, W = (x[-2], x[-1]) if len(x) >= 2 else (1, x[-1])
    bh, eh = (begin[-2], end[-2]) if len(x) >= 2 else (0, 0)
    bw, ew = begin[-1], end[-1]
    planes, OH, OW = _prod(x[:-2]), H + bh + eh, W + bw + ew
    rows = np.pad(np.arange(H), (bh, eh), mode=mode)
    cols = np.pad(np.arange(W), (bw, ew), mode=mode)
    left, right = cols[:bw].tolist(), cols[bw + W:].tolist()  # (_arr writes {0} for none)
    lines = _args(op) + [
        f"  // Pad ({mode}) rows [{bh}, {eh}] and columns [{bw}, {ew}]: {planes} planes [{H}, {W}] -> [{OH}, {OW}]",
        f"  static const int32_t rows[] = {_arr(rows.tolist())}, left[] = {_arr(left)}, right[] = {_arr(right)};",
        f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {planes * OH * OW} >= 65536)",
        f"  for (int64_t t = 0; t < {planes * OH}; ++t) {{",
        f"    const float* __restrict__ xr = in0 + (t / {OH} * {H} + rows[t % {OH}]) * {W};",
        f"    float* __restrict__ yr = out0 + t * {OW};",
        f"    for (int64_t c = 0; c < {bw}; ++c) yr[c] = xr[left[c]];",
        f"    for (int64_t c = 0; c < {W}; ++c) yr[{bw} + c] = xr[c];",
        f"    for (int64_t c = 0; c < {ew}; ++c) yr[{bw + W} + c] = xr[right[c]];",
        "  }",
    ]
    return "\n".join(lines)


def _topk(op) -> str | None:
    """TopK (the op's definition is an extern: no loop nest sorts): per row along ``axis``, the
    positions ordered by value (descending for ``largest``, NaN first, as numpy's stable argsort of
    the reversed axis gives; ascending otherwise, NaN last), equal values by lower position, and the
    first k of them (``std::partial_sort`` of a position buffer; values read through the axis's
    stride) written with their int64 positions. Rows in parallel."""
    from .cpp import STORAGE_CTYPE

    x = op.inputs[0]
    if len(op.inputs) != 1 or len(op.outputs) != 2 or x.ndim == 0 \
            or x.dtype not in ("float32", "float64", "int32", "int64") \
            or op.outputs[0].dtype != x.dtype or op.outputs[1].dtype != "int64":
        return None
    k, axis, largest = int(op.attrs["k"]), int(op.attrs["axis"]) % x.ndim, bool(op.attrs.get("largest", True))
    n, outer, inner = x.shape[axis], _prod(x.shape[:axis]), _prod(x.shape[axis + 1:])
    if not 0 < k <= n or outer * inner == 0:
        return None
    ct = STORAGE_CTYPE[x.dtype]
    flt = x.dtype.startswith("float")
    if largest:
        before = "(a > b) | ((a != a) & (b == b))" if flt else "a > b"
    else:
        before = "(a < b) | ((a == a) & (b != b))" if flt else "a < b"
    lines = [f"  const {ct}* __restrict__ in0 = static_cast<const {ct}*>(inputs[0]);",
             f"  {ct}* __restrict__ out0 = static_cast<{ct}*>(outputs[0]);",
             "  int64_t* __restrict__ out1 = static_cast<int64_t*>(outputs[1]);",
             f"  // TopK: the {k} {'largest' if largest else 'smallest'} of {n} along axis {axis} "
             f"({outer} x {inner} rows), sorted, ties by lower position",
             f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {outer * inner * n} >= 65536)",
             f"  for (int64_t t = 0; t < {outer * inner}; ++t) {{",
             f"    const int64_t o = t / {inner}, i = t % {inner};",
             f"    const {ct}* __restrict__ xr = in0 + o * {n * inner} + i;",
             f"    int32_t* __restrict__ pos = static_cast<int32_t*>(sf_workspace(0, sizeof(int32_t) * {n}));",
             f"    for (int32_t j = 0; j < {n}; ++j) pos[j] = j;",
             f"    auto ahead = []({ct} a, {ct} b) {{ return {before}; }};  // value a goes before value b",
             "    auto first = [xr, ahead](int32_t p, int32_t q) {  // position p goes before position q",
             f"      const {ct} a = xr[(int64_t)p * {inner}], b = xr[(int64_t)q * {inner}];",
             "      return ahead(a, b) || (!ahead(b, a) && p < q);",
             "    };",
             f"    std::partial_sort(pos, pos + {k}, pos + {n}, first);",
             f"    for (int64_t j = 0; j < {k}; ++j) {{",
             f"      out0[(o * {k} + j) * {inner} + i] = xr[(int64_t)pos[j] * {inner}];",
             f"      out1[(o * {k} + j) * {inner} + i] = pos[j];",
             "    }",
             "  }"]
    return "\n".join(lines)


#: elements from which a transposition of two blocks of dims runs the blocked template (smaller ones stay
#: in the generic nest, where they fuse with their neighbours)
_TRANSPOSE_MIN = 1 << 16


def _transpose(op) -> str | None:
    """A Transpose that swaps two blocks of dims (after merging dims that stay adjacent: NCHW <->
    NHWC is ``[N, C, HW] -> [N, HW, C]``), of 64 Ki elements or more: 32 x 32 tiles, each read by
    rows and written by columns within the cache. The generic nest walks the output in order and
    reads the input at a stride per element (64 x 128 x 128, (0, 2, 3, 1): 1.45 ms against
    onnxruntime's 0.44)."""
    x = op.inputs[0].shape
    perm = [int(p) for p in op.attrs["perm"]]
    if _prod(x) < _TRANSPOSE_MIN:
        return None
    # merge the input dims that stay adjacent, in order, in the output: runs of perm (p, p + 1, ...)
    groups = []
    for p in perm:
        if groups and groups[-1][-1] + 1 == p:
            groups[-1].append(p)
        else:
            groups.append([p])
    groups = [g for g in groups if _prod(x[q] for q in g) != 1]  # size-1 dims move nothing
    order = sorted(range(len(groups)), key=lambda j: groups[j][0])  # the groups in input order
    ext = [_prod(x[q] for q in groups[j]) for j in order]
    if len(groups) == 2 and order == [1, 0]:
        B, (R, C) = 1, ext
    elif len(groups) == 3 and order == [0, 2, 1]:
        B, R, C = ext
    else:
        return None
    lines = _args(op) + [
        f"  // Transpose {perm}: {B} x [{R}, {C}] -> [{C}, {R}] in 32 x 32 tiles",
        f"  const int64_t tr = {-(-R // 32)}, tc = {-(-C // 32)};",
        "  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1)",
        f"  for (int64_t t = 0; t < {B} * tr * tc; ++t) {{",
        "    const int64_t b = t / (tr * tc), r0 = t / tc % tr * 32, c0 = t % tc * 32;",
        f"    const int64_t r1 = std::min<int64_t>({R}, r0 + 32), c1 = std::min<int64_t>({C}, c0 + 32);",
        f"    const float* __restrict__ xb = in0 + b * {R * C};",
        f"    float* __restrict__ yb = out0 + b * {R * C};",
        "    for (int64_t r = r0; r < r1; ++r)",
        f"      for (int64_t c = c0; c < c1; ++c) yb[c * {R} + r] = xb[r * {C} + c];",
        "  }",
    ]
    return "\n".join(lines)


#: the dtypes the scan template runs in their own C type (numpy's cumsum/cumprod with dtype=x.dtype)
_SCAN_DTYPES = ("float32", "float64", "int32", "int64", "uint32", "uint64")
#: columns of a scan's inner dims one task carries (its running values on the stack)
_SCAN_CHUNK = 256


def _scan(op) -> str | None:
    """CumSum / CumProd as a running value per position of the inner dims, carried along ``axis``
    (forward or reversed; ``exclusive`` stores before combining): one pass, where the definition
    (and the generic lowering) combines the whole axis for every output, n^2 / 2 operations (64 x
    4096 floats: 44 ms against onnxruntime's 0.87). The values are combined in the definition's
    order (the running value, then the next element). Tasks of up to 256 inner columns per outer
    index, in parallel; the inner loop vectorizes."""
    from .cpp import STORAGE_CTYPE, literal

    x, y = op.inputs[0], op.outputs[0]
    if x.dtype not in _SCAN_DTYPES or y.dtype != x.dtype or len(op.inputs) != 1 or x.ndim == 0:
        return None
    axis, excl, rev = int(op.attrs["axis"]) % x.ndim, bool(op.attrs["exclusive"]), bool(op.attrs["reverse"])
    n, outer, inner = x.shape[axis], _prod(x.shape[:axis]), _prod(x.shape[axis + 1:])
    if n * outer * inner == 0:
        return None
    ct, comb = STORAGE_CTYPE[x.dtype], "+" if op.op_type == "CumSum" else "*"
    ident = literal(0 if op.op_type == "CumSum" else 1, x.dtype)
    chunk = min(inner, _SCAN_CHUNK)
    nch = -(-inner // chunk)
    step = [f"        acc[c - c0] = acc[c - c0] {comb} xr[c];", "        yr[c] = acc[c - c0];"]
    if excl:
        step.reverse()
    lines = [f"  const {ct}* __restrict__ in0 = static_cast<const {ct}*>(inputs[0]);",
             f"  {ct}* __restrict__ out0 = static_cast<{ct}*>(outputs[0]);",
             f"  // {op.op_type} along axis {axis} ({n} positions{', reversed' if rev else ''}"
             f"{', exclusive' if excl else ''}): {outer} outer x {inner} inner, tasks of {chunk} inner columns",
             f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {outer * n * inner} >= 65536)",
             f"  for (int64_t t = 0; t < {outer * nch}; ++t) {{",
             f"    const int64_t o = t / {nch}, c0 = t % {nch} * {chunk};",
             f"    const int64_t c1 = std::min<int64_t>({inner}, c0 + {chunk});",
             f"    {ct} acc[{chunk}];",
             f"    for (int64_t c = c0; c < c1; ++c) acc[c - c0] = {ident};",
             f"    for (int64_t s = 0; s < {n}; ++s) {{",
             f"      const int64_t j = {f'{n - 1} - s' if rev else 's'};",
             f"      const {ct}* __restrict__ xr = in0 + (o * {n} + j) * {inner};",
             f"      {ct}* __restrict__ yr = out0 + (o * {n} + j) * {inner};",
             "      for (int64_t c = c0; c < c1; ++c) {",
             *step,
             "      }",
             "    }",
             "  }"]
    return "\n".join(lines)


_TEMPLATES = {"MatMul": _matmul, "Gemm": _gemm, "PackedMatMul": _packed_matmul, "Conv": _conv,
              "PackedConv": _conv, "WinogradConv": _conv, "ConvTranspose": _conv_transpose, "Pool": _pool,
              "Attention": _attention, "Resize": _resize, "LRN": _lrn, "CumSum": _scan, "CumProd": _scan,
              "Pad": _pad, "Einsum": _einsum,
              "TopK": _topk, "Transpose": _transpose, "Fused": _fused}
#: Templates that check their operands' dtypes themselves (the others take float32 only).
_MIXED_DTYPES = frozenset({"Attention", "CumSum", "CumProd", "TopK"})
#: Templates of ops with more than one output (they check their outputs themselves).
_MULTI_OUTPUT = frozenset({"TopK"})
#: Templates whose kernels are plain loops, worth compiling for each instruction set (the others
#: call the GEMM, which picks its micro-kernel at run time).
CLONED_TEMPLATES = frozenset({"Pool", "Resize", "LRN", "CumSum", "CumProd", "Pad", "Transpose"})
# a template body's lines between these two are definitions of the file, put before the kernel (``SF_SYM``:
# the kernel's symbol; ``SF_ATTR``: its instruction-set clones); see cpp.kernel_source
FILE_SCOPE_BEGIN, FILE_SCOPE_END = "//<file-scope>", "//</file-scope>"


def _template_fn(op):
    """The template function for ``op``'s type when its outputs and dtypes fit one, else ``None``."""
    fn = _TEMPLATES.get(op.op_type)
    if fn is None or (len(op.outputs) != 1 and op.op_type not in _MULTI_OUTPUT) \
            or (op.op_type not in _MIXED_DTYPES and not _all_f32(op)):
        return None
    return fn


def template_kind(op) -> str | None:
    """The template that implements ``op`` (``"MatMul"``, ``"Gemm"``, ``"Conv"``, ``"Pool"``; ``"Fused"`` for a
    conv with fused element-wise ops) or ``None``."""
    fn = _template_fn(op)
    return op.op_type if fn is not None and fn(op) is not None else None


def template_body(op) -> str | None:
    """The kernel body for ``op`` from a template, or ``None`` when the generic lowering applies."""
    fn = _template_fn(op)
    return fn(op) if fn is not None else None
