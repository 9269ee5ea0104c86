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
  const bool allow512 = sf_isa_cap() >= SF_ISA_AVX512;
  const bool allow2 = sf_isa_cap() >= SF_ISA_AVX2;
  if (allow512 && __builtin_cpu_supports("avx512f"))
    return {{sf_ukr_avx512<1>, sf_ukr_avx512<2>, sf_ukr_avx512<3>, sf_ukr_avx512<4>, sf_ukr_avx512<5>,
             sf_ukr_avx512<6>, sf_ukr_avx512<7>, sf_ukr_avx512<8>, sf_ukr_avx512<9>, sf_ukr_avx512<10>,
             sf_ukr_avx512<11>, sf_ukr_avx512<12>}, 12, 32};
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {{sf_ukr_avx2<1>, sf_ukr_avx2<2>, sf_ukr_avx2<3>, sf_ukr_avx2<4>, sf_ukr_avx2<5>, sf_ukr_avx2<6>}, 6, 16};
#endif
  return sf_ukr_all(sf_ukr_generic, 4, 8);
}
#ifdef SF_PREBUILT_TABLES
SF_TABLE_FROM_PREBUILT(SfUkr, ukr)
#else
static const SfUkr& sf_ukr() { static const SfUkr u = sf_pick_ukr(); return u; }
#endif

// whether the AVX2 versions of the helper kernels (GEMV, transpositions, Winograd transforms) apply: the
// CPU has AVX2, FMA and F16C (every AVX2 CPU has it: the GEMV widens float16 weights with it) and
// SHARDFLOW_CPU_ISA does not ask for less (the GEMM's kernel is 16+ wide)
static bool sf_avx2_helpers() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && sf_ukr().nr >= SF_PANEL;
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

// r[t] = column t of the 8 x 8 block at src, its rows ld floats apart
__attribute__((target("avx2,fma"), always_inline))
static inline void sf_load_tr8x8(__m256 (&r)[8], const float* __restrict__ src, int64_t ld) {
  #pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  sf_tr8x8(r);
}

// y[b][c][r] = x[b][r][c] over the tile of rows [r0, r1) and columns [c0, c1) of one of B [R, C] matrices:
// 8 x 8 blocks read by rows and transposed in registers, the rest element by element (the Transpose
// template, templates_cpu._transpose)
__attribute__((target("avx2,fma")))
static void sf_transpose_tile_avx2(const float* __restrict__ x, float* __restrict__ y, int64_t R, int64_t C,
                                   int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  int64_t r = r0;
  for (; r + 8 <= r1; r += 8) {
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
      __m256 v[8];
      sf_load_tr8x8(v, x + r * C + c, C);
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(y + (c + i) * R + r, v[i]);
    }
    for (; c < c1; ++c)
      for (int i = 0; i < 8; ++i) y[c * R + r + i] = x[(r + i) * C + c];
  }
  for (; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) y[c * R + r] = x[r * C + c];
}

// sf_pack_a for a row-major A into the kernels' panels of MR rows (6: the AVX2 kernel's, 12: the AVX-512 one's):
// 8 x 8 transpositions of rows 0-7 (and 8-11, with four zero rows), each column stored as MR floats (the scalar
// copy stored one float at a time). Measured on Zen 3 with sf_pack_bt_avx2 (16 columns), MR 6: the attention
// template's kernels 8-9% faster (causal 12 x 128 x 64, grouped heads 2 x 32 x 256 x 128), GPT-2's projections
// 0-4%; on the AVX-512 Xeon, MR 12: the copy 5.7% -> 3.4% of a 128 x 3072 @ 3072 x 768 product (GPT-2's second
// MLP projection).
template <int MR>
__attribute__((target("avx2,fma")))
static void sf_pack_a_avx2(const float* __restrict__ A, int64_t rsa, int64_t i0, int64_t rows, int64_t k0,
                           int64_t kc, float* __restrict__ Ap) {
  static_assert(MR == 6 || MR == 12, "the kernels' panel heights");
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    __m256 r[8], q[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      r[i] = i < rows ? _mm256_loadu_ps(A + (i0 + i) * rsa + k0 + k) : _mm256_setzero_ps();
      q[i] = MR == 12 && i < 4 && 8 + i < rows ? _mm256_loadu_ps(A + (i0 + 8 + i) * rsa + k0 + k)
                                                : _mm256_setzero_ps();
    }
    sf_tr8x8(r);
    if constexpr (MR == 12) {
      sf_tr8x8(q);
      #pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        _mm256_storeu_ps(Ap + (k + t) * 12, r[t]);
        _mm_storeu_ps(Ap + (k + t) * 12 + 8, _mm256_castps256_ps128(q[t]));
      }
    } else {
      // column t's 6 rows at Ap[(k + t) * 6]: 8-wide stores whose last 2 lanes the next store overwrites,
      // the last one as 4 + 2
      #pragma GCC unroll 7
      for (int t = 0; t < 7; ++t) _mm256_storeu_ps(Ap + (k + t) * 6, r[t]);
      _mm_storeu_ps(Ap + (k + 7) * 6, _mm256_castps256_ps128(r[7]));
      _mm_storel_pi(reinterpret_cast<__m64*>(Ap + (k + 7) * 6 + 4), _mm256_extractf128_ps(r[7], 1));
    }
  }
  for (; k < kc; ++k)
    for (int64_t i = 0; i < MR; ++i) Ap[k * MR + i] = i < rows ? A[(i0 + i) * rsa + k0 + k] : 0.0f;
}

// sf_pack_b for B whose columns are contiguous (B[k, j] at B[j * csb + k]: a K^T read in place) into
// panels of nr = 16 or 32 columns: 8 x 8 transpositions (with AVX-512's panels of 32, the scalar copy had
// taken 13% of a GPT-2 attention's time, 12 heads of 128 x 128 x 64)
__attribute__((target("avx2,fma")))
static void sf_pack_bt_avx2(const float* __restrict__ B, int64_t csb, int64_t j0, int64_t cols, int64_t nr,
                            int64_t k0, int64_t kc, float* __restrict__ Bp) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8)
    for (int h = 0; h < nr / 8; ++h) {
      __m256 r[8];
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        r[i] = h * 8 + i < cols ? _mm256_loadu_ps(B + (j0 + h * 8 + i) * csb + k0 + k) : _mm256_setzero_ps();
      sf_tr8x8(r);
      #pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) _mm256_storeu_ps(Bp + (k + t) * nr + h * 8, r[t]);
    }
  for (; k < kc; ++k)
    for (int64_t j = 0; j < nr; ++j) Bp[k * nr + j] = j < cols ? B[(j0 + j) * csb + k0 + k] : 0.0f;
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
  // (mr 12 and 6 are the AVX-512 and AVX2 kernels' widths: the instruction sets are there)
  if (csa == 1 && mr == 6 && sf_avx2_helpers()) { sf_pack_a_avx2<6>(A, rsa, i0, rows, k0, kc, Ap); return; }
  if (csa == 1 && mr == 12) { sf_pack_a_avx2<12>(A, rsa, i0, rows, k0, kc, Ap); return; }
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
  if (csb != 1 && rsb == 1 && (nr == 16 || nr == 32) && sf_avx2_helpers()) {
    sf_pack_bt_avx2(B, csb, j0, cols, nr, k0, kc, Bp);
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

// C[M, N] = alpha * (A @ B) + bias on the calling thread, A(i, k) = A[i*rsa + k*csa], C row stride ldc, B
// from a source (below); threads split a product into blocks first (sf_gemm_blocks). A is packed once for
// all of K; B comes in chunks of at most SF_NC columns; each tile of C runs the whole K loop, so it stays
// in cache.
// A source of B has: chunk (columns per chunk); prepare(jc, nc, np, nr, nkb), run before the chunk at jc is
// used (packing it, if it packs); and
// panel(jc, np, nr, cols, pc, kc, jp, ldb, bnext), the [kc][ldb] panel of the chunk's columns jp*nr..
// (cols of them) and rows pc.., with bnext for kernels wider than SF_PANEL (SfUkrFn)
constexpr int64_t SF_NC = 4096;
template <class BSource>
static void sf_sgemm_driver(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
                            const BSource& bsrc, float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs,
                            int64_t cbs) {
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
  const bool epi = alpha != 1.0f || bias != nullptr;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t pc = kb * SF_KC, kc = std::min<int64_t>(SF_KC, K - pc);
    for (int64_t p = 0; p < mp; ++p)
      sf_pack_a(A, rsa, csa, row0(p), row0(p + 1) - row0(p), mr, pc, kc, Ap + mp * mr * pc + p * mr * kc);
  }
  // the tile (tm, tn) of mpt x npt panels of the chunk at jc (nc columns, np panels)
  auto tile = [&](int64_t jc, int64_t nc, int64_t np, int64_t mpt, int64_t npt, int64_t tm, int64_t tn) {
    float* Cc = C + jc;
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
        u.fn[mrr - 1](kc, Ab + ip * mr * kc, Bb, ldb, bnext, Cc + row0(ip) * ldc + jp * nr, ldc, mrr, nrr, kb == 0);
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
      sf_gemm_epilogue(C, ldc, row0(ip0), row0(ip1), jc + jp0 * nr, jc + std::min(nc, jp1 * nr), alpha, bias, rbs,
                       cbs);
  };
  for (int64_t jc = 0; jc < N; jc += bsrc.chunk) {
    const int64_t nc = std::min<int64_t>(bsrc.chunk, N - jc), np = (nc + nr - 1) / nr;
    bsrc.prepare(jc, nc, np, nr, nkb);
    // tiles of at most ~144 rows x 256 columns, equal sized. 144 rows keep the 128 tokens of a sequence in
    // one row of tiles, so each B panel is read once (measured: 128 x 768 @ 768 x 50257 12% faster than
    // with 96-row tiles; the other GPT-2 shapes unchanged or up to 4% faster)
    const int64_t ntm = std::max<int64_t>(1, std::min((mp * mr + 143) / 144, mp));
    const int64_t ntn = std::max<int64_t>(1, std::min((np * nr + 255) / 256, np));
    const int64_t mpt = (mp + ntm - 1) / ntm, npt = (np + ntn - 1) / ntn;
    const int64_t tm_n = (mp + mpt - 1) / mpt, tn_n = (np + npt - 1) / npt;
    for (int64_t tm = 0; tm < tm_n; ++tm)
      for (int64_t tn = 0; tn < tn_n; ++tn) tile(jc, nc, np, mpt, npt, tm, tn);
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
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t pc = kb * SF_KC, kc = std::min<int64_t>(SF_KC, K - pc);
      for (int64_t p = 0; p < np; ++p) pack(jc, nc, p, nr, pc, kc, Bp + np * nr * pc + p * nr * kc);
    }
  }
  const float* panel(int64_t, int64_t np, int64_t nr, int64_t, int64_t pc, int64_t kc, int64_t jp, int64_t& ldb,
                     int64_t& bnext) const {
    ldb = nr;
    bnext = 16;
    return Bp + np * nr * pc + jp * nr * kc;
  }
};

// C = alpha * (A @ B) + bias on the calling thread, B packed per call by pack_b (SfPackPerCall)
template <class PackB>
static void sf_sgemm_packed(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
                            const PackB& pack_b, float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs,
                            int64_t cbs) {
  const int64_t nr = sf_ukr().nr;
  const int64_t npm = (std::min<int64_t>(N, SF_NC) + nr - 1) / nr;
  float* Bp = static_cast<float*>(sf_workspace(2, sizeof(float) * npm * nr * K));
  const SfPackPerCall<PackB> src{pack_b, Bp, K, SF_NC};
  sf_sgemm_driver(M, N, K, A, rsa, csa, src, C, ldc, alpha, bias, rbs, cbs);
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

// a block's view of a per-call pack of B's columns (pack(jc, nc, p, nr, k0, kc, Bp), SfPackPerCall) and of a
// bias, for the block whose first row is i0 and first column j0
template <class PackB>
static auto sf_pack_from(const PackB& pack, int64_t j0) {
  return [&pack, j0](int64_t jc, int64_t nc, int64_t p, int64_t nr, int64_t k0, int64_t kc, float* Bp) {
    pack(j0 + jc, nc, p, nr, k0, kc, Bp);
  };
}
static inline const float* sf_bias_at(const float* bias, int64_t rbs, int64_t cbs, int64_t i0, int64_t j0) {
  return bias ? bias + i0 * rbs + j0 * cbs : nullptr;
}

// Threads that own blocks of C: gm blocks of rows by gn strips of columns (gm * gn = the threads), each
// strip a multiple of `align` columns; run(i0, m, j0, n) computes the block of m rows from i0 and n columns
// from j0 on the calling thread, packing its own rows of A (and its columns of B where B is packed per
// call). The grid costs a thread its block's products, plus 80 for each element of A it packs and `bcost`
// for each of B it reads (80 packed per call, 8 prepacked) (in multiply-adds; fitted to 2-thread runs of
// ViT-base's products on a Sapphire Rapids-class Xeon, where a row split of 197 x 3072 @ 3072 x 768 took
// 0.94x the time of a column split and a column split of 128 x 768 @ 768 x 2304 0.96x a row split).
// A thread packing the rows it uses keeps them in its own cache: a team sharing the driver (A packed by
// all threads, tiles taken dynamically, until session 91) took 1.06-1.13x as long on those products, and
// 1.1-3.3x as long on products of runtime operands (512 x 512 x 512 to 128 x 64 x 128; rfcs/0002).
template <class Run>
static void sf_gemm_blocks(int64_t M, int64_t N, int64_t K, int64_t align, double bcost, int nt, const Run& run) {
  const int64_t strips = (N + align - 1) / align;
  int gm = 1;
  double best = -1.0;
  for (int g = 1; g <= nt; ++g) {
    const int64_t rows = (M + g - 1) / g, cols = (strips + nt / g - 1) / (nt / g) * align;
    if (nt % g != 0 || (g > 1 && rows < 12) || strips < nt / g) continue;
    const double cost = (double)rows * cols * K + 80.0 * rows * K + bcost * cols * K;
    if (best < 0 || cost <= best) best = cost, gm = g;  // (a tie: rows, whose blocks of C are contiguous)
  }
  if (best < 0) {  // too few rows and strips for the threads: one thread runs it all
    run(0, M, 0, N);
    return;
  }
  const int gn = nt / gm;
  #pragma omp parallel num_threads(nt)
  {
    // (a team may have fewer threads than asked for, inside another parallel region for one: each thread
    // then runs several blocks)
#if defined(_OPENMP)
    const int first = omp_get_thread_num(), step = omp_get_num_threads();
#else
    const int first = 0, step = 1;
#endif
    for (int t = first; t < nt; t += step) {
      const int bi = t / gn, bj = t % gn;
      const int64_t i0 = M * bi / gm, i1 = M * (bi + 1) / gm;
      const int64_t j0 = strips * bj / gn * align, j1 = std::min(N, strips * (bj + 1) / gn * align);
      if (i1 > i0 && j1 > j0) run(i0, i1 - i0, j0, j1 - j0);
    }
  }
}

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
  if (par) {  // threads that own blocks of C (each packing its rows of A and its columns of B)
    auto block = [=](int64_t i0, int64_t m, int64_t j0, int64_t n) {
      sf_sgemm(m, n, K, A + i0 * rsa, rsa, csa, B + j0 * csb, rsb, csb, C + i0 * ldc + j0, ldc, alpha,
               sf_bias_at(bias, rbs, cbs, i0, j0), rbs, cbs, false);
    };
    sf_gemm_blocks(M, N, K, sf_ukr().nr, 80.0, sf_max_threads(), block);
    return;
  }
  auto pack = [=](int64_t jc, int64_t nc, int64_t p, int64_t nr, int64_t k0, int64_t kc, float* Bp) {
    sf_pack_b(B + jc * csb, rsb, csb, nc, p, nr, k0, kc, Bp);
  };
  sf_sgemm_packed(M, N, K, A, rsa, csa, pack, C, ldc, alpha, bias, rbs, cbs);
}

// a weight's value as float32: float, or float16 bits (a panel of float16 weights, PackedMatMul)
static inline float sf_widen(float v) { return v; }
static inline float sf_widen(uint16_t h) { return sf_h2f(h); }

// y[1, N] = a[1, K] @ B for the prepacked panels [p0, p1) of B (float or float16), four sums per column
// (k mod 4) so that their multiply-adds do not wait on each other
template <class T>
static void sf_gemv_panel_range(int64_t p0, int64_t p1, int64_t N, int64_t K, const float* __restrict__ A,
                                int64_t csa, const T* __restrict__ Bp, float* __restrict__ C, float alpha,
                                const float* __restrict__ bias, int64_t cbs) {
  for (int64_t p = p0; p < p1; ++p) {
    const T* __restrict__ b = Bp + p * K * SF_PANEL;
    float acc[4][SF_PANEL] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float a = A[k * csa];
      for (int64_t j = 0; j < SF_PANEL; ++j) acc[k & 3][j] += a * sf_widen(b[k * SF_PANEL + j]);
    }
    const int64_t j0 = p * SF_PANEL, nj = std::min(N - j0, SF_PANEL);
    for (int64_t j = 0; j < nj; ++j)
      C[j0 + j] = alpha * ((acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j])) + (bias ? bias[(j0 + j) * cbs] : 0.0f);
  }
}

#if defined(__x86_64__)
// eight values of a panel's row as float32 (float16 ones widened by F16C)
__attribute__((target("avx2,fma,f16c"))) static inline __m256 sf_load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) static inline __m256 sf_load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The same with AVX2 (GCC's own vectorization of the loop above shuffles lanes: about 2x slower on Zen 3)
template <class T>
__attribute__((target("avx2,fma,f16c")))
static void sf_gemv_panel_range_avx2(int64_t p0, int64_t p1, int64_t N, int64_t K, const float* __restrict__ A,
                                     int64_t csa, const T* __restrict__ Bp, float* __restrict__ C, float alpha,
                                     const float* __restrict__ bias, int64_t cbs) {
  for (int64_t p = p0; p < p1; ++p) {
    const T* __restrict__ b = Bp + p * K * SF_PANEL;
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
        acc[u][0] = _mm256_fmadd_ps(a, sf_load8(b + (k + u) * SF_PANEL), acc[u][0]);
        acc[u][1] = _mm256_fmadd_ps(a, sf_load8(b + (k + u) * SF_PANEL + 8), acc[u][1]);
      }
    }
    for (; k < K; ++k) {
      const __m256 a = _mm256_set1_ps(A[k * csa]);
      acc[0][0] = _mm256_fmadd_ps(a, sf_load8(b + k * SF_PANEL), acc[0][0]);
      acc[0][1] = _mm256_fmadd_ps(a, sf_load8(b + k * SF_PANEL + 8), acc[0][1]);
    }
    alignas(32) float t[SF_PANEL];
    for (int v = 0; v < 2; ++v)
      _mm256_store_ps(t + 8 * v, _mm256_add_ps(_mm256_add_ps(acc[0][v], acc[1][v]), _mm256_add_ps(acc[2][v], acc[3][v])));
    const int64_t j0 = p * SF_PANEL, nj = std::min(N - j0, SF_PANEL);
    for (int64_t j = 0; j < nj; ++j) C[j0 + j] = alpha * t[j] + (bias ? bias[(j0 + j) * cbs] : 0.0f);
  }
}

// n float16 values as float32 (F16C, eight at a time)
__attribute__((target("avx2,fma,f16c")))
static void sf_widen_halfs_f16c(const uint16_t* __restrict__ s, int64_t n, float* __restrict__ d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, sf_load8(s + i));
  for (; i < n; ++i) d[i] = sf_widen(s[i]);
}
#endif

// y[1, N] = a[1, K] @ B for a prepacked B (float or float16): threads split the panels
template <class T>
static void sf_gemv_panels(int64_t N, int64_t K, const float* __restrict__ A, int64_t csa, const T* __restrict__ Bp,
                           float* __restrict__ C, float alpha, const float* __restrict__ bias, int64_t cbs, bool par) {
  const int64_t np = (N + SF_PANEL - 1) / SF_PANEL;
  const int64_t nt = par && N * K >= (1 << 16) ? std::min<int64_t>(sf_max_threads(), np) : 1;
  auto range = sf_gemv_panel_range<T>;
#if defined(__x86_64__)
  if (sf_avx2_helpers()) range = sf_gemv_panel_range_avx2<T>;
#endif
  #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t t = 0; t < nt; ++t) range(np * t / nt, np * (t + 1) / nt, N, K, A, csa, Bp, C, alpha, bias, cbs);
}

// n float16 values as float32
static void sf_widen_halfs(const uint16_t* __restrict__ s, int64_t n, float* __restrict__ d) {
#if defined(__x86_64__)
  if (sf_avx2_helpers()) return sf_widen_halfs_f16c(s, n, d);
#endif
  for (int64_t i = 0; i < n; ++i) d[i] = sf_widen(s[i]);
}

// A weight's panels in float16 (PackedMatMul of a float16 weight: SfPrepacked's layout, half the bytes):
// each K block of one or two panels that a tile reads is widened into the thread's buffer (workspace slot
// 7; conv.h's blocked PackedConv holds slot 7 only around GEMMs of float32 panels) just before the kernel
// runs the tile's rows on it, so the float32 kernels run unchanged and the weight streams from memory at
// two bytes a value
struct SfHalfPrepacked {
  const uint16_t* Bh;
  int64_t K, chunk;
  void prepare(int64_t, int64_t, int64_t, int64_t, int64_t) const {}
  const float* panel(int64_t jc, int64_t, int64_t nr, int64_t cols, int64_t pc, int64_t kc, int64_t jp, int64_t& ldb,
                     int64_t& bnext) const {
    const int64_t j = jc + jp * nr;
    const uint16_t* src = Bh + (j / SF_PANEL) * K * SF_PANEL + pc * SF_PANEL;
    float* T = static_cast<float*>(sf_workspace(7, sizeof(float) * 2 * SF_KC * SF_PANEL));
    sf_widen_halfs(src, kc * SF_PANEL, T);
    if (cols > SF_PANEL) sf_widen_halfs(src + K * SF_PANEL, kc * SF_PANEL, T + kc * SF_PANEL);
    ldb = SF_PANEL;
    bnext = cols > SF_PANEL ? kc * SF_PANEL : 0;
    return T + j % SF_PANEL;
  }
};

// C[M, N] = alpha * (A @ B) + bias with B prepacked: float32 panels (SfPrepacked) or float16 ones
// (SfHalfPrepacked, Bp's bits as uint16_t); with threads, each owns a block of C (sf_gemm_blocks)
template <class T>
static void sf_sgemm_prepacked(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
                               const T* Bp, float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs,
                               int64_t cbs, bool allow_parallel) {
  if (M <= 0 || N <= 0) return;
  const bool par = sf_gemm_parallel(M, N, K, allow_parallel);
  if (K <= 0) {
    sf_gemm_empty_k(M, N, C, ldc, alpha, bias, rbs, cbs);
    return;
  }
  if (M == 1) {
    sf_gemv_panels<T>(N, K, A, csa, Bp, C, alpha, bias, cbs, par);
    return;
  }
  // the block of m rows from i0 and n columns from j0 (j0 a multiple of SF_PANEL) on the calling thread
  auto block = [=](int64_t i0, int64_t m, int64_t j0, int64_t n) {
    const T* B = Bp + (j0 / SF_PANEL) * K * SF_PANEL;
    const float* b = sf_bias_at(bias, rbs, cbs, i0, j0);
    float* Cb = C + i0 * ldc + j0;
    if constexpr (std::is_same<T, float>::value) {
      sf_sgemm_driver(m, n, K, A + i0 * rsa, rsa, csa, SfPrepacked{B, K, n}, Cb, ldc, alpha, b, rbs, cbs);
    } else {
      sf_sgemm_driver(m, n, K, A + i0 * rsa, rsa, csa, SfHalfPrepacked{B, K, n}, Cb, ldc, alpha, b, rbs, cbs);
    }
  };
  if (par)
    sf_gemm_blocks(M, N, K, std::max<int64_t>(sf_ukr().nr, SF_PANEL), 8.0, sf_max_threads(), block);
  else
    block(0, M, 0, N);
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

// ExpertMatMul: y[s][N] = x_s[K] @ w[ex[s]][N][K]^T (+ bias[ex[s]][N]) for each slot s (token, j) of S, x_s
// the slot's row of x (row s, or row s / J when every slot of a token reads the token's row); a slot whose
// expert is outside [0, E) gets zeros. The slots are grouped by expert (a counting sort): an expert that
// one or two slots use runs GEMVs on its weight (sf_gemv_dot, the weight streamed once per slot: a GEMM
// would pack it first, as much traffic as a second GEMV); one that more use runs one GEMM on their rows,
// gathered, so its weight is read once for all of them, and the rows are scattered back.
template <class Index>
static void sf_expert_matmul(int64_t S, int64_t J, bool row_per_slot, int64_t E, int64_t N, int64_t K,
                             const float* x, const float* w, const Index* ex, const float* bias, float* y) {
  int64_t* start = static_cast<int64_t*>(sf_workspace(0, sizeof(int64_t) * (2 * E + 1 + S) +
                                                         sizeof(float) * S * (K + N)));
  int64_t* fill = start + E + 1;      // each expert's next place in order
  int64_t* order = fill + E;          // the slots by expert: those of e at [start[e], start[e + 1])
  float* xa = reinterpret_cast<float*>(order + S);  // an expert's rows of x, gathered
  float* ya = xa + S * K;                           // and of y
  auto xrow = [&](int64_t s) { return x + (row_per_slot ? s : s / J) * K; };
  for (int64_t e = 0; e <= E; ++e) start[e] = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t e = (int64_t)ex[s];
    if (e >= 0 && e < E) {
      ++start[e + 1];
    } else {
      for (int64_t n = 0; n < N; ++n) y[s * N + n] = 0.0f;
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    start[e + 1] += start[e];
    fill[e] = start[e];
  }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t e = (int64_t)ex[s];
    if (e >= 0 && e < E) order[fill[e]++] = s;
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m = start[e + 1] - start[e];
    const int64_t* slots = order + start[e];
    const float* we = w + e * N * K;
    const float* be = bias ? bias + e * N : nullptr;
    if (m <= 2) {
      for (int64_t r = 0; r < m; ++r)
        sf_sgemm(1, N, K, xrow(slots[r]), K, 1, we, 1, K, y + slots[r] * N, N, 1.0f, be, 0, 1, true);
      continue;
    }
    for (int64_t r = 0; r < m; ++r) std::memcpy(xa + r * K, xrow(slots[r]), sizeof(float) * K);
    sf_sgemm(m, N, K, xa, K, 1, we, 1, K, ya, N, 1.0f, be, 0, 1, true);
    for (int64_t r = 0; r < m; ++r) std::memcpy(y + slots[r] * N, ya + r * N, sizeof(float) * N);
  }
}

}  // namespace
