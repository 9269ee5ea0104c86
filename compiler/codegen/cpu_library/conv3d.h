// ---- 3-D convolution --------------------------------------------------------------------------------
namespace {

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

}  // namespace
