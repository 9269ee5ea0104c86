// ---- Convolution: the weights read in place ------------------------------------------------------
namespace {

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
// C: input channels per group; G: groups (read by sf_conv2d_packed only: a grouped PackedConv, rfcs/0002)
struct SfConvGeom { int64_t C, H, W, KH, KW, SH, SW, DH, DW, PT, PL, OH, OW; int64_t G = 1; };

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

__attribute__((target("avx2,fma,f16c")))
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
// half: a float16 (1) or bfloat16 (2) model's conv (passes/precision.HalfModelInFloat32 rounds its output, and the
// Add's): the value is rounded to that type after the bias and again after the residual (sf_half*, before the
// residual; sf_end*, with the clamp, whose bounds are values of the type: rounding and clamping commute).
struct SfClamp { bool on; float lo, hi; uint8_t half; };

static inline float sf_half1(float v, const SfClamp& k) {
  return k.half == 1 ? sf_f16_round(v) : k.half == 2 ? sf_bf16_round(v) : v;
}
static inline float sf_clamp(float v, const SfClamp& k) {
  v = sf_half1(v, k);
  return k.on ? std::min(std::max(v, k.lo), k.hi) : v;
}

// The finish of a conv's output block that the kernels apply as they store its last K block: + bias[i]
// of row i (bias null: none), + res[i * ldc + j] (the residual, laid out as C; null: none), then the
// clamp. One per kernel call, its pointers at the call's first row and column.
struct SfFin { const float* bias; const float* res; SfClamp clamp; };

typedef void (*SfCukrFn)(int64_t kc, const float* __restrict__ A, int64_t lda, const float* __restrict__ Bp,
                         float* __restrict__ C, int64_t ldc, int64_t nr, bool first, const SfFin* fin);

// v + *r (r optional), then clamped: a conv output finished
static inline float sf_fin1(float v, const float* r, const SfClamp& k) {
  if (r) v = sf_half1(v, k) + *r;
  return sf_clamp(v, k);
}

#if defined(__x86_64__)
// the clamp of 16 and 8 lanes (on only)
__attribute__((target("avx512f"), always_inline))
static inline __m512 sf_clamp16(__m512 v, const SfClamp& k) {
  return _mm512_min_ps(_mm512_set1_ps(k.hi), _mm512_max_ps(_mm512_set1_ps(k.lo), v));
}
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 sf_clamp8(__m256 v, const SfClamp& k) {
  return _mm256_min_ps(_mm256_set1_ps(k.hi), _mm256_max_ps(_mm256_set1_ps(k.lo), v));
}
// sf_half1 and sf_clamp of 16 and 8 lanes (AVX-512F and F16C convert to float16 and back, to nearest even)
__attribute__((target("avx512f"), always_inline))
static inline __m512 sf_half16(__m512 v, const SfClamp& k) {
  if (k.half == 2) return sf_bf16_round16(v);
  return k.half ? _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)) : v;
}
__attribute__((target("avx512f"), always_inline))
static inline __m512 sf_end16(__m512 v, const SfClamp& k) {
  v = sf_half16(v, k);
  return k.on ? sf_clamp16(v, k) : v;
}
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 sf_half8(__m256 v, const SfClamp& k) {
  if (k.half == 2) return sf_bf16_round8(v);
  return k.half ? _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)) : v;
}
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 sf_end8(__m256 v, const SfClamp& k) {
  v = sf_half8(v, k);
  return k.on ? sf_clamp8(v, k) : v;
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
        if (fin->res) r = _mm512_add_ps(sf_half16(r, fin->clamp), _mm512_maskz_loadu_ps(m, fin->res + i * ldc + 16 * v));
        r = sf_end16(r, fin->clamp);
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
__attribute__((target("avx2,fma,f16c"), always_inline))
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
          if (fin->res) r = _mm256_add_ps(sf_half8(r, fin->clamp), _mm256_loadu_ps(fin->res + i * ldc + 8 * v));
          r = sf_end8(r, fin->clamp);
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
__attribute__((target("avx2,fma,f16c")))
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
__attribute__((target("avx2,fma,f16c")))
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

// the kernels of one part of the table: AVX-512's for 1-8 rows (PART 0) and 9-12 rows (1), AVX2's (2); each
// the unit of a prebuilt object of its own (templates_cpu: sf_rt_cukr and sf_rt_cukr_1..2, compiled side by
// side; the whole table was 13.5 s of g++ in one unit), filled by sf_pick_cukr for the ISA it picks
template <int PART>
static void sf_cukr_part(SfCukr& u) {
#if defined(__x86_64__)
  if constexpr (PART < 2) {
#define SF_K(r) u.fn[r - 1][0] = sf_cukr_avx512<r, 1>; u.fn[r - 1][1] = sf_cukr_avx512<r, 2>;                 \
    u.dfn[r - 1][0][0] = sf_dkr_avx512<r, 1, false>; u.dfn[r - 1][0][1] = sf_dkr_avx512<r, 1, true>;             \
    u.dfn[r - 1][1][0] = sf_dkr_avx512<r, 2, false>; u.dfn[r - 1][1][1] = sf_dkr_avx512<r, 2, true>;
    if constexpr (PART == 0) { SF_K(1) SF_K(2) SF_K(3) SF_K(4) SF_K(5) SF_K(6) SF_K(7) SF_K(8) }
    else { SF_K(9) SF_K(10) SF_K(11) SF_K(12) }
#undef SF_K
  } else {
#define SF_K1(r) u.fn[r - 1][0] = sf_cukr_avx2<r, 1>;                                                        \
    u.dfn[r - 1][0][0] = sf_dkr_avx2<r, 1, false>; u.dfn[r - 1][0][1] = sf_dkr_avx2<r, 1, true>;
#define SF_K(r) SF_K1(r) u.fn[r - 1][1] = sf_cukr_avx2<r, 2>;                                                   \
    u.dfn[r - 1][1][0] = sf_dkr_avx2<r, 2, false>; u.dfn[r - 1][1][1] = sf_dkr_avx2<r, 2, true>;
    SF_K(1) SF_K(2) SF_K(3) SF_K(4) SF_K(5) SF_K(6) SF_K1(7) SF_K1(8) SF_K1(9) SF_K1(10) SF_K1(11) SF_K1(12)
#undef SF_K
#undef SF_K1
  }
#else
  (void)u;
#endif
}

typedef void (*SfCukrPartFn)(SfCukr& u);

// part[k]: sf_cukr_part<k> (or the prebuilt object's)
static SfCukr sf_pick_cukr(const SfCukrPartFn (&part)[3]) {
  SfCukr u = {};
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool allow512 = sf_isa_cap() >= SF_ISA_AVX512;
  const bool allow2 = sf_isa_cap() >= SF_ISA_AVX2;
  if (allow512 && __builtin_cpu_supports("avx512f")) {
    part[0](u);
    part[1](u);
    u.pack = sf_pack_b_conv_avx512;
    u.mr = u.mr1 = 12; u.nv = 2; u.vl = 16;
    return u;
  }
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    part[2](u);
    u.pack = sf_pack_b_conv_avx2;
    u.mr = 6; u.mr1 = 12; u.nv = 2; u.vl = 8;
    return u;
  }
#else
  (void)part;
#endif
  u.fn[0][0] = sf_cukr_generic<1>; u.fn[1][0] = sf_cukr_generic<2>;
  u.fn[2][0] = sf_cukr_generic<3>; u.fn[3][0] = sf_cukr_generic<4>;
  u.pack = sf_pack_b_conv;
  u.mr = u.mr1 = 4; u.nv = 1; u.vl = 8;
  return u;
}
#ifdef SF_PREBUILT_TABLES
SF_TABLE_FROM_PREBUILT(SfCukr, cukr)
#else
static const SfCukr& sf_cukr() {
  static const SfCukrPartFn parts[3] = {sf_cukr_part<0>, sf_cukr_part<1>, sf_cukr_part<2>};
  static const SfCukr u = sf_pick_cukr(parts);
  return u;
}
#endif

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
// sf_conv2d_packed_direct: a blocked image of this many bytes or more (padded) is padded band by band by the
// tasks, each band at most SF_CONV_BAND_BYTES (its group's channel blocks)
constexpr double SF_CONV_BAND_MIN = 2097152.0;
constexpr double SF_CONV_BAND_BYTES = 786432.0;

// How sf_conv2d and sf_conv3d split a conv's output: ntm x ntn tiles per image and group (per depth slice in 3-D;
// nplanes of them), of at most ~96 rows x 256 columns, the mp row and np column panels split evenly (tile t has
// panels [p * t / n, p * (t + 1) / n)); npt: the most column panels of a tile. With threads (par): more tiles
// until every thread gets at least two and the count divides evenly (or there are many), splitting the wider
// side. keep: a thread packs all K rows of its column tile once and reuses them for the next row tiles of the
// same column tile (consecutive tasks), when they fit SF_CONV_KEEP_BYTES.
// at(t): task t's tile, tasks ordered row tiles first (col: its column tile's index over all planes).
struct SfTile { int64_t col, i0, i1, j0, j1; };
struct SfConvTiles {
  int64_t ntm, ntn, npt, ntask, M, N, mr, nr, mp, np;
  bool keep;
  SfTile at(int64_t t) const {
    const int64_t tm = t % ntm, col = t / ntm, tn = col % ntn;
    return {col, mp * tm / ntm * mr, std::min(M, mp * (tm + 1) / ntm * mr), np * tn / ntn * nr,
            std::min(N, np * (tn + 1) / ntn * nr)};
  }
};

// (M rows of the output in panels of mr, N columns in panels of nrm, K in nkb blocks)
static SfConvTiles sf_conv_tiles(int64_t nplanes, int64_t M, int64_t N, int64_t mr, int64_t nrm, int64_t K, int64_t nkb,
                                 bool par, int nt) {
  const int64_t mp = (M + mr - 1) / mr, np = (N + nrm - 1) / nrm;
  int64_t ntm = (mp + 7) / 8, ntn = (np + 7) / 8;
  auto ntiles = [&]() { return nplanes * ntm * ntn; };
  while (par && (ntiles() < 2 * nt || (ntiles() % nt != 0 && ntiles() < 8 * nt)) && (ntm < mp || ntn < np)) {
    if (ntn < np && (ntm >= mp || np * ntm >= mp * ntn)) ++ntn; else ++ntm;
  }
  const int64_t npt = (np + ntn - 1) / ntn;
  const bool keep = ntm > 1 && (nkb == 1 || (double)K * npt * nrm * sizeof(float) <= SF_CONV_KEEP_BYTES);
  return {ntm, ntn, npt, ntiles(), M, N, mr, nrm, mp, np, keep};
}

// The calling thread's buffer of packed B panels for tiles tl (its workspace slot 2)
static float* sf_conv_panels(const SfConvTiles& tl, int64_t K, int64_t kcb, int64_t nrm) {
  return static_cast<float*>(sf_workspace(2, sizeof(float) * ((tl.keep ? K : kcb) * tl.npt * nrm + SF_PACK_SLACK)));
}

// Rows [i0, i1) and columns [j0, j1) of one image's (and group's) conv output yg, [M][ldc]: the weights' rows
// wg ([M][K]) times B, whose row k (a channel and tap) holds the pixels of gs's output grid read from the image xg
// (Hs x Ws floats a channel) at xg + off[k] and on. unpacked: B is read in place (gs.SW == 1; the ISA's dfn
// kernels); else it is packed into Bp by column panels, once per K block (keep: Bp holds the panels of all K
// rows, npt panels of them, and pack false reuses them from the previous tile of the same columns). fin (null:
// none): the kernels' finish on the last K block, its bias at yg's row 0 and its residual laid out as yg.
static void sf_conv_tile(const SfCukr& u, bool unpacked, const float* xg, int64_t Hs, int64_t Ws, const SfConvGeom& gs,
                         const int32_t* off, const float* wg, int64_t K, int64_t nkb, int64_t kcb, float* yg,
                         int64_t ldc, const SfTile& tile, float* Bp, bool pack, bool keep, int64_t npt,
                         const SfFin* fin) {
  const int64_t mr = u.mr, vl = u.vl, nrm = u.nv * u.vl;
  const int64_t i0 = tile.i0, i1 = tile.i1, j0 = tile.j0, j1 = tile.j1;
  SfFin at = fin ? *fin : SfFin{};
  // the finish of a kernel call at row i and column j on K block kb: its pointers at the call's first row and column
  auto last = [&](int64_t kb, int64_t i, int64_t j) -> const SfFin* {
    if (!fin || kb != nkb - 1) return nullptr;
    at.bias = fin->bias ? fin->bias + i : nullptr;
    at.res = fin->res ? fin->res + i * ldc + j : nullptr;
    return &at;
  };
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t pc = kb * kcb, kc = std::min(kcb, K - pc);
    if (unpacked) {
      for (int64_t j = j0; j < j1;) {
        const int64_t oh = j / gs.OW, ow = j % gs.OW;
        const int64_t cols = std::min(std::min(nrm, gs.OW - ow), j1 - j), nv = (cols + vl - 1) / vl;
        const float* xb = xg + oh * gs.SH * Ws + ow;
        const int64_t step = nv == 1 ? u.mr1 : mr;
        for (int64_t i = i0; i < i1; i += step) {
          const int64_t rows = std::min(step, i1 - i);
          u.dfn[rows - 1][nv - 1][cols < nv * vl](kc, wg + i * K + pc, K, xb, off + pc, yg + i * ldc + j, ldc, cols,
                                                  kb == 0, last(kb, i, j));
        }
        j += cols;
      }
      continue;
    }
    float* Bb = Bp + (keep ? pc * npt * nrm : 0);  // this K block's panels, [kc][width] each
    if (pack) {
      for (int64_t j = j0; j < j1; j += nrm) {
        const int64_t cols = std::min(nrm, j1 - j), width = (cols + vl - 1) / vl * vl;
        u.pack(xg, Hs, Ws, gs, off, j, cols, width, pc, kc, Bb + (j - j0) * kc);
      }
    }
    for (int64_t j = j0; j < j1; j += nrm) {
      const int64_t cols = std::min(nrm, j1 - j), nv = (cols + vl - 1) / vl;
      const float* bp = Bb + (j - j0) * kc;
      const int64_t step = nv == 1 ? u.mr1 : mr;
      for (int64_t i = i0; i < i1; i += step) {
        const int64_t rows = std::min(step, i1 - i);
        u.fn[rows - 1][nv - 1](kc, wg + i * K + pc, K, bp, yg + i * ldc + j, ldc, cols, kb == 0, last(kb, i, j));
      }
    }
  }
}

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
  const int nt = sf_max_threads();
  const bool par = nt > 1 && (double)nimg * groups * M * P * K >= SF_CONV_PAR_WORK;
  const SfConvTiles tl = sf_conv_tiles(nimg * groups, M, P, mr, nrm, K, nkb, par, nt);
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
  const bool finish = !epi && (bias || res || clamp.on || clamp.half);  // the kernels finish y (SfFin) on the last K block
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
    float* Bp = unpacked ? nullptr : sf_conv_panels(tl, K, kcb, nrm);
    int64_t packed = -1;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tl.ntask; ++t) {
      const SfTile tile = tl.at(t);  // tile.col: (image, group, column tile)
      const int64_t ng = tile.col / tl.ntn, gi = ng % groups;
      const SfFin fin = {bias ? bias + gi * M : nullptr, res ? res + ng * M * P : nullptr, clamp};
      const bool pack = !tl.keep || packed != tile.col;
      packed = tile.col;
      sf_conv_tile(u, unpacked, xs + ng * ximg, Hs, Ws, gs, off, w + gi * M * K, K, nkb, kcb, y + ng * M * P, P, tile,
                   Bp, pack, tl.keep, tl.npt, finish ? &fin : nullptr);
      if (epi) epi(ctx, ng / groups, gi * M + tile.i0, gi * M + tile.i1, tile.j0, tile.j1);
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
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void sf_put8(float* __restrict__ y, const float* __restrict__ bias, const float* __restrict__ res,
                           const SfClamp& clamp, int64_t c, int64_t at, __m256 v) {
  if (bias) v = _mm256_add_ps(v, _mm256_broadcast_ss(bias + c));
  if (res) v = _mm256_add_ps(sf_half8(v, clamp), _mm256_loadu_ps(res + at));
  v = sf_end8(v, clamp);
  _mm256_storeu_ps(y + at, v);
}

// The same in 8 x 8 tiles through AVX2 registers (the scalar loop stores one float at a time, P floats apart)
__attribute__((target("avx2,fma,f16c")))
static void sf_transpose_cols_avx2(const float* __restrict__ t, int64_t ld, int64_t P, int64_t c0, int64_t c1,
                                   float* __restrict__ y, const float* __restrict__ bias,
                                   const float* __restrict__ res, SfClamp clamp) {
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    int64_t p = 0;
    for (; p + 8 <= P; p += 8) {
      __m256 r[8];
      sf_load_tr8x8(r, t + p * ld + c, ld);
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

#if defined(__x86_64__)
// r[j] = lane j of each of r[0..15] (a 16 x 16 transposition in registers)
__attribute__((target("avx512f"), always_inline))
static inline void sf_tr16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  #pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  #pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  #pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      t[8 * h + j] = _mm512_shuffle_f32x4(u[8 * h + j], u[8 * h + 4 + j], 0x88);
      t[8 * h + 4 + j] = _mm512_shuffle_f32x4(u[8 * h + j], u[8 * h + 4 + j], 0xdd);
    }
  #pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
}

// Prefetch the MR pixels of a tile at q into L1: pixel i at q + i * PS, + rs from pixel M1 on.
template <int MR, int PS, int M1 = MR>
static inline void sf_pdk_prefetch(const float* q, int64_t rs = 0) {
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(q + i * PS + (i >= M1 ? rs : 0)), _MM_HINT_T0);
}

// PackedConv read from its image (AVX-512; sf_conv2d_packed_direct), the image first blocked by 16
// channels, [C / 16][Hp][Wp][16] (sf_block16): one tile is MR output pixels of one output row (PS floats
// apart from xb: the stride times 16) by the 16 * NV output channels of NV weight panels (pstride floats
// apart): acc[i][v] = sum over k of xb[off[k] + i * PS] * wp[v][k][0..16). A pixel's value is a broadcast
// (its address a constant displacement from xb + off[k]; the 16 channels of one tap share a cache line) and
// a panel row a vector load, so nothing is packed per tile, whatever the stride. The channels are the
// vector lanes, so the tile is stored transposed: each 16 x MR block of the accumulators transposed in
// registers (sf_tr16) into one vector of pixels per channel, finished (+ bias[oc], + res[oc][p], the
// clamp) and stored at y[oc][p]. Channels from nvalid on are the panels' zero padding, not stored.
// blk: the output (and res) is blocked, [OC / 16][P][16] from y (y at the tile's first pixel of its first
// block): each accumulator is one pixel's 16 channels, stored as it is (nvalid is 16 * NV). taps: KH * KW, for
// the prefetch of the next block of channels (0: none). M1 < MR: the tile spans two output rows (of M1 pixels
// each, a 7x7 output's), pixels from M1 on read rs floats further (the next row's first pixel at M1 * PS + rs).
// part (a blocked output only; a conv's K in chunks): SF_PDK_ADD starts the sums from y's values (the chunks
// before), SF_PDK_RAW stores them as they are (no bias, res or clamp: chunks follow).
constexpr int SF_PDK_ADD = 1, SF_PDK_RAW = 2;
template <int MR, int NV, int PS, int M1 = MR>
__attribute__((target("avx512f")))
static void sf_pdkr_avx512(int64_t K, const float* __restrict__ xb, const int32_t* __restrict__ off,
                           const float* __restrict__ wp, int64_t pstride, float* __restrict__ y, int64_t P,
                           int64_t nvalid, const float* __restrict__ bias, const float* __restrict__ res,
                           const SfClamp& clamp, bool blk, int64_t taps, int64_t rs, int part) {
  __m512 acc[MR][NV];
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[i][v] = (part & SF_PDK_ADD) ? _mm512_loadu_ps(y + 16 * (v * P + i)) : _mm512_setzero_ps();
  const int64_t kb = 16 * taps, kpf = K - kb;
  for (int64_t k = 0, ph = 0; k < K; ++k) {
    const float* s = xb + off[k];
    if (ph < taps && k < kpf) sf_pdk_prefetch<MR, PS, M1>(xb + off[k + kb], rs);
    if (++ph == kb) ph = 0;
    __m512 b[NV];
    #pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(wp + v * pstride + 16 * k);
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(s[i * PS + (i >= M1 ? rs : 0)]);
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
    }
  }
  if (blk) {
    if (part & SF_PDK_RAW) {
      #pragma GCC unroll 2
      for (int v = 0; v < NV; ++v)
        #pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + 16 * (v * P + i), acc[i][v]);
      return;
    }
    #pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        __m512 o = _mm512_add_ps(acc[i][v], b);
        if (res) o = _mm512_add_ps(sf_half16(o, clamp), _mm512_loadu_ps(res + 16 * (v * P + i)));
        o = sf_end16(o, clamp);
        _mm512_storeu_ps(y + 16 * (v * P + i), o);
      }
    }
    return;
  }
  const __mmask16 pm = (__mmask16)((1u << MR) - 1u);  // the tile's pixels
  #pragma GCC unroll 2
  for (int v = 0; v < NV; ++v) {
    const int64_t n = std::min<int64_t>(16, nvalid - 16 * v);
    if (n <= 0) break;
    __m512 r[16];
    #pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = i < MR ? acc[i][v] : _mm512_setzero_ps();
    sf_tr16(r);  // r[l]: channel 16 * v + l of the tile's pixels
    #pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) {
      if (l >= n) break;
      const int64_t c = 16 * v + l;
      __m512 o = bias ? _mm512_add_ps(r[l], _mm512_set1_ps(bias[c])) : r[l];
      if (res) o = _mm512_add_ps(sf_half16(o, clamp), _mm512_maskz_loadu_ps(pm, res + c * P));
      o = sf_end16(o, clamp);
      _mm512_mask_storeu_ps(y + c * P, pm, o);
    }
  }
}

typedef void (*SfPdkrFn)(int64_t K, const float* __restrict__ xb, const int32_t* __restrict__ off,
                         const float* __restrict__ wp, int64_t pstride, float* __restrict__ y, int64_t P,
                         int64_t nvalid, const float* __restrict__ bias, const float* __restrict__ res,
                         const SfClamp& clamp, bool blk, int64_t taps, int64_t rs, int part);

// the most pixels of a tile (NV = 2: 28 accumulators, 2 panel rows and a broadcast in 32 registers)
constexpr int64_t SF_PDK_MR = 14;

// fn[form][nv - 1][MR - 1], form: stride - 1 on a blocked image (pixels 16 or 32 floats apart), 2 + stride - 1
// on a planar one (pixels 1 or 2 floats apart: images of fewer than 16 channels); rows7[stride - 1][nv - 1]:
// tiles of two output rows of 7 pixels (a blocked image)
struct SfPdkr { SfPdkrFn fn[4][2][SF_PDK_MR]; SfPdkrFn rows7[2][2]; };

template <int PS, int NV, int... MR>
static void sf_pdkr_fill(SfPdkrFn* dst, std::integer_sequence<int, MR...>) {
  ((dst[MR] = sf_pdkr_avx512<MR + 1, NV, PS>), ...);
}

// the kernels of one form (the blocked ones with their rows7): the table's four parts, each the unit of a
// prebuilt object of its own (templates_cpu: sf_rt_pdkr and sf_rt_pdkr_1..3, compiled side by side; the
// whole table was 35 s of g++ in one unit)
template <int FORM>
static void sf_pdkr_part(SfPdkr& t) {
  constexpr int PS = FORM == 0 ? 16 : (FORM == 1 ? 32 : FORM - 1);  // pixels 16, 32, 1 or 2 floats apart
  sf_pdkr_fill<PS, 1>(t.fn[FORM][0], std::make_integer_sequence<int, SF_PDK_MR>{});
  sf_pdkr_fill<PS, 2>(t.fn[FORM][1], std::make_integer_sequence<int, SF_PDK_MR>{});
  if constexpr (FORM < 2) {
    t.rows7[FORM][0] = sf_pdkr_avx512<14, 1, PS, 7>;
    t.rows7[FORM][1] = sf_pdkr_avx512<14, 2, PS, 7>;
  }
}

typedef void (*SfPdkrPartFn)(SfPdkr& t);

// part[k]: sf_pdkr_part<k> (or the prebuilt object's), as sf_pick_cukr takes the direct conv's
static SfPdkr sf_pick_pdkr(const SfPdkrPartFn (&part)[4]) {
  SfPdkr t = {};
  for (SfPdkrPartFn p : part) p(t);
  return t;
}

#ifdef SF_PREBUILT_TABLES
SF_TABLE_FROM_PREBUILT(SfPdkr, pdkr)
#else
static const SfPdkr& sf_pdkr() {
  static const SfPdkrPartFn parts[4] = {sf_pdkr_part<0>, sf_pdkr_part<1>, sf_pdkr_part<2>, sf_pdkr_part<3>};
  static const SfPdkr u = sf_pick_pdkr(parts);
  return u;
}
#endif

// The same with AVX2 (16 registers of 8 floats): a tile is MR <= 6 pixels by the 16 output channels of one
// weight panel (12 accumulators, the panel row's two halves and a broadcast), each 8 x MR block transposed
// (sf_tr8x8) into one vector of pixels per channel, stored under a mask of MR lanes; blk: blocked as
// sf_pdkr_avx512's, a pixel's 16 channels two vectors.
template <int MR, int PS>
__attribute__((target("avx2,fma,f16c")))
static void sf_pdkr_avx2(int64_t K, const float* __restrict__ xb, const int32_t* __restrict__ off,
                         const float* __restrict__ wp, float* __restrict__ y, int64_t P, int64_t nvalid,
                         const float* __restrict__ bias, const float* __restrict__ res, const SfClamp& clamp,
                         bool blk, int64_t taps) {
  __m256 acc[MR][2];
  #pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const int64_t kb = 16 * taps, kpf = K - kb;
  for (int64_t k = 0, ph = 0; k < K; ++k) {
    const float* s = xb + off[k];
    if (ph < taps && k < kpf) sf_pdk_prefetch<MR, PS>(xb + off[k + kb]);
    if (++ph == kb) ph = 0;
    const __m256 b0 = _mm256_loadu_ps(wp + 16 * k), b1 = _mm256_loadu_ps(wp + 16 * k + 8);
    #pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(s + i * PS);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  if (blk) {
    #pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * v) : _mm256_setzero_ps();
      #pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        __m256 o = _mm256_add_ps(acc[i][v], b);
        if (res) o = _mm256_add_ps(sf_half8(o, clamp), _mm256_loadu_ps(res + 16 * i + 8 * v));
        o = sf_end8(o, clamp);
        _mm256_storeu_ps(y + 16 * i + 8 * v, o);
      }
    }
    return;
  }
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m256i pm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 - MR));  // the tile's pixels
  #pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {
    const int64_t n = std::min<int64_t>(8, nvalid - 8 * v);
    if (n <= 0) break;
    __m256 r[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = i < MR ? acc[i][v] : _mm256_setzero_ps();
    sf_tr8x8(r);  // r[l]: channel 8 * v + l of the tile's pixels
    #pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      if (l >= n) break;
      const int64_t c = 8 * v + l;
      __m256 o = bias ? _mm256_add_ps(r[l], _mm256_broadcast_ss(bias + c)) : r[l];
      if (res) o = _mm256_add_ps(sf_half8(o, clamp), _mm256_maskload_ps(res + c * P, pm));
      o = sf_end8(o, clamp);
      _mm256_maskstore_ps(y + c * P, pm, o);
    }
  }
}

typedef void (*SfPdkr2Fn)(int64_t K, const float* __restrict__ xb, const int32_t* __restrict__ off,
                          const float* __restrict__ wp, float* __restrict__ y, int64_t P, int64_t nvalid,
                          const float* __restrict__ bias, const float* __restrict__ res, const SfClamp& clamp,
                          bool blk, int64_t taps);

// the most pixels of an AVX2 tile
constexpr int64_t SF_PDK_MR2 = 6;

// fn[form][MR - 1], form as SfPdkr's
struct SfPdkr2 { SfPdkr2Fn fn[4][SF_PDK_MR2]; };

template <int PS, int... MR>
static void sf_pdkr2_fill(SfPdkr2Fn* dst, std::integer_sequence<int, MR...>) {
  ((dst[MR] = sf_pdkr_avx2<MR + 1, PS>), ...);
}

#ifdef SF_PREBUILT_TABLES
SF_TABLE_FROM_PREBUILT(SfPdkr2, pdkr2)
#else
static const SfPdkr2& sf_pdkr2() {
  static const SfPdkr2 u = [] {
    SfPdkr2 t = {};
    sf_pdkr2_fill<16>(t.fn[0], std::make_integer_sequence<int, SF_PDK_MR2>{});
    sf_pdkr2_fill<32>(t.fn[1], std::make_integer_sequence<int, SF_PDK_MR2>{});
    sf_pdkr2_fill<1>(t.fn[2], std::make_integer_sequence<int, SF_PDK_MR2>{});
    sf_pdkr2_fill<2>(t.fn[3], std::make_integer_sequence<int, SF_PDK_MR2>{});
    return t;
  }();
  return u;
}
#endif

// dst[Hp][Wp][16] = channels [0, cn) of src (planes [H][W], plane floats apart) placed at (pt, pl), zero
// around them; lanes from cn on are left as they are (no tap reads them). 8 x 8 transpositions (AVX2: the
// blocked image serves both kernels).
__attribute__((target("avx2,fma,f16c")))
static void sf_block16(const float* __restrict__ src, int64_t cn, int64_t plane, int64_t H, int64_t W, int64_t pt,
                       int64_t pl, int64_t Hp, int64_t Wp, float* __restrict__ dst) {
  const __m256 z = _mm256_setzero_ps();
  for (int64_t r = 0; r < Hp; ++r) {
    float* d = dst + r * Wp * 16;
    const int64_t ih = r - pt;
    if (ih < 0 || ih >= H) {
      for (int64_t j = 0; j < 2 * Wp; ++j) _mm256_storeu_ps(d + 8 * j, z);
      continue;
    }
    for (int64_t j = 0; j < 2 * pl; ++j) _mm256_storeu_ps(d + 8 * j, z);
    for (int64_t j = 2 * (pl + W); j < 2 * Wp; ++j) _mm256_storeu_ps(d + 8 * j, z);
    float* di = d + pl * 16;
    const float* s = src + ih * W;
    int64_t w = 0;
    for (; w + 8 <= W; w += 8) {
      #pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        if (8 * h >= cn) break;
        __m256 t[8];
        #pragma GCC unroll 8
        for (int i = 0; i < 8; ++i)
          t[i] = 8 * h + i < cn ? _mm256_loadu_ps(s + (8 * h + i) * plane + w) : _mm256_setzero_ps();
        sf_tr8x8(t);
        #pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(di + (w + i) * 16 + 8 * h, t[i]);
      }
    }
    for (; w < W; ++w)
      for (int64_t c = 0; c < cn; ++c) di[w * 16 + c] = s[c * plane + w];
  }
}
#endif

// The blocked layout of a 2-D conv's image or output (passes/layout.py), per image [C / 16][H][W][16], C
// a multiple of 16: SF_BLK_IN, the input x is blocked; SF_BLK_OUT, the output y (and res) is.
constexpr unsigned SF_BLK_IN = 1, SF_BLK_OUT = 2;

// dst[Hp][Wp][pf] = the plane src[H][W][pf] (pf floats a pixel: 16 blocked, 1 planar) placed at (pt, pl),
// zero around it
static void sf_pad_blocked(const float* __restrict__ src, int64_t H, int64_t W, int64_t pt, int64_t pl, int64_t Hp,
                           int64_t Wp, float* __restrict__ dst, int64_t pf = 16) {
  for (int64_t r = 0; r < Hp; ++r) {
    float* d = dst + r * Wp * pf;
    const int64_t ih = r - pt;
    if (ih < 0 || ih >= H) {
      std::memset(d, 0, sizeof(float) * Wp * pf);
      continue;
    }
    std::memset(d, 0, sizeof(float) * pl * pf);
    std::memcpy(d + pl * pf, src + ih * W * pf, sizeof(float) * W * pf);
    std::memset(d + (pl + W) * pf, 0, sizeof(float) * (Wp - pl - W) * pf);
  }
}

// PackedConv without im2col, GEMM or transposition where the conv template runs its AVX-512 kernels, for
// the convs named below, or its AVX2 ones, for the stride-2 windows (else false: the caller takes the GEMM
// path). Each image is first blocked by 16 channels (sf_block16, with its padding). Tasks are (image, block
// of 32 output channels, run of output rows; a 1x1, stride-1, unpadded conv's image is one row of P pixels,
// cut in runs of 56); each row is cut in tiles of at most SF_PDK_MR pixels (AVX2: SF_PDK_MR2), every tile
// reading the block's panels (K x 32 floats, kept in L2 by the task) and its pixels from the blocked image.
// epi (optional) finishes each task's channels and pixels in place (in the output's layout). With blk
// (SF_BLK_IN, SF_BLK_OUT), every conv of row stride 1 or 2 takes this path with either ISA: a blocked image
// is read where it lies (a conv without padding) or copied into its padded form (sf_pad_blocked), a
// blocked output stored as the kernels hold it.
static bool sf_conv2d_packed_direct(const float* x, const float* wp, const float* bias, float* y,
                                    const SfConvGeom& g, int64_t nimg, int64_t OC, bool direct, unsigned blk,
                                    SfConvEpi epi, const void* ctx, const float* res, SfClamp clamp) {
#if defined(__x86_64__)
  const int64_t vl = sf_cukr().vl;
  // groups (a grouped PackedConv: each group's channels whole blocks of 16, its outputs whole panels): a task's
  // block of output channels lies in one group and reads that group's blocks of the image
  const int64_t G = g.G, Ct = g.C * G, ocg = OC / G;
  if (G > 1 && (g.C % 16 != 0 || ocg % 16 != 0)) return false;
  // (the portable conv table is 8 wide too: the AVX2 kernels below only where its helpers run, not under
  // SHARDFLOW_CPU_ISA=generic or on a CPU without AVX2)
  if (vl == 8 && !sf_avx2_helpers()) return false;
  if (blk) {
    if ((vl != 16 && vl != 8) || (g.SW != 1 && g.SW != 2)) return false;
  } else {
    // the ISA picked once (AVX-512, unless SHARDFLOW_CPU_ISA says otherwise); with AVX2, windows at horizontal
    // stride 2 only: measured with AVX2 forced on an AVX-512 Xeon (rfcs/0002), 3x3 stride-2 convs took 0.77-0.94x
    // the GEMM path's (or the conv template's) time, but 512->512 at 7x7 stride 1 1.15x (the 1x1 expansions
    // were not measured with AVX2)
    if (vl != 16 && (vl != 8 || direct || g.SW != 2)) return false;
    // windows wider than 1x1 (passes/prepack.py makes PackedConvs of those at stride 2, or stride 1 on small
    // images), and 1x1 stride-1 convs of at least twice as many output channels as input channels (the
    // blocked image read by many blocks of 32): measured on an AVX-512 Xeon (rfcs/0002), 1x1 256->1024 at
    // 14x14 and 512->2048 at 7x7 8-10% faster than the GEMM below, MobileNetV2's 6x expansions at 14x14 and
    // 7x7 14-31%; the reductions 1024->256 and 2048->512 1-23% slower, strided 1x1s 1.5x (the whole image
    // blocked for a quarter of its pixels)
    if (direct ? ocg < 2 * g.C : ((g.SW != 1 && g.SW != 2) || g.KH * g.KW == 1)) return false;
  }
  // a strided 1x1 conv of a blocked image without padding: its pixels gathered into a dense blocked image
  // first, then run as a 1x1 of stride 1 (each block of output channels read all of the strided image's
  // lines: measured for ResNet-50's 1x1 256->512 of stride 2 at 56x56 1.25x slower than the conv template)
  const bool sub = (blk & SF_BLK_IN) && !direct && g.KH * g.KW == 1 && g.PT == 0 && g.PL == 0;
  const bool flat = direct || sub;  // the image is one row of P pixels
  // a plain image of fewer than 16 channels (a stem's 3) is padded plane by plane, not blocked: its pixels are
  // 1 or 2 floats apart in the tiles (blocked, its 3 channels took 16 floats a pixel: ResNet-50's 7x7 stem
  // 1.4 ms against the conv template's 0.88)
  const bool planar = !(blk & SF_BLK_IN) && !flat && Ct < 16;
  const int64_t pxf = planar ? 1 : 16;  // floats per pixel of the padded image
  const int64_t sw = flat ? 1 : g.SW;
  // the kernels' form
  const int64_t form = (planar ? 2 : 0) + sw - 1;
  const SfPdkr& u = sf_pdkr();
  const SfPdkr2& u2 = sf_pdkr2();
  if (vl == 16 ? u.fn[form][0][0] == nullptr : u2.fn[form][0] == nullptr) return false;
  const int64_t P = g.OH * g.OW, K = g.C * g.KH * g.KW, ncb = (Ct + 15) / 16;
  // the blocked image's geometry: a 1x1 stride-1 conv's image is one row of P pixels
  const int64_t H = flat ? 1 : g.H, W = flat ? P : g.W;
  const int64_t Hp = flat ? 1 : std::max(g.H + g.PT, (g.OH - 1) * g.SH + (g.KH - 1) * g.DH + 1);
  const int64_t Wp = flat ? P : std::max(g.W + g.PL, (g.OW - 1) * g.SW + (g.KW - 1) * g.DW + 1);
  const int64_t cbs = Hp * Wp * pxf, ximg = planar ? Ct * cbs : ncb * cbs;
  if ((double)ximg >= 2147483647.0 || 16.0 * P >= 2147483647.0) return false;
  const int64_t OWr = flat ? std::min<int64_t>(P, 4 * SF_PDK_MR) : g.OW, nrows = flat ? (P + OWr - 1) / OWr : g.OH;
  const int64_t CB = G > 1 && ocg % 32 != 0 ? 16 : 32;  // a block of output channels in one group
  const int64_t nob = (OC + CB - 1) / CB, pstride = K * 16;
  const int nt = sf_max_threads();
  const bool par = nt > 1 && (double)nimg * P * OC * K >= SF_CONV_PAR_WORK;
  // a 7-pixel output row (a 224 x 224 net's last stage) is too short a tile for 28 accumulators: with
  // AVX-512, a tile is two rows of 7 (units of two rows below); 3x3 512->512 at 7x7 in a chain of convs
  // 1.04 -> 0.84 ms, 832->192 0.73 -> 0.61 (two threads, the AVX-512 Xeon)
  const bool rows7 = vl == 16 && !flat && !planar && g.OW == 7;
  const int64_t upr = rows7 ? 2 : 1, nunits = (nrows + upr - 1) / upr;
  // runs of rows per task: enough tasks for 4 per thread
  const int64_t want = par ? (4 * nt + nimg * nob - 1) / (nimg * nob) : 1;
  const int64_t nrb = std::max<int64_t>(1, std::min(nunits, want)), ntask = nimg * nob * nrb;
  // a blocked image without padding is read where it lies
  const bool inplace = (blk & SF_BLK_IN) && !sub && Hp == H && Wp == W && (direct || (g.PT == 0 && g.PL == 0));
  // banded: a large blocked image to pad (SF_CONV_BAND_MIN bytes or more) for a strided conv is not copied
  // whole before the tasks (its padded copy written to memory and read back: 6.6 MB for YOLOv8n's 3x3 16->32
  // at 320x320 stride 2, 0.47 of its 1.24 ms), but by each task, a band of rows of its group's channel
  // blocks at a time (SF_CONV_BAND_BYTES, kept in the thread's L2), every block of output channels of the
  // group computed on the band before the next one is copied. Tasks are (image, group, band). Measured
  // (two threads, the AVX-512 Xeon, a harness on this function; rfcs/0002 "Strided convs pad their image
  // by bands"): stride 2, 16->32 at 320x320 1.17 -> 0.78 ms, 32->64 at 160x160 0.77 -> 0.73, RegNet's 2
  // groups of 64 at 112x112 1.63 -> 1.47; stride 1 (four shapes) within -1..+2.5%: left as it was.
  const bool banded = (blk & SF_BLK_IN) && !inplace && !sub && !flat && !planar && !rows7 && g.SH > 1 &&
                      (double)(g.C / 16) * G * cbs * sizeof(float) >= SF_CONV_BAND_MIN;
  int64_t bro = nrows, nband = 1;  // output rows a band, bands an image and group
  if (banded) {
    const double row_bytes = (double)(g.C / 16) * Wp * 16 * sizeof(float);
    const int64_t fit = (int64_t)(SF_CONV_BAND_BYTES / row_bytes) - (g.KH - 1) * g.DH - 1;  // input rows
    const int64_t most = std::max<int64_t>(1, fit / g.SH + 1);  // the output rows they serve
    nband = (nrows + most - 1) / most;
    auto nbt = [&]() { return nimg * G * nband; };
    while (par && nband < nrows && (nbt() < 2 * nt || (nbt() % nt != 0 && nbt() < 8 * nt))) ++nband;
    bro = (nrows + nband - 1) / nband;  // (the most: band b has rows [nrows * b / nband, nrows * (b + 1) / nband))
  }
  const int64_t hb = (bro - 1) * g.SH + (g.KH - 1) * g.DH + 1;  // (banded) input rows a band
  const int64_t cbx = banded ? hb * Wp * 16 : cbs;  // floats from one block of channels to the next where read
  float* xb16 = inplace || banded ? nullptr
                                  : static_cast<float*>(sf_workspace(3, sizeof(float) * (nimg * ximg + 16)));
  int32_t* off = static_cast<int32_t*>(sf_workspace(4, sizeof(int32_t) * K));
  for (int64_t c = 0, k = 0; c < g.C; ++c)
    for (int64_t kh = 0; kh < g.KH; ++kh)
      for (int64_t kw = 0; kw < g.KW; ++kw)
        off[k++] = (int32_t)(planar ? c * cbs + kh * g.DH * Wp + kw * g.DW
                                    : (c / 16) * cbx + (flat ? 0 : (kh * g.DH * Wp + kw * g.DW) * 16) + c % 16);
  // the kernels prefetch each tile's pixels of the next block of 16 channels (a pixel's 16 channels, one cache
  // line, serve 16 * taps values of k): the image's blocks lie P * 16 floats apart, too far for the hardware's
  // prefetcher to follow, and the first pass over each block read the lines the other thread wrote (its output
  // channels of the conv before): 1x1 1024->256 at 14x14 in a chain of convs 0.415 -> 0.342 ms, 256->1024
  // 0.353 -> 0.331 (two threads, the AVX-512 Xeon). A planar image's planes are read whole: no prefetch.
  const int64_t pft = planar ? 0 : g.KH * g.KW;
  // a small output image (at most 64 pixels: 7x7, 8x8) of a conv whose weights are 2 MiB or more (ResNet-50's last
  // stage), to a blocked output, with AVX-512: K in chunks of 64 values (whole blocks of 16 channels with all their
  // taps), each chunk over all of a task's few tiles, the partial sums kept in the output (sf_pdkr_avx512's part),
  // so that a chunk's panels (8 KiB) serve every tile from L1 where the task's whole panels (256 KiB for 1x1
  // 2048->512, 576 KiB for 3x3 512->512) were streamed again for each. Measured in ResNet-50 (two threads, the
  // AVX-512 Xeon, paired): its 7x7 stage's 3x3s 0.83-0.87, 1x1 2048->512 0.88-0.90, 512->2048 0.91-0.98; but
  // MobileNetV2's 7x7 1x1s (0.1-1.6 MiB of weights) 1.02-1.09, and at 14x14 and larger no gain (1x1 1024->256
  // 0.99-1.03) or a loss (1x1 512->256 at 28x28 1.10: each chunk's first block of channels is not prefetched).
  // The sums are the same in the same order (a float stored and loaded back): the same bits.
  const int64_t kc = vl == 16 && (blk & SF_BLK_OUT) && !planar && P <= 64 && 4.0 * K * OC >= 2097152.0
                         ? std::max<int64_t>(1, 64 / (16 * pft)) * 16 * pft : K;
  const int64_t pt = flat ? 0 : g.PT, pl = flat ? 0 : g.PL;
  #pragma omp parallel num_threads(nt) if (par)
  {
    // block cb of image n starts at the same offset in both layouts
    if (planar) {
      #pragma omp for schedule(static)
      for (int64_t b = 0; b < nimg * Ct; ++b)
        sf_pad_blocked(x + b * g.H * g.W, g.H, g.W, pt, pl, Hp, Wp, xb16 + b * cbs, 1);
    } else if (!inplace && !banded) {
      #pragma omp for schedule(static)
      for (int64_t b = 0; b < nimg * ncb; ++b) {
        const int64_t n = b / ncb, cb = b % ncb;
        const float* src = x + (n * Ct + cb * 16) * g.H * g.W;
        if (sub) {
          float* d = xb16 + n * ximg + cb * cbs;
          for (int64_t oh = 0; oh < g.OH; ++oh)
            for (int64_t ow = 0; ow < g.OW; ++ow)
              std::memcpy(d + (oh * g.OW + ow) * 16, src + (oh * g.SH * g.W + ow * g.SW) * 16, sizeof(float) * 16);
        } else if (blk & SF_BLK_IN) {
          sf_pad_blocked(src, H, W, pt, pl, Hp, Wp, xb16 + n * ximg + cb * cbs);
        } else {
          sf_block16(src, std::min<int64_t>(16, Ct - cb * 16), g.H * g.W, H, W, pt, pl, Hp, Wp,
                     xb16 + n * ximg + cb * cbs);
        }
      }
    }
    // output rows [r0, r1) of image n's output channels [c0, c0 + CB), its group's image at xi (row rx first)
    auto rows = [&](int64_t n, int64_t c0, int64_t r0, int64_t r1, const float* xi, int64_t rx) {
      const int64_t nvalid = std::min(CB, OC - c0), nv = nvalid > 16 ? 2 : 1;
      const bool bo = blk & SF_BLK_OUT;
      float* yb = y + (n * OC + c0) * P;
      const float* rsd = res ? res + (n * OC + c0) * P : nullptr;
      const float* wb = wp + (c0 / 16) * pstride;
      const float* bb = epi || !bias ? nullptr : bias + c0;
      for (int64_t k0 = 0; k0 < K; k0 += kc)
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t p0 = r * OWr, len = std::min(OWr, P - p0);
        const float* xr = xi + (flat ? p0 : (r - rx) * g.SH * Wp) * pxf;
        const int64_t kn = std::min(kc, K - k0);
        const int part = (k0 > 0 ? SF_PDK_ADD : 0) | (k0 + kn < K ? SF_PDK_RAW : 0);
        const float* wk = wb + 16 * k0;
        const int32_t* ok = off + k0;
        if (vl == 8) {  // AVX2: tiles of up to 6 pixels, one panel of 16 channels at a time (K whole: kc is K)
          for (int64_t j = 0; j < len;) {
            const int64_t mr = std::min(SF_PDK_MR2, len - j);
            const int64_t yo = bo ? (p0 + j) * 16 : p0 + j;
            for (int64_t v = 0; v < nv; ++v)
              u2.fn[form][mr - 1](K, xr + j * sw * pxf, off, wb + v * pstride, yb + 16 * v * P + yo, P,
                                    std::min<int64_t>(16, nvalid - 16 * v), bb ? bb + 16 * v : nullptr,
                                    rsd ? rsd + 16 * v * P + yo : nullptr, clamp, bo, pft);
            j += mr;
          }
          continue;
        }
        if (rows7 && r + 1 < r1) {  // rows r and r + 1: 14 pixels, contiguous in the output
          const int64_t yo = bo ? p0 * 16 : p0;
          u.rows7[sw - 1][nv - 1](kn, xr, ok, wk, pstride, yb + yo, P, nvalid, bb, rsd ? rsd + yo : nullptr, clamp,
                                  bo, pft, g.SH * Wp * 16 - 7 * sw * 16, part);
          ++r;
          continue;
        }
        for (int64_t j = 0; j < len;) {
          const int64_t mr = std::min(SF_PDK_MR, len - j);
          const int64_t yo = bo ? (p0 + j) * 16 : p0 + j;
          u.fn[form][nv - 1][mr - 1](kn, xr + j * sw * pxf, ok, wk, pstride, yb + yo, P, nvalid, bb,
                                       rsd ? rsd + yo : nullptr, clamp, bo, pft, 0, part);
          j += mr;
        }
      }
      if (epi) epi(ctx, n, c0, c0 + nvalid, r0 * OWr, std::min(P, r1 * OWr));
    };
    if (banded) {
      float* band = static_cast<float*>(sf_workspace(3, sizeof(float) * ((g.C / 16) * cbx + 16)));
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < nimg * G * nband; ++t) {
        const int64_t b = t % nband, gi = (t / nband) % G, n = t / (nband * G);
        const int64_t r0 = nrows * b / nband, r1 = nrows * (b + 1) / nband, ih0 = r0 * g.SH - pt;
        for (int64_t cb = 0; cb < g.C / 16; ++cb)
          sf_pad_blocked(x + (n * Ct + gi * g.C + cb * 16) * g.H * g.W, H, W, -ih0, pl, hb, Wp, band + cb * cbx);
        for (int64_t c0 = gi * ocg; c0 < (gi + 1) * ocg; c0 += CB) rows(n, c0, r0, r1, band, r0);
      }
    } else {
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < ntask; ++t) {
        const int64_t ob = t % nob, rb = (t / nob) % nrb, n = t / (nrb * nob);
        const int64_t r0 = std::min(nrows, nunits * rb / nrb * upr);
        const int64_t r1 = std::min(nrows, nunits * (rb + 1) / nrb * upr);
        const int64_t c0 = ob * CB;
        rows(n, c0, r0, r1, (inplace ? x + n * ximg : xb16 + n * ximg) + c0 / ocg * (g.C / 16) * cbs, 0);
      }
    }
  }
  return true;
#else
  return false;
#endif
}

// epi, res and clamp as in sf_conv2d (the transposition adds the bias, res and the clamp: the GEMM's own bias
// step is a pass of its own over yt); blk as in sf_conv2d_packed_direct
static void sf_conv2d_packed(const float* x, const float* wp, const float* bias, float* y, const SfConvGeom& g,
                             int64_t nimg, int64_t OC, bool direct, unsigned blk = 0, SfConvEpi epi = nullptr,
                             const void* ctx = nullptr, const float* res = nullptr, SfClamp clamp = {}) {
  const int64_t P = g.OH * g.OW, K = g.C * g.KH * g.KW;
  if (nimg <= 0 || OC <= 0 || P <= 0) return;
  if (sf_conv2d_packed_direct(x, wp, bias, y, g, nimg, OC, direct, blk, epi, ctx, res, clamp)) return;
  const int64_t G = g.G, Ct = g.C * G, ocg = OC / G;
  if (blk) {  // no kernel here for the blocked layout: the plain conv, the layouts changed around it
    const int64_t HW = g.H * g.W;
    const float* xn = x;
    if (blk & SF_BLK_IN) {
      float* t = static_cast<float*>(sf_workspace(6, sizeof(float) * nimg * Ct * HW));
      for (int64_t n = 0; n < nimg; ++n)
        for (int64_t c = 0; c < Ct; ++c)
          for (int64_t p = 0; p < HW; ++p)
            t[(n * Ct + c) * HW + p] = x[(n * Ct + c / 16 * 16) * HW + p * 16 + c % 16];
      xn = t;
    }
    if (!(blk & SF_BLK_OUT)) {
      sf_conv2d_packed(xn, wp, bias, y, g, nimg, OC, direct, 0, epi, ctx, res, clamp);
      return;
    }
    float* t = static_cast<float*>(sf_workspace(7, sizeof(float) * nimg * OC * P));
    sf_conv2d_packed(xn, wp, epi ? nullptr : bias, t, g, nimg, OC, direct);
    for (int64_t n = 0; n < nimg; ++n) {
      for (int64_t c = 0; c < OC; ++c)
        for (int64_t p = 0; p < P; ++p) {
          const int64_t at = (n * OC + c / 16 * 16) * P + p * 16 + c % 16;
          y[at] = sf_fin1(t[(n * OC + c) * P + p], res ? res + at : nullptr, clamp);
        }
      if (epi) epi(ctx, n, 0, OC, 0, P);
    }
    return;
  }
  const bool par = sf_max_threads() > 1 && (double)P * OC * K >= SF_CONV_PAR_WORK;
  float* yt = static_cast<float*>(sf_workspace(5, sizeof(float) * P * OC));
  float* col = direct ? nullptr : static_cast<float*>(sf_workspace(3, sizeof(float) * K * P));
  constexpr int64_t CB = 16;  // channels per block of the transposition
  const int64_t ncb = (OC + CB - 1) / CB;
  for (int64_t n = 0; n < nimg; ++n) {
    // per group (a grouped PackedConv's outputs are whole panels of its group's K rows): yt's columns of the group
    for (int64_t gi = 0; gi < G; ++gi) {
      const float* xi = x + (n * Ct + gi * g.C) * g.H * g.W;
      if (!direct) sf_im2col(xi, g, col, par);
      sf_sgemm_prepacked(P, ocg, K, direct ? xi : col, 1, P, wp + gi * (ocg / 16) * K * 16, yt + gi * ocg, OC, 1.0f,
                         nullptr, 0, 0, true);
    }
    float* yi = y + n * OC * P;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t cb = 0; cb < ncb; ++cb) {
      const int64_t c0 = cb * CB, c1 = std::min(OC, c0 + CB);
      sf_transpose_cols(yt, OC, P, c0, c1, yi, epi ? nullptr : bias, res ? res + n * OC * P : nullptr, clamp);
      if (epi) epi(ctx, n, c0, c1, 0, P);
    }
  }
}

}  // namespace
