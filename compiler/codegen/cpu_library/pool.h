// ---- Max pools of windows 2 or 3 wide at horizontal stride 2 (AVX-512) ------------------------------
namespace {

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

// A blocked input with AVX-512: items (image, block of 16 channels, band of output rows), each output row read
// from the blocked input where it lies (sf_dwb_row_avx512), stored blocked (bout) or transposed into the
// block's 16 planes. ocm 1.
static void sf_conv_depthwise_blocked(const float* x, const float* w, const float* bias, float* y,
                                      const SfConvGeom& g, int64_t nimg, int64_t C, bool bout, SfConvEpi epi,
                                      const void* ctx, SfClamp clamp) {
#if defined(__x86_64__)
  const int64_t T = g.KH * g.KW, ncb = C / SF_DWC, HW = g.H * g.W, OP = g.OH * g.OW;
  // bands of about 4K output floats per item (a few rows), so that small planes of many blocks still share out
  const int64_t BR = std::clamp<int64_t>(4096 / (g.OW * SF_DWC), 1, g.OH), nbands = (g.OH + BR - 1) / BR;
  const int64_t items = nimg * ncb * nbands;
  const bool par = sf_max_threads() > 1 && items > 1 && (double)nimg * C * OP * T >= SF_CONV_PAR_WORK;
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t band = it % nbands, cb = it / nbands % ncb, n = it / (nbands * ncb);
    const int64_t c0 = cb * SF_DWC, oh0 = band * BR, nb = std::min(BR, g.OH - oh0);
    float* wt = static_cast<float*>(sf_workspace(3, sizeof(float) * ((T + 1) * SF_DWC + (g.OW + 8) * SF_DWC)));
    float* bv = wt + T * SF_DWC;
    float* yt = bv + SF_DWC;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < SF_DWC; ++c) wt[t * SF_DWC + c] = w[(c0 + c) * T + t];
    for (int64_t c = 0; c < SF_DWC; ++c) bv[c] = bias ? bias[c0 + c] : 0.0f;
    const float* xb = x + (n * ncb + cb) * HW * SF_DWC;
    for (int64_t r = 0; r < nb; ++r) {
      const int64_t oh = oh0 + r;
      if (bout) {
        sf_dwb_row_avx512(xb, wt, bv, g, oh, clamp, y + ((n * ncb + cb) * g.OH + oh) * g.OW * SF_DWC);
      } else {
        sf_dwb_row_avx512(xb, wt, bv, g, oh, clamp, yt);
        sf_from_vec16_avx2(yt, g.OW, SF_DWC, y + (n * C + c0) * OP + oh * g.OW, OP, SfClamp{});
      }
    }
    if (epi) epi(ctx, n, c0, c0 + SF_DWC, oh0 * g.OW, (oh0 + nb) * g.OW);
  }
#else
  (void)x; (void)w; (void)bias; (void)y; (void)g; (void)nimg; (void)C; (void)bout; (void)epi; (void)ctx; (void)clamp;
#endif
}

// blk (SF_BLK_IN, SF_BLK_OUT; ocm 1, C a multiple of 16): x, or y, in the blocked layout [N, C/16, H, W, 16]
// (passes/layout.py), whose pixels are the blocks' 16-channel vectors already: a band's input rows are copied
// as they are (no transposition), and output rows are stored where the row kernels write them.
static void sf_conv_depthwise(const float* x, const float* w, const float* bias, float* y, const SfConvGeom& g,
                              int64_t nimg, int64_t C, int64_t ocm, unsigned blk = 0, SfConvEpi epi = nullptr,
                              const void* ctx = nullptr, SfClamp clamp = {}) {
  const int64_t T = g.KH * g.KW, ncb = (C + SF_DWC - 1) / SF_DWC, HW = g.H * g.W, OP = g.OH * g.OW, OC = C * ocm;
  if (nimg <= 0 || OC <= 0 || OP <= 0) return;
  const bool bin = blk & SF_BLK_IN, bout = blk & SF_BLK_OUT;
  if (!blk && sf_dwf_fits(g)) { sf_conv_depthwise_flat(x, w, bias, y, g, nimg, C, ocm, epi, ctx, clamp); return; }
  if (!blk && sf_dws2_fits(g)) { sf_conv_depthwise_s2(x, w, bias, y, g, nimg, C, ocm, epi, ctx, clamp); return; }
  if (bin && sf_dw_isa() == 2) { sf_conv_depthwise_blocked(x, w, bias, y, g, nimg, C, bout, epi, ctx, clamp); return; }
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
      if (bin) {  // the block's row: its pixels' 16 channels as they lie
        std::memcpy(d + jlo * SF_DWC, x + (((n * ncb + cb) * g.H + ih) * g.W + (jlo - g.PL)) * SF_DWC,
                    sizeof(float) * (jhi - jlo) * SF_DWC);
      } else {
        const float* src = xc + ih * g.W + (jlo - g.PL);
#if defined(__x86_64__)
        if (isa) sf_to_vec16_avx2(src, HW, nc, jhi - jlo, d + jlo * SF_DWC);
        else
#endif
          sf_to_vec16_generic(src, HW, nc, jhi - jlo, d + jlo * SF_DWC);
      }
      std::memset(d + jhi * SF_DWC, 0, sizeof(float) * (Wp - jhi) * SF_DWC);
    }
    std::memset(xt + nrows * Wp * SF_DWC, 0, sizeof(float) * sf_dwc_room(g));
    float* yc = y + (n * OC + c0 * ocm + j) * OP;  // its channels ocm planes apart
    for (int64_t r = 0; r < nb; ++r) {
      // a blocked output row is the row kernels' own layout: written in place, then clamped
      float* yr = bout ? y + ((n * ncb + cb) * g.OH + oh0 + r) * g.OW * SF_DWC : yt;
#if defined(__x86_64__)
      if (isa == 2) sf_dwc_row_avx512(xt, Wp, wt, bv, g, r, yr);
      else if (isa == 1) sf_dwc_row_avx2(xt, Wp, wt, bv, g, r, yr);
      else
#endif
        sf_dwc_row_generic(xt, Wp, wt, bv, g, r, yr);
      if (bout) {
        if (clamp.on)
          for (int64_t k = 0; k < g.OW * SF_DWC; ++k) yr[k] = sf_clamp(yr[k], clamp);
        continue;
      }
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

}  // namespace
