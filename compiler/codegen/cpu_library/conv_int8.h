// ---- Integer convolution (PackedConvInteger: uint8/int8 image times a packed int8 weight, int32 sums) --
namespace {

// Per image and group, the output [OCg][P] (P = OH * OW pixels) is the integer GEMM of the weight's rows
// (A': packed at compile time by ops.conv.pack_int8_conv, each output channel's taps less their least as
// unsigned bytes, Kp apart, with their sums and zero points) by the im2col matrix of the image (B: packed
// here into the GEMM's panels, b' = x or x - 128 as signed bytes, and their column sums): the output comes
// out in the image's layout, nothing to transpose. Padding taps read the image's zero point (0 after the
// shift, as ONNX pads ConvInteger). Columns past P in the last panel hold any bytes: the GEMM stores none.

// the panels [ceil(P / 16)][Kp / 4][16][4] and column terms bc[2][16 * panels] of the im2col matrix [K][P],
// b' = v ^ flip; bz: the zero point in b' terms (the padding's value). panel(j0, cols) gives, for the columns
// [j0, j0 + cols), a function taps(k, tmp) of 16 readable bytes holding row k there (k < K): a pointer into
// the image, or tmp filled
template <typename Panel>
static void sf_i8_pack_cols(int64_t K, int64_t P, Panel panel, uint8_t flip, int32_t bz, int8_t* __restrict__ bp,
                            int32_t* __restrict__ bc, bool par) {
  const int64_t np = (P + 15) / 16, ngp = sf_i8_groups(K), ng = (K + 3) / 4;
  int32_t* bsum = bc + 16 * np;
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t p = 0; p < np; ++p) {
    const int64_t j0 = 16 * p, cols = std::min<int64_t>(16, P - j0);
    int8_t* dst = bp + p * ngp * 64;
    const auto taps = panel(j0, cols);
    alignas(16) int32_t sum[16] = {};
#if defined(__x86_64__)
    // four rows of 16 bytes into 16 groups of 4 (one panel row), flipped; the column sums of the signed
    // bytes: pairs by maddubs with ones, then pairs of pairs by madd
    const __m128i f = _mm_set1_epi8(char(flip)), ones8 = _mm_set1_epi8(1), ones16 = _mm_set1_epi16(1);
    __m128i acc[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
    alignas(16) uint8_t part[16];
    auto load = [&](int64_t k) {
      if (k >= K) return _mm_setzero_si128();  // (b' = 0 past K)
      return _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(taps(k, part))), f);
    };
    for (int64_t g = 0; g < ng; ++g) {
      const __m128i r0 = load(4 * g), r1 = load(4 * g + 1), r2 = load(4 * g + 2), r3 = load(4 * g + 3);
      const __m128i t0 = _mm_unpacklo_epi8(r0, r1), t1 = _mm_unpackhi_epi8(r0, r1);
      const __m128i t2 = _mm_unpacklo_epi8(r2, r3), t3 = _mm_unpackhi_epi8(r2, r3);
      const __m128i o[4] = {_mm_unpacklo_epi16(t0, t2), _mm_unpackhi_epi16(t0, t2), _mm_unpacklo_epi16(t1, t3),
                            _mm_unpackhi_epi16(t1, t3)};
      for (int h = 0; h < 4; ++h) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64 * g + 16 * h), o[h]);
        acc[h] = _mm_add_epi32(acc[h], _mm_madd_epi16(_mm_maddubs_epi16(ones8, o[h]), ones16));
      }
    }
    for (int h = 0; h < 4; ++h) _mm_store_si128(reinterpret_cast<__m128i*>(sum + 4 * h), acc[h]);
#else
    uint8_t part[16];
    for (int64_t g = 0; g < ng; ++g)
      for (int q = 0; q < 4; ++q) {
        const int64_t k = 4 * g + q;
        const uint8_t* v = k < K ? taps(k, part) : nullptr;
        for (int c = 0; c < 16; ++c) {
          const int8_t b = v && c < cols ? int8_t(v[c] ^ flip) : int8_t(0);
          dst[64 * g + 4 * c + q] = b;
          sum[c] += b;
        }
      }
#endif
    std::memset(dst + 64 * ng, 0, 64 * (ngp - ng));
    for (int c = 0; c < 16; ++c) {
      bc[j0 + c] = bz;
      bsum[j0 + c] = c < cols ? sum[c] : 0;
    }
  }
}

// ---- the im2col gathers of the integer and bfloat16 convs (this file and conv_bf16.h) ----
// The padded extents of a conv's image: every tap of every output pixel lies inside [Hp][Wp]
static inline void sf_conv_padded(const SfConvGeom& g, int64_t& Hp, int64_t& Wp) {
  Hp = std::max(g.H + g.PT, (g.OH - 1) * g.SH + (g.KH - 1) * g.DH + 1);
  Wp = std::max(g.W + g.PL, (g.OW - 1) * g.SW + (g.KW - 1) * g.DW + 1);
}

// koff[k]: tap k's (channel, row, column of the window) offset in the padded image [Cg][Hp][Wp], its value at
// output pixel (0, 0)
static void sf_conv_tap_offsets(const SfConvGeom& g, int64_t K, int64_t Hp, int64_t Wp, int64_t* koff) {
  for (int64_t k = 0; k < K; ++k) {
    const int64_t c = k / (g.KH * g.KW), r = k / g.KW % g.KH, t = k % g.KW;
    koff[k] = c * Hp * Wp + r * g.DH * Wp + t * g.DW;
  }
}

// xp [Cg][Hp][Wp] = the group's image xg [Cg][H][W] with `fill` around it, and `slack` values of fill after
template <typename T>
static void sf_conv_pad_image(const T* xg, const SfConvGeom& g, int64_t Cg, int64_t Hp, int64_t Wp, T fill,
                              int64_t slack, T* xp, bool par) {
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t c = 0; c < Cg; ++c) {
    T* dst = xp + c * Hp * Wp;
    std::fill_n(dst, g.PT * Wp, fill);
    for (int64_t h = 0; h < g.H; ++h) {
      T* d = dst + (g.PT + h) * Wp;
      std::fill_n(d, g.PL, fill);
      std::memcpy(d + g.PL, xg + (c * g.H + h) * g.W, sizeof(T) * g.W);
      std::fill_n(d + g.PL + g.W, Wp - g.PL - g.W, fill);
    }
    std::fill_n(dst + (g.PT + g.H) * Wp, (Hp - g.PT - g.H) * Wp, fill);
  }
  std::fill_n(xp + Cg * Hp * Wp, slack, fill);
}

// pix[q]: the offset of output pixel j0 + q (q < cols) in the padded image, from a tap's; whether the pixels lie
// in one output row
static inline bool sf_conv_panel_pixels(const SfConvGeom& g, int64_t Wp, int64_t j0, int64_t cols, int64_t* pix) {
  const int64_t oh = j0 / g.OW, ow = j0 % g.OW;
  for (int64_t q = 0, h = oh, w = ow; q < cols; ++q) {
    pix[q] = h * g.SH * Wp + w * g.SW;
    if (++w == g.OW) { w = 0; ++h; }
  }
  return ow + cols <= g.OW;
}

// y[n][oc][P] (int32) = sum over the taps of (w - wzp)(x - xzp) for x [N][C][H][W] (bytes, signed when x_signed;
// xzp: nullptr or one value of x's type), the weight as wa [OCp][Kp] (bytes a') with wc[2][OCp] (row 0 the
// zero point z in a' terms, a' - z = w - wzp; row 1 the sums of a' over its K taps), groups of C / group
// channels and OC / group outputs
static void sf_iconv2d(const void* xv, bool x_signed, const void* xzp, const uint8_t* wa, const int32_t* wc,
                       int32_t* y, int64_t N, int64_t OC, int64_t group, const SfConvGeom& g, int64_t OCp) {
  const int64_t Cg = g.C / group, OCg = OC / group, P = g.OH * g.OW, K = Cg * g.KH * g.KW;
  const int64_t Kp = SF_I8_KSTEP * ((K + SF_I8_KSTEP - 1) / SF_I8_KSTEP), np = (P + 15) / 16;
  const uint8_t* x = static_cast<const uint8_t*>(xv);
  const uint8_t flip = x_signed ? 0 : 0x80;  // b' = x (int8) or x - 128 (uint8) as a signed byte
  const uint8_t zraw = xzp ? *static_cast<const uint8_t*>(xzp) : 0;
  const int32_t bz = int32_t(int8_t(uint8_t(zraw ^ flip)));
  const bool par = sf_max_threads() > 1 && (double)OCg * P * K >= 1048576.0;
  const bool direct = g.KH == 1 && g.KW == 1 && g.SH == 1 && g.SW == 1 && g.PT == 0 && g.PL == 0 && g.OH == g.H
                      && g.OW == g.W;
  // the group's image with its padding in it (zero points): [Cg][Hp][Wp], 32 bytes of slack after
  int64_t Hp, Wp;
  sf_conv_padded(g, Hp, Wp);
  // the panels and their column terms
  const size_t panel_bytes = size_t(np) * sf_i8_groups(K) * 64;
  char* ws = static_cast<char*>(sf_workspace(3, panel_bytes + sizeof(int32_t) * 32 * np + 64));
  int8_t* bp = reinterpret_cast<int8_t*>(ws);
  int32_t* bc = reinterpret_cast<int32_t*>(ws + panel_bytes);
  // the padded image and each tap's offset in it (its value at output pixel (0, 0))
  char* ws4 = static_cast<char*>(sf_workspace(4, direct ? 64 : sizeof(int64_t) * K + Cg * Hp * Wp + 32));
  int64_t* koff = reinterpret_cast<int64_t*>(ws4);
  uint8_t* xp = reinterpret_cast<uint8_t*>(ws4 + sizeof(int64_t) * K);
  if (!direct) sf_conv_tap_offsets(g, K, Hp, Wp, koff);
  // the weight's rows in the kernel's form: bytes (AMX, VNNI, portable) or int16 (AVX2)
  const bool wide = !sf_i8_on_amx(OCg) && sf_i8_kernel().wide;
  int16_t* wide_rows = nullptr;
  if (wide) {
    wide_rows = static_cast<int16_t*>(sf_workspace(2, sizeof(int16_t) * OCp * Kp));
    for (int64_t i = 0; i < OCp * Kp; ++i) wide_rows[i] = int16_t(wa[i]);
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t gi = 0; gi < group; ++gi) {
      const uint8_t* xg = x + (n * g.C + gi * Cg) * g.H * g.W;
      if (direct) {
        sf_i8_pack_cols(K, P, [&](int64_t j0, int64_t cols) {
          return [=](int64_t k, uint8_t* tmp) -> const uint8_t* {
            if (cols == 16) return xg + k * P + j0;
            std::memcpy(tmp, xg + k * P + j0, cols);
            return tmp;
          };
        }, flip, bz, bp, bc, par);
      } else {
        sf_conv_pad_image<uint8_t>(xg, g, Cg, Hp, Wp, zraw, 32, xp, par);
        // (a panel's pixels in one output row are, at stride 1, 16 bytes in a row of the padded image (or
        // fewer and slack after), at stride 2 the even bytes of 32; else gathered one by one)
        struct Taps {
          const uint8_t* xp;
          const int64_t* koff;
          int64_t pix[16];
          int64_t cols;
          int one_row;  // the stride of a panel in one output row (1 or 2), else 0
          const uint8_t* operator()(int64_t k, uint8_t* tmp) const {
            const uint8_t* base = xp + koff[k];
            if (one_row == 1) return base + pix[0];
#if defined(__x86_64__)
            if (one_row == 2) {
              const __m128i lo = _mm_set1_epi16(0x00FF);
              const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + pix[0]));
              const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + pix[0] + 16));
              _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp),
                               _mm_packus_epi16(_mm_and_si128(a, lo), _mm_and_si128(b, lo)));
              return tmp;
            }
#endif
            for (int64_t q = 0; q < cols; ++q) tmp[q] = base[pix[q]];
            return tmp;
          }
        };
        sf_i8_pack_cols(K, P, [&](int64_t j0, int64_t cols) {
          Taps t{xp, koff, {}, cols, 0};
          if (sf_conv_panel_pixels(g, Wp, j0, cols, t.pix) && (g.SW == 1 || g.SW == 2)) t.one_row = int(g.SW);
          return t;
        }, flip, bz, bp, bc, par);
      }
      const int64_t r0 = gi * OCg;
      const void* Ap = wide ? static_cast<const void*>(wide_rows + r0 * Kp) : static_cast<const void*>(wa + r0 * Kp);
      sf_igemm_rows(OCg, P, K, Ap, Kp, wc + OCp + r0, wc + r0, bp, bc, y + (n * OC + r0) * P, P, true);
    }
}

}  // namespace
