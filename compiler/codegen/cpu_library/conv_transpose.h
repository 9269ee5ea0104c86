// ---- Transposed convolution (ConvTranspose over 1 or 2 spatial dims) ------------------------------
namespace {

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

// The same over 3 spatial dims (no epilogue): per image, group and slab of input depth slices, cols[OCG*KD*KH*KW,
// slab voxels] = W_g^T @ x_g[:, slab] by the GEMM, then each output channel folds them in: tap (kd, kh, kw) of
// input voxel (id, ih, iw) adds to output voxel (id*SD - PF + kd*DD, ih*SH - PT + kh*DH, iw*SW - PL + kw*DW)
// where that lies in the output, which starts as the bias. Slabs keep cols within 16 MB (or one slice).
// g holds ICG as C, the input D x H x W and the output OD x OH x OW.
static void sf_conv_transpose3d(const float* x, const float* w, const float* bias, float* y, const SfConv3Geom& g,
                                int64_t nimg, int64_t groups, int64_t ocg) {
  const int64_t ICG = g.C, HW = g.H * g.W, P = g.D * HW, KK = g.KD * g.KH * g.KW, M = ocg * KK;
  const int64_t OHW = g.OH * g.OW, OP = g.OD * OHW;
  if (nimg <= 0 || groups <= 0 || ocg <= 0 || OP <= 0) return;
  const int64_t slab = std::clamp<int64_t>((int64_t(1) << 22) / std::max<int64_t>(M * HW, 1), 1,
                                           std::max<int64_t>(g.D, 1));
  float* cols = static_cast<float*>(sf_workspace(3, sizeof(float) * M * slab * HW));
  const bool par = sf_max_threads() > 1 && (double)M * slab * HW * ICG >= SF_CONV_PAR_WORK;
  for (int64_t ng = 0; ng < nimg * groups; ++ng) {
    const int64_t gi = ng % groups;
    float* yg = y + ng * ocg * OP;
    #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && ocg * OP >= 65536)
    for (int64_t oc = 0; oc < ocg; ++oc) {
      const float bv = bias ? bias[gi * ocg + oc] : 0.0f;
      float* __restrict__ yp = yg + oc * OP;
      for (int64_t i = 0; i < OP; ++i) yp[i] = bv;
    }
    for (int64_t d0 = 0; d0 < g.D; d0 += slab) {
      const int64_t nd = std::min(slab, g.D - d0), ld = nd * HW;
      sf_sgemm(M, ld, ICG, w + gi * ICG * M, 1, M, x + ng * ICG * P + d0 * HW, P, 1, cols, ld, 1.0f, nullptr, 0, 0,
               true);
      #pragma omp parallel for schedule(static) if (par)
      for (int64_t oc = 0; oc < ocg; ++oc) {
        float* __restrict__ yp = yg + oc * OP;
        for (int64_t kd = 0; kd < g.KD; ++kd)
          for (int64_t kh = 0; kh < g.KH; ++kh) {
            const int64_t ro = kh * g.DH - g.PT;
            int64_t h0, h1;
            sf_inside(ro, g.SH, g.OH, g.H, h0, h1);
            for (int64_t kw = 0; kw < g.KW; ++kw) {
              const int64_t co = kw * g.DW - g.PL;
              int64_t w0, w1;
              sf_inside(co, g.SW, g.OW, g.W, w0, w1);
              const float* c = cols + ((oc * g.KD + kd) * g.KH * g.KW + kh * g.KW + kw) * ld;
              for (int64_t id = d0; id < d0 + nd; ++id) {
                const int64_t od = id * g.SD - g.PF + kd * g.DD;
                if (od < 0 || od >= g.OD) continue;
                for (int64_t ih = h0; ih < h1; ++ih) {
                  float* __restrict__ yr = yp + od * OHW + (ih * g.SH + ro) * g.OW + co;
                  const float* __restrict__ cr = c + (id - d0) * HW + ih * g.W;
                  if (g.SW == 1) { for (int64_t iw = w0; iw < w1; ++iw) yr[iw] += cr[iw]; }
                  else { for (int64_t iw = w0; iw < w1; ++iw) yr[iw * g.SW] += cr[iw]; }
                }
              }
            }
          }
      }
    }
  }
}

}  // namespace
