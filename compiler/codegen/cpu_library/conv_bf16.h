// ---- bfloat16 convolution (PackedConvBf16: bfloat16 image times a bfloat16 weight, float32 sums) ---------
namespace {

// Per image and group, y[OCg][P] = W[OCg][K] . im2col(x)[K][P] (+ bias per output channel) on the bfloat16
// GEMM: the weight's rows as packed at compile time (ops.conv.pack_bf16_conv: Kp apart, zero past K, rows
// up to whole AMX tiles), straight into AMX's tiles (sf_amx_blocks) or vdpbf16ps's blocks (sf_bgemm_dp_blocks),
// else through sf_bgemm_prepacked (both widened); the image's im2col matrix packed here into the GEMM's panels of pairs
// along K ([ceil(P / 16)][Kp / 2][16][2], zero past K) as it is gathered from the image padded with zeros;
// the output in the image's layout: float32, or (bf16_out) rounded to bfloat16 as it is stored; with clamp,
// clamped to [lo, hi] first (a NaN kept: a folded Relu or Clip).

// the rows [i0, i0 + rows) and columns [j0, j0 + cols) of a block of sums (ldt apart) plus the bias of each row,
// clamped, into y (ldy apart; float32 or bfloat16)
static inline void sf_bconv_store(const float* __restrict__ T, int64_t ldt, int64_t rows, int64_t cols, void* y,
                                  int64_t ldy, int64_t i0, int64_t j0, const float* bias, bool bf16_out, bool clamp,
                                  float lo, float hi) {
  // (a NaN fails both comparisons of the _const clamps and is kept; two NaN-propagating selects of sf_max and
  // sf_min and the rounding's were more than GCC 12 if-converts: the loops stayed scalar)
  const float l = lo, h = hi;
  for (int64_t r = 0; r < rows; ++r) {
    const float b = bias ? bias[i0 + r] : 0.0f;
    const float* t = T + r * ldt;
    if (bf16_out) {
      sf_bf16* d = static_cast<sf_bf16*>(y) + (i0 + r) * ldy + j0;
      if (clamp) for (int64_t c = 0; c < cols; ++c) d[c] = sf_float_to_bf16(sf_min_const(sf_max_const(t[c] + b, l), h));
      else for (int64_t c = 0; c < cols; ++c) d[c] = sf_float_to_bf16(t[c] + b);
    } else {
      float* d = static_cast<float*>(y) + (i0 + r) * ldy + j0;
      if (clamp) for (int64_t c = 0; c < cols; ++c) d[c] = sf_min_const(sf_max_const(t[c] + b, l), h);
      else for (int64_t c = 0; c < cols; ++c) d[c] = t[c] + b;
    }
  }
}

static void sf_bconv2d(const sf_bf16* xv, const sf_bf16* w, const float* bias, void* y, int64_t N, int64_t OC,
                       int64_t group, const SfConvGeom& g, bool bf16_out = false, bool clamp = false, float lo = 0.0f,
                       float hi = 0.0f) {
  const int64_t Cg = g.C / group, OCg = OC / group, P = g.OH * g.OW, K = Cg * g.KH * g.KW;
  const int64_t Kp = sf_bf_kp(K), np = (P + 15) / 16;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xv);
  const bool par = sf_max_threads() > 1 && (double)OCg * P * K >= 1048576.0;
  // the group's image with zeros around it: [Cg][Hp][Wp], 16 values of slack after
  int64_t Hp, Wp;
  sf_conv_padded(g, Hp, Wp);
  // (slots 4 and 6: the GEMM takes 1-3)
  char* ws4 = static_cast<char*>(sf_workspace(4, sizeof(int64_t) * K + sizeof(uint16_t) * (Cg * Hp * Wp + 16)));
  int64_t* koff = reinterpret_cast<int64_t*>(ws4);
  uint16_t* xp = reinterpret_cast<uint16_t*>(ws4 + sizeof(int64_t) * K);
  uint16_t* bp = static_cast<uint16_t*>(sf_workspace(6, sizeof(uint16_t) * np * Kp * 16));
  sf_conv_tap_offsets(g, K, Hp, Wp, koff);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t gi = 0; gi < group; ++gi) {
      const uint16_t* xg = x + (n * g.C + gi * Cg) * g.H * g.W;
      sf_conv_pad_image<uint16_t>(xg, g, Cg, Hp, Wp, 0, 16, xp, par);
      #pragma omp parallel for schedule(static) if (par)
      for (int64_t p = 0; p < np; ++p) {
        const int64_t j0 = 16 * p, cols = std::min<int64_t>(16, P - j0);
        int64_t pix[16] = {};
        // (16 values in a row of the padded image where the panel lies in one output row at stride 1)
        const bool contiguous = sf_conv_panel_pixels(g, Wp, j0, cols, pix) && g.SW == 1;
        uint16_t* dst = bp + p * Kp * 16;
        alignas(16) uint16_t v[2][16];
        for (int64_t k0 = 0; k0 < Kp; k0 += 2) {
          for (int q = 0; q < 2; ++q) {
            const int64_t k = k0 + q;
            if (k >= K) {
              std::memset(v[q], 0, sizeof(v[q]));
            } else if (contiguous) {
              std::memcpy(v[q], xp + koff[k] + pix[0], sizeof(v[q]));
            } else {
              const uint16_t* base = xp + koff[k];
              for (int64_t c = 0; c < cols; ++c) v[q][c] = base[pix[c]];
            }
          }
          // the pair (k0, k0 + 1) of each column next to each other
          uint16_t* d = dst + k0 * 16;
          for (int c = 0; c < 16; ++c) {
            d[2 * c] = v[0][c];
            d[2 * c + 1] = v[1][c];
          }
        }
      }
      const int64_t r0 = gi * OCg;
      // (the group's first output value: a float32 or bfloat16 element)
      void* yg = bf16_out ? static_cast<void*>(static_cast<sf_bf16*>(y) + (n * OC + r0) * P)
                          : static_cast<void*>(static_cast<float*>(y) + (n * OC + r0) * P);
      const float* bg = bias ? bias + r0 : nullptr;
#if defined(__x86_64__)
      if (sf_bf16_isa() == SF_ISA_AMX) {
        sf_amx_blocks<false>((OCg + 15) / 16, np, Kp / SF_BF_KSTEP, reinterpret_cast<const char*>(w + r0 * Kp), 2 * Kp,
                             reinterpret_cast<const char*>(bp), 2 * Kp * SF_BF_PANEL, sf_gemm_parallel(OCg, P, K, true),
                             [&](const void* T, int64_t i0, int64_t j0) {
          sf_bconv_store(static_cast<const float*>(T), 32, std::min<int64_t>(32, OCg - i0),
                         std::min<int64_t>(32, P - j0), yg, P, i0, j0, bg, bf16_out, clamp, lo, hi);
        });
        continue;
      }
      if (sf_bf16_isa() == SF_ISA_AVX512BF16) {
        // (the weight's rows are packed as the kernel reads them: no copy; each tile's sums stored as they are
        // finished, with the bias, clamp and rounding)
        sf_bgemm_dp_blocks(OCg, P, K, reinterpret_cast<const uint16_t*>(w + r0 * Kp), bp,
                           sf_gemm_parallel(OCg, P, K, true), [&](const float* T, int64_t j0, int64_t cols) {
          sf_bconv_store(T, 32, OCg, cols, yg, P, 0, j0, bg, bf16_out, clamp, lo, hi);
        });
        continue;
      }
#endif
      if (!clamp && !bf16_out) {
        sf_bgemm_prepacked(OCg, P, K, w + r0 * Kp, Kp, reinterpret_cast<const sf_bf16*>(bp), static_cast<float*>(yg),
                           P, 1.0f, bg, 1, 0, true);
        continue;
      }
      // (the sums into a float32 buffer, then the bias, Relu and rounding as they are stored)
      float* t = static_cast<float*>(sf_workspace(5, sizeof(float) * OCg * P));
      sf_bgemm_prepacked(OCg, P, K, w + r0 * Kp, Kp, reinterpret_cast<const sf_bf16*>(bp), t, P, 1.0f, nullptr, 0, 0,
                         true);
      #pragma omp parallel for schedule(static) if (par)
      for (int64_t r = 0; r < OCg; ++r) sf_bconv_store(t + r * P, P, 1, P, yg, P, r, 0, bg, bf16_out, clamp, lo, hi);
    }
}

}  // namespace
