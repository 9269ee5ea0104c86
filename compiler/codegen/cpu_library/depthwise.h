// ---- Depthwise convolution (one input channel per group) --------------------------------------------
namespace {

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
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256i sf_lanes8(int64_t m) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// as sf_to_vec16_generic, in 8 x 8 transpositions (the last run of columns by masked loads)
__attribute__((target("avx2,fma,f16c")))
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
__attribute__((target("avx2,fma,f16c")))
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
        const __m256 v = sf_end8(r[i], clamp);
        if (m == 8) _mm256_storeu_ps(dst + (h + i) * ld + j, v);
        else _mm256_maskstore_ps(dst + (h + i) * ld + j, k, v);
      }
    }
  }
}

// as sf_dwc_row_generic, runs of 4 columns of two 8-lane halves
__attribute__((target("avx2,fma,f16c")))
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
    #pragma GCC unroll 4
    for (int b = 0; b < 4; ++b)  // (constant indices: a[] stays in registers)
      if (b < nb) {
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
    #pragma GCC unroll 8
    for (int b = 0; b < 8; ++b)  // (constant indices: a[] stays in registers)
      if (b < nb) _mm512_storeu_ps(yt + (ow0 + b) * SF_DWC, a[b]);
  }
}

// Output row oh of one 16-channel block read from the blocked input where it lies (xb: the block's plane
// [H][W][16]; no padded copy): runs of 8 output columns, those whose taps all lie inside the row by whole
// vectors, the edge runs by masked loads (zeros outside the row); bias bv, clamped, stored to yr[OW][16].
// Every access to the accumulators a[] has a constant index once unrolled, so that they stay in registers
// (an edge loop over b < nb put them on the stack, a load and a store around every multiply-add: session 78)
__attribute__((target("avx512f")))
static void sf_dwb_row_avx512(const float* __restrict__ xb, const float* __restrict__ wt,
                              const float* __restrict__ bv, const SfConvGeom& g, int64_t oh, SfClamp clamp,
                              float* __restrict__ yr) {
  const int64_t H = g.H, W = g.W, OW = g.OW, SW = g.SW, DW = g.DW, PL = g.PL, KW = g.KW, KH = g.KH;
  const int64_t S16 = SW * SF_DWC;
  for (int64_t ow0 = 0; ow0 < OW; ow0 += 8) {
    const int64_t nb = std::min<int64_t>(8, OW - ow0);
    const bool inside = nb == 8 && ow0 * SW - PL >= 0 && (ow0 + 7) * SW + (KW - 1) * DW - PL < W;
    __m512 a[8];
    #pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) a[b] = _mm512_loadu_ps(bv);
    if (inside) {
      for (int64_t kh = 0; kh < KH; ++kh) {
        const int64_t ih = oh * g.SH + kh * g.DH - g.PT;
        if (ih < 0 || ih >= H) continue;
        const float* xr = xb + ih * W * SF_DWC;
        for (int64_t kw = 0; kw < KW; ++kw) {
          const __m512 wv = _mm512_loadu_ps(wt + (kh * KW + kw) * SF_DWC);
          const float* xp = xr + (ow0 * SW + kw * DW - PL) * SF_DWC;
          #pragma GCC unroll 8
          for (int b = 0; b < 8; ++b) a[b] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + b * S16), a[b]);
        }
      }
    } else {  // an edge run: a tap's column outside the row (or past the run's last column) reads zeros;
      // which columns those are depends on the tap's column only, so kw is the outer loop
      alignas(64) static const float zeros[SF_DWC] = {};
      for (int64_t kw = 0; kw < KW; ++kw) {
        const int64_t c0 = ow0 * SW + kw * DW - PL;
        int64_t off[8];  // each output column's input column (its offset in a row), or -1: zeros
        #pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) {
          const int64_t c = c0 + b * SW;
          off[b] = b < nb && c >= 0 && c < W ? c * SF_DWC : -1;
        }
        for (int64_t kh = 0; kh < KH; ++kh) {
          const int64_t ih = oh * g.SH + kh * g.DH - g.PT;
          if (ih < 0 || ih >= H) continue;
          const float* xr = xb + ih * W * SF_DWC;
          const __m512 wv = _mm512_loadu_ps(wt + (kh * KW + kw) * SF_DWC);
          #pragma GCC unroll 8
          for (int b = 0; b < 8; ++b)
            a[b] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(off[b] < 0 ? zeros : xr + off[b]), a[b]);
        }
      }
    }
    #pragma GCC unroll 8
    for (int b = 0; b < 8; ++b)  // (constant indices everywhere: a[] stays in registers)
      if (b < nb) _mm512_storeu_ps(yr + (ow0 + b) * SF_DWC, sf_end16(a[b], clamp));
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
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256i sf_bits8(uint32_t bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), sel), sel);
}

// as sf_dwf_generic for a 3x3 kernel, a run as two 8-lane halves, the weights in registers
__attribute__((target("avx2,fma,f16c")))
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
    a0 = sf_end8(a0, clamp);
    a1 = sf_end8(a1, clamp);
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
    a = sf_end16(a, clamp);
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
      a = sf_end16(a, clamp);
      _mm512_mask_storeu_ps(y + oh * OW + ow0, (__mmask16)sf_lane_bits(0, OW - ow0), a);
    }
}
#endif

}  // namespace
