// ---- 3-D convolution --------------------------------------------------------------------------------
namespace {

// A conv over 3 spatial dims runs the 2-D conv's tiles (sf_conv_tile) on each output depth slice od: there B's
// row (c, kd, kh, kw) is input slice od * SD + kd * DD of the (padded) volume read over the slice's 2-D output
// grid at tap (kh, kw), at offset ((c * npl + kd * DD) * Hp + kh * DH) * Wp + kw * DW from the slice's base
// (npl: the planes of a channel that the copy holds): the same offsets for every slice. So B is read in place or
// packed per tile as in 2-D, and nothing is copied but the padded volume, by chunks of output slices (the im2col
// slabs this replaced were written and then packed again: rfcs/0002 "3-D convs read in place").

// The most bytes a chunk's padded copy holds (SHARDFLOW_CONV3D_PAD_BYTES overrides it, for tests); a chunk is
// one output slice at least
static double sf_conv3d_pad_bytes() {
  const char* v = std::getenv("SHARDFLOW_CONV3D_PAD_BYTES");
  return v ? std::atof(v) : 32.0 * (1 << 20);
}

struct SfConv3Geom { int64_t C, D, H, W, KD, KH, KW, SD, SH, SW, DD, DH, DW, PF, PT, PL, OD, OH, OW; };

// y[n, gi*ocg + o] = the conv of x[n, gi*C : (gi+1)*C] ([D][H][W] each) with w[gi*ocg + o] ([C][KD][KH][KW]),
// + bias[gi*ocg + o], for every image n < nimg and group gi < groups; then, as the kernels store it, + res (a
// tensor shaped as y: a residual; null: none) and the clamp (SfFin). The padded volume's offsets are int32: the
// caller keeps g.C * Dp * Hp * Wp below 2^31 (templates_cpu._conv3d).
static void sf_conv3d(const float* x, const float* w, const float* bias, float* y, const SfConv3Geom& g,
                      int64_t nimg, int64_t groups, int64_t ocg, const float* res = nullptr, SfClamp clamp = {}) {
  const SfCukr& u = sf_cukr();
  const int64_t M = ocg, P2 = g.OH * g.OW, P = g.OD * P2, K = g.C * g.KD * g.KH * g.KW;
  if (nimg <= 0 || groups <= 0 || M <= 0 || P <= 0) return;
  const int64_t mr = u.mr, vl = u.vl, nrm = u.nv * u.vl;
  const int64_t nkb = std::max<int64_t>(1, (K + SF_KC - 1) / SF_KC), kcb = std::max<int64_t>(1, (K + nkb - 1) / nkb);
  const int nt = sf_max_threads();
  const bool par = nt > 1 && (double)nimg * groups * M * P * K >= SF_CONV_PAR_WORK;
  // the padded volumes, [nimg * groups * C][Dp][Hp][Wp], the input at (PF, PT, PL), are copied by chunks of cd
  // output depth slices, each reading npl planes of every channel, so that a chunk's copy stays under
  // sf_conv3d_pad_bytes() (a whole padded [1, 32, 128, 128, 128] was 281 MB); unpadded, x is read in place
  const int64_t Dp = std::max(g.D + g.PF, (g.OD - 1) * g.SD + (g.KD - 1) * g.DD + 1);
  const int64_t Hp = std::max(g.H + g.PT, (g.OH - 1) * g.SH + (g.KH - 1) * g.DH + 1);
  const int64_t Wp = std::max(g.W + g.PL, (g.OW - 1) * g.SW + (g.KW - 1) * g.DW + 1);
  const int64_t plane = Hp * Wp, nvol = nimg * groups * g.C, reach = (g.KD - 1) * g.DD + 1;
  const bool padded = Dp != g.D || Hp != g.H || Wp != g.W;
  int64_t cd = g.OD, npl = Dp;
  const double cap = sf_conv3d_pad_bytes();
  if (padded && (double)nvol * Dp * plane * sizeof(float) > cap) {
    const int64_t fit = (int64_t)(cap / ((double)nvol * plane * sizeof(float)));
    cd = std::min(g.OD, std::max<int64_t>(1, (fit - reach) / g.SD + 1));
    npl = (cd - 1) * g.SD + reach;
  }
  const int64_t vol = npl * plane;
  float* xpad = padded ? static_cast<float*>(sf_workspace(3, sizeof(float) * nvol * vol)) : nullptr;
  const SfConvGeom gs = {g.C, Hp, Wp, g.KH, g.KW, g.SH, g.SW, g.DH, g.DW, 0, 0, g.OH, g.OW};
  // unpacked: B read in place where the ISA has the kernels and the W stride is 1; measured on Zen 4 (rfcs/0002
  // "3-D convs read in place"), a 3-D UNet's convs (K = 27..1728, M = 3..64, rows of 16..64 pixels) took
  // 0.69-0.97x the packed time. Convs of 1024 outputs or more pack, as in 2-D (their panels are reused more).
  const bool unpacked = u.dfn[0][0][0] && g.SW == 1 && M < 1024 && g.OW >= vl;
  const bool finish = bias || res || clamp.on || clamp.half;  // the kernels finish y on the last K block
  int32_t* off = static_cast<int32_t*>(sf_workspace(4, sizeof(int32_t) * K));
  for (int64_t c = 0, k = 0; c < g.C; ++c)
    for (int64_t kd = 0; kd < g.KD; ++kd)
      for (int64_t kh = 0; kh < g.KH; ++kh)
        for (int64_t kw = 0; kw < g.KW; ++kw)
          off[k++] = (int32_t)(((c * npl + kd * g.DD) * Hp + kh * g.DH) * Wp + kw * g.DW);
  #pragma omp parallel num_threads(nt) if (par)
  for (int64_t od0 = 0; od0 < g.OD; od0 += cd) {
    const int64_t cdc = std::min(cd, g.OD - od0);  // this chunk's output slices
    if (padded) {
      #pragma omp for schedule(static)
      for (int64_t s = 0; s < nvol * npl; ++s) {
        const int64_t id = od0 * g.SD + s % npl - g.PF;
        float* dst = xpad + s * plane;
        if (id >= 0 && id < g.D) sf_pad_plane(x + (s / npl * g.D + id) * g.H * g.W, g.H, g.W, g.PT, g.PL, Hp, Wp, dst);
        else std::fill(dst, dst + plane, 0.0f);
      }
    }
    const float* xs = padded ? xpad : x;  // (unpadded: one chunk of every slice)
    const SfConvTiles tl = sf_conv_tiles(nimg * groups * cdc, M, P2, mr, nrm, K, nkb, par, nt);  // (a slice's columns)
    float* Bp = unpacked ? nullptr : sf_conv_panels(tl, K, kcb, nrm);
    int64_t packed = -1;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tl.ntask; ++t) {
      const SfTile tile = tl.at(t);  // tile.col: (image, group, slice of the chunk, column tile)
      const int64_t sl = tile.col / tl.ntn, odl = sl % cdc, od = od0 + odl, ng = sl / cdc, gi = ng % groups;
      const SfFin fin = {bias ? bias + gi * M : nullptr, res ? res + ng * M * P + od * P2 : nullptr, clamp};
      const bool pack = !tl.keep || packed != tile.col;
      packed = tile.col;
      sf_conv_tile(u, unpacked, xs + ng * g.C * vol + odl * g.SD * plane, Hp, Wp, gs, off, w + gi * M * K, K, nkb,
                   kcb, y + ng * M * P + od * P2, P, tile, Bp, pack, tl.keep, tl.npt, finish ? &fin : nullptr);
    }  // (the barrier: the next chunk's copy overwrites this one's)
  }
}

}  // namespace
