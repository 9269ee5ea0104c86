// ---- Winograd convolution: F(m x m, 3 x 3) (WinogradConv, passes/prepack.py) ------------------------
namespace {

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
// vectors of one column's 8 channels. blk: xp is blocked, [C / 16][Hp][Wp][16] (c0, c1 multiples of 8):
// a pixel's 8 channels are one load.
template <int M>
__attribute__((always_inline)) static inline void sf_wino_in_body(const float* __restrict__ xp, int64_t Hp, int64_t Wp,
                                                                   int64_t C, int64_t TW, int64_t t0, int64_t t1,
                                                                   int64_t c0, int64_t c1, float* __restrict__ V,
                                                                   bool blk) {
  constexpr int A = SfWino<M>::A;
  const int64_t plane = Hp * Wp, xs = (t1 - t0) * C, step = blk ? 16 : 8;
  // blk: both halves of a pixel's line of 16 channels in turn (a half each pass over the tiles read twice
  // as many lines)
  for (int64_t cc = c0; cc < c1; cc += step)
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = cc; c < std::min(c1, cc + step); c += 8) {
        const int nl = (int)std::min<int64_t>(8, c1 - c);
        const float* src = xp + c * plane + (t / TW) * M * Wp + (t % TW) * M;
        SfV8 d[A][A], r[A][A], col[A], rc[A];
        if (blk) {
          const float* b = xp + (c / 16) * plane * 16 + ((t / TW) * M * Wp + (t % TW) * M) * 16 + c % 16;
          for (int i = 0; i < A; ++i)
            for (int j = 0; j < A; ++j) std::memcpy(&d[i][j], b + (i * Wp + j) * 16, sizeof(SfV8));
        }
        for (int i = 0; i < A && !blk; ++i) {
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

// The output tiles [t0, t1) for the channels [o0, o1) from Mt[xi][t - t0][oc] (row stride OC), + bias,
// + res (optional, laid out as y), then clamped. blk: y (and res) is blocked, [OC / 16][OH * OW][16] (o0,
// o1 multiples of 8): a pixel's 8 channels are one store.
template <int M>
__attribute__((always_inline)) static inline void sf_wino_out_body(const float* __restrict__ Mt, int64_t OC, int64_t TW,
                                                                    int64_t OH, int64_t OW, int64_t t0, int64_t t1,
                                                                    int64_t o0, int64_t o1, const float* bias,
                                                                    float* __restrict__ y,
                                                                    const float* __restrict__ res, SfClamp clamp,
                                                                    bool blk) {
  constexpr int A = SfWino<M>::A;
  const int64_t xs = (t1 - t0) * OC, P = OH * OW, step = blk ? 16 : 8;
  // blk: both halves of a pixel's line in turn, as in sf_wino_in_body
  for (int64_t oo = o0; oo < o1; oo += step)
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t oc = oo; oc < std::min(o1, oo + step); oc += 8) {
        const int nl = (int)std::min<int64_t>(8, o1 - oc);
        SfV8 b = {};
        if (bias) for (int l = 0; l < nl; ++l) b[l] = bias[oc + l];
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
        const int64_t bat = (oc / 16) * P * 16 + (oh0 * OW + ow0) * 16 + oc % 16;  // blk: pixel (oh0, ow0)
        for (int i = 0; i < mh; ++i) {
          SfWino<M>::out(r[i], rc);
          for (int j = 0; j < mw; ++j) {
            SfV8 v = rc[j] + b;
            if (clamp.half && res)
              for (int l = 0; l < 8; ++l) v[l] = sf_half1(v[l], clamp);
            if (res && blk) {
              SfV8 rv;
              std::memcpy(&rv, res + bat + (i * OW + j) * 16, sizeof(SfV8));
              v += rv;
            } else if (res) {
              for (int l = 0; l < nl; ++l) v[l] += res[at + l * P + i * OW + j];
            }
            if (clamp.half)
              for (int l = 0; l < 8; ++l) v[l] = sf_half1(v[l], clamp);
            if (clamp.on) {  // a NaN stays NaN (the comparisons are false)
              const SfV8 lo = clamp.lo - SfV8{}, hi = clamp.hi - SfV8{};
              v = v < lo ? lo : v;
              v = hi < v ? hi : v;
            }
            if (blk) std::memcpy(y + bat + (i * OW + j) * 16, &v, sizeof(SfV8));
            else for (int l = 0; l < nl; ++l) y[at + l * P + i * OW + j] = v[l];
          }
        }
      }
}

template <int M>
static void sf_wino_in_generic(const float* xp, int64_t Hp, int64_t Wp, int64_t C, int64_t TW, int64_t t0, int64_t t1,
                               int64_t c0, int64_t c1, float* V, bool blk) {
  sf_wino_in_body<M>(xp, Hp, Wp, C, TW, t0, t1, c0, c1, V, blk);
}
template <int M>
static void sf_wino_out_generic(const float* Mt, int64_t OC, int64_t TW, int64_t OH, int64_t OW, int64_t t0,
                                int64_t t1, int64_t o0, int64_t o1, const float* bias, float* y, const float* res,
                                SfClamp clamp, bool blk) {
  sf_wino_out_body<M>(Mt, OC, TW, OH, OW, t0, t1, o0, o1, bias, y, res, clamp, blk);
}
#if defined(__x86_64__)
template <int M>
__attribute__((target("avx2,fma")))
static void sf_wino_in_avx2(const float* xp, int64_t Hp, int64_t Wp, int64_t C, int64_t TW, int64_t t0, int64_t t1,
                            int64_t c0, int64_t c1, float* V, bool blk) {
  sf_wino_in_body<M>(xp, Hp, Wp, C, TW, t0, t1, c0, c1, V, blk);
}
template <int M>
__attribute__((target("avx2,fma")))
static void sf_wino_out_avx2(const float* Mt, int64_t OC, int64_t TW, int64_t OH, int64_t OW, int64_t t0, int64_t t1,
                             int64_t o0, int64_t o1, const float* bias, float* y, const float* res,
                             SfClamp clamp, bool blk) {
  sf_wino_out_body<M>(Mt, OC, TW, OH, OW, t0, t1, o0, o1, bias, y, res, clamp, blk);
}
#endif

// y[n] = conv3x3(x[n], w) + bias for n < nimg (x: [nimg, C, H, W], y: [nimg, OC, OH, OW], stride 1, pads
// g.PT/g.PL at the start), from U = [A*A][ceil(OC / SF_PANEL)][C][SF_PANEL] (the weights' transform, its
// [C][OC] matrix per position in GEMM panels); epi, res and clamp as in sf_conv2d (res and clamp applied by
// the output transform); blk (SF_BLK_IN, SF_BLK_OUT): x, or y and res (and what epi finishes), blocked by 16
// channels
template <int M>
static void sf_conv2d_winograd(const float* x, const float* U, const float* bias, float* y, const SfConvGeom& g,
                               int64_t nimg, int64_t OC, unsigned blk = 0, SfConvEpi epi = nullptr,
                               const void* ctx = nullptr, const float* res = nullptr, SfClamp clamp = {}) {
  constexpr int A = SfWino<M>::A, A2 = A * A;
  auto in = sf_wino_in_generic<M>;
  auto out = sf_wino_out_generic<M>;
#if defined(__x86_64__)
  if (sf_avx2_helpers()) { in = sf_wino_in_avx2<M>; out = sf_wino_out_avx2<M>; }
#endif
  const int64_t C = g.C, OH = g.OH, OW = g.OW, P = OH * OW;
  if (nimg <= 0 || OC <= 0 || P <= 0) return;
  const bool bi = blk & SF_BLK_IN, bo = blk & SF_BLK_OUT;
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
  {  // every chunk reads all of U: when U is beyond the L2 and that is more traffic than one chunk per image
     // whose V and M leave the caches (written and read once more), take one chunk
    const double ubytes = 4.0 * A2 * upos, spill = 2.0 * 4.0 * A2 * T * (C + OC);
    if (nch > 1 && ubytes > 1048576.0 && (nch - 1) * ubytes > spill) nch = 1;
  }
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
    for (int64_t pl = 0; pl < nimg * C; pl += bi ? 16 : 1) {  // a plane, or a block of 16 (bi)
      if (bi) sf_pad_blocked(x + pl * g.H * g.W, g.H, g.W, g.PT, g.PL, Hp, Wp, xpad + pl * Hp * Wp);
      else sf_pad_plane(x + pl * g.H * g.W, g.H, g.W, g.PT, g.PL, Hp, Wp, xpad + pl * Hp * Wp);
    }
    if (whole) {
      float* V = static_cast<float*>(sf_workspace(4, sizeof(float) * (vsz + msz)));
      float* Mt = V + vsz;
      #pragma omp for schedule(static)
      for (int64_t wk = 0; wk < nwork; ++wk) {
        const int64_t n = wk / nch, t0 = tile0(wk % nch), t1 = tile0(wk % nch + 1), tb = t1 - t0;
        in(xpad + n * C * Hp * Wp, Hp, Wp, C, TW, t0, t1, 0, C, V, bi);
        gemms(tb, V, Mt, 0, A2);
        float* yn = y + n * OC * P;
        out(Mt, OC, TW, OH, OW, t0, t1, 0, OC, epi ? nullptr : bias, yn, res ? res + n * OC * P : nullptr, clamp, bo);
        if (epi) finish(n, 0, OC, t0, t1);
      }
    } else {
      float* V = shared;
      float* Mt = V + vsz;
      const int64_t ncb = (C + 7) / 8, nob = (OC + 7) / 8;
      for (int64_t wk = 0; wk < nwork; ++wk) {
        const int64_t n = wk / nch, t0 = tile0(wk % nch), t1 = tile0(wk % nch + 1), tb = t1 - t0;
        #pragma omp for schedule(static)
        for (int64_t cb = 0; cb < ncb; ++cb)
          in(xpad + n * C * Hp * Wp, Hp, Wp, C, TW, t0, t1, 8 * cb, std::min(C, 8 * cb + 8), V, bi);
        #pragma omp for schedule(static)
        for (int64_t xi = 0; xi < A2; ++xi) gemms(tb, V, Mt, xi, xi + 1);
        float* yn = y + n * OC * P;
        #pragma omp for schedule(static)
        for (int64_t ob = 0; ob < nob; ++ob) {
          const int64_t o0 = 8 * ob, o1 = std::min(OC, o0 + 8);
          out(Mt, OC, TW, OH, OW, t0, t1, o0, o1, epi ? nullptr : bias, yn, res ? res + n * OC * P : nullptr, clamp,
              bo);
          if (epi) finish(n, o0, o1, t0, t1);
        }
      }
    }
  }
}

}  // namespace
