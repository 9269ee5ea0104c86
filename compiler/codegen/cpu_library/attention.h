// ---- Attention (ONNX Attention, float32) ----------------------------------------------------------
namespace {

// softmax(c^2 Q K^T [softcapped] + bias) V per batch and query head, a block of query rows at a time: the
// scores of the block's keys by the GEMM into a [rows][keys] workspace, the rows' softmax there, then their
// output rows by a second GEMM. Keys that no row of the block may see (causal, windows, nonpad_kv_seqlen,
// a mask with fewer keys) are left out of both GEMMs. Blocks are the threads' tasks (each GEMM on one
// thread), taken dynamically: causal blocks grow with their rows.
struct SfAttn {
  int64_t B, Hq, Hk, S, L, D, Dv;
  int64_t qs[3], ks[3], vs[3], ys[3];  // element strides of (batch, head, row); a row's elements are contiguous
  float c2, cap;                       // the scale of the sums (scale_sqrt squared); softcap, 0 for none
  bool causal;
  int64_t past, left, right;           // causal offset without nonpad (past_len); windows, -1 = unbounded
  int mkind;                           // mask: 0 none, 1 float (added), 2 bool (false excludes the key)
  int64_t ms[3], mlen;                 // the mask's strides along (batch, head, row), 0 = broadcast; its key
                                       // count (its keys are contiguous)
  bool nonpad;                         // nonpad_kv_seqlen given: keys j < nonpad[b]; offset nonpad[b] - S
  bool nanrow;                         // the float mask is a bias added before a Softmax (FuseAttention): a row
                                       // whose every value is -inf is NaN, not ONNX Attention's 0
  bool bias2;                          // a second float bias, added after the mask (FuseAttention's second
  int64_t bs[3];                       // extra bias: T5's mask after its position bias); its strides as ms's,
                                       // its keys all L
  int phalf;                           // the probabilities rounded to a half type's values before they weigh V
                                       // (FuseAttention's probs_dtype at precision float16/bfloat16): 0 none,
                                       // 1 float16, 2 bfloat16
};

// the keys [lo, hi) row i may see before the mask's values (lo >= hi: none)
static inline void sf_attn_range(const SfAttn& a, int64_t i, int64_t off, int64_t npb, int64_t& lo, int64_t& hi) {
  lo = 0; hi = a.L;
  if (a.mkind) hi = std::min(hi, a.mlen);
  if (npb >= 0) hi = std::min(hi, npb);
  if (a.causal) hi = std::min(hi, i + off + 1);
  if (a.right >= 0) hi = std::min(hi, i + off + a.right + 1);
  if (a.left >= 0) lo = std::max(lo, i + off - a.left);
}

// one row of scores s[c0 .. c1) (key j at s[j - c0]) into probabilities, 0 outside the row's keys; the row is
// 0 where every key is excluded (the mask's values -inf included), as ONNX's reference computes; a NaN anywhere
// makes the row NaN (through the sum). `sink` (-inf for none) is one more logit in the maximum and the sum
// (an attention sink: the probabilities then sum to less than 1). a.phalf rounds the probabilities to
// float16's or bfloat16's values as they are normalized. Each step is its own loop, the reductions `omp simd`
// (vectorized).
SF_CLONES
static void sf_attn_row(float* __restrict__ s, int64_t c0, int64_t c1, int64_t lo, int64_t hi, const SfAttn& a,
                        const float* __restrict__ fm, const uint8_t* __restrict__ bm, const float* __restrict__ f2,
                        float sink) {
  float* __restrict__ r = s - c0;
  lo = std::max(lo, c0); hi = std::min(hi, c1);
  for (int64_t j = c0; j < std::min(lo, c1); ++j) r[j] = 0.0f;
  for (int64_t j = std::max(hi, lo); j < c1; ++j) r[j] = 0.0f;
  if (lo >= hi) return;
  const float ninf = -std::numeric_limits<float>::infinity(), c2 = a.c2, cap = a.cap;
  if (cap > 0.0f) {
    const float inv = 1.0f / cap;
    for (int64_t j = lo; j < hi; ++j) r[j] = sf_tanh(r[j] * c2 * inv) * cap;
  } else {
    for (int64_t j = lo; j < hi; ++j) r[j] *= c2;
  }
  bool keep = true;  // keep: some key is left (the mask's values are not all -inf)
  if (a.mkind == 1) {
    float bmax = ninf;
    int nan = 0;  // (an int: GCC left a bool's | reduction scalar, the row 36% of a GPT-2 attention's time)
    #pragma omp simd reduction(max:bmax) reduction(|:nan)
    for (int64_t j = lo; j < hi; ++j) {
      const float b = fm[j];
      nan |= b != b;
      bmax = b > bmax ? b : bmax;
      r[j] += b;
    }
    keep = nan != 0 || bmax != ninf;
    if (f2) {  // (nanrow: a row left without a key is NaN below, as the Softmax of the separate ops gives it)
      #pragma omp simd
      for (int64_t j = lo; j < hi; ++j) r[j] += f2[j];
    }
  } else if (a.mkind == 2) {
    int any = 0;
    #pragma omp simd reduction(|:any)
    for (int64_t j = lo; j < hi; ++j) {
      any |= bm[j];
      r[j] = bm[j] ? r[j] : ninf;
    }
    keep = any != 0;
  }
  if (!keep && !a.nanrow) {
    for (int64_t j = lo; j < hi; ++j) r[j] = 0.0f;
    return;
  }
  float m = sink;
  #pragma omp simd reduction(max:m)
  for (int64_t j = lo; j < hi; ++j) m = r[j] > m ? r[j] : m;
  float sum = sink == ninf ? 0.0f : sf_exp_nonpos(sink - m);  // (m is at least sink and every r[j])
  #pragma omp simd reduction(+:sum)
  for (int64_t j = lo; j < hi; ++j) {
    const float e = r[j] == ninf ? 0.0f : sf_exp_nonpos(r[j] - m);
    r[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
  if (a.phalf == 2) {
    for (int64_t j = lo; j < hi; ++j) r[j] = sf_bf16_round(r[j] * inv);
  } else if (a.phalf == 1) {
    for (int64_t j = lo; j < hi; ++j) r[j] = sf_f16_round(r[j] * inv);
  } else {
    for (int64_t j = lo; j < hi; ++j) r[j] *= inv;
  }
}

static void sf_attention(const float* q, const float* k, const float* v, const void* mask, const int64_t* nonpad,
                         const float* sinks, const float* bias2, float* y, const SfAttn& a) {
  if (a.B <= 0 || a.Hq <= 0 || a.S <= 0 || a.Dv <= 0) return;
  const int64_t rep = a.Hq / a.Hk;
  // rows per block: the block's scores stay near 1 MB (at most 64 rows, at least 8)
  const int64_t R = std::max<int64_t>(8, std::min<int64_t>(128, 262144 / std::max<int64_t>(a.L, 1)));
  const int64_t nblk = (a.S + R - 1) / R, tasks = a.B * a.Hq * nblk;
  const int nt = (double)a.B * a.Hq * a.S * a.L * (a.D + a.Dv) >= 262144.0 ? sf_max_threads() : 1;
  const float* fm = a.mkind == 1 ? static_cast<const float*>(mask) : nullptr;
  const uint8_t* bm = a.mkind == 2 ? static_cast<const uint8_t*>(mask) : nullptr;
  // Where several blocks read a key head (more than one block of rows, or query heads sharing it), its K^T
  // and V are packed once, as prepacked weights are (SfPrepacked): K^T in panels of SF_PANEL keys,
  // [ceil(L / SF_PANEL)][D][SF_PANEL], V in panels of SF_PANEL values, [ceil(Dv / SF_PANEL)][L][SF_PANEL];
  // a block's scores then start at a panel's first key. Packed per block, K^T and V took 11% of
  // Whisper-base's attention (1500 frames: 12 blocks of 128 rows per head). Not for fewer than 16 query
  // rows (a decoding step's one row reads K and V in place, unpacked) or copies of more than 64 MB.
  const int64_t nkp = (a.L + SF_PANEL - 1) / SF_PANEL, nvp = (a.Dv + SF_PANEL - 1) / SF_PANEL;
  const int64_t kvsz = (nkp * a.D + nvp * a.L) * SF_PANEL;  // floats per key head
  const bool pre = (nblk > 1 || rep > 1) && a.S >= 16 && a.D > 0 && (double)a.B * a.Hk * kvsz <= 16777216.0;
  float* kv = pre ? static_cast<float*>(sf_workspace(3, sizeof(float) * a.B * a.Hk * kvsz)) : nullptr;
  #pragma omp parallel num_threads(nt) if (nt > 1)
  {
    if (pre) {
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < a.B * a.Hk * (nkp + nvp); ++t) {
        const int64_t bh = t / (nkp + nvp), p = t % (nkp + nvp), b = bh / a.Hk, hk = bh % a.Hk;
        float* kp = kv + bh * kvsz;
        if (p < nkp)
          sf_pack_b(k + b * a.ks[0] + hk * a.ks[1], 1, a.ks[2], a.L, p, SF_PANEL, 0, a.D, kp + p * a.D * SF_PANEL);
        else
          sf_pack_b(v + b * a.vs[0] + hk * a.vs[1], a.vs[2], 1, a.Dv, p - nkp, SF_PANEL, 0, a.L,
                    kp + nkp * a.D * SF_PANEL + (p - nkp) * a.L * SF_PANEL);
      }
    }
    #pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t blk = t % nblk, h = (t / nblk) % a.Hq, b = t / (nblk * a.Hq), hk = h / rep;
      const int64_t i0 = blk * R, rows = std::min(R, a.S - i0);
      const int64_t npb = a.nonpad ? nonpad[b] : -1;
      const int64_t off = a.nonpad && a.past == 0 ? npb - a.S : a.past;
      float* yb = y + b * a.ys[0] + h * a.ys[1] + i0 * a.ys[2];
      // the keys [c0, c1) some row of the block may see
      int64_t c0 = a.L, c1 = 0;
      for (int64_t i = i0; i < i0 + rows; ++i) {
        int64_t lo, hi;
        sf_attn_range(a, i, off, npb, lo, hi);
        if (lo < hi) { c0 = std::min(c0, lo); c1 = std::max(c1, hi); }
      }
      if (c0 >= c1) {  // no row sees a key: the block's output is 0
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t e = 0; e < a.Dv; ++e) yb[r * a.ys[2] + e] = 0.0f;
        continue;
      }
      // the scores of keys [s0, c1): s0 = c0, or the first key of c0's panel of K^T
      const int64_t s0 = pre ? c0 / SF_PANEL * SF_PANEL : c0, n = c1 - s0;
      float* sc = static_cast<float*>(sf_workspace(0, sizeof(float) * rows * n));
      const float* qb = q + b * a.qs[0] + h * a.qs[1] + i0 * a.qs[2];
      const float* kp = pre ? kv + (b * a.Hk + hk) * kvsz : nullptr;
      if (pre) {
        sf_sgemm_driver(rows, n, a.D, qb, a.qs[2], 1, SfPrepacked{kp + s0 / SF_PANEL * a.D * SF_PANEL, a.D, n}, sc,
                        n, 1.0f, nullptr, 0, 0);
      } else {
        sf_sgemm(rows, n, a.D, qb, a.qs[2], 1, k + b * a.ks[0] + hk * a.ks[1] + s0 * a.ks[2], 1, a.ks[2], sc, n,
                 1.0f, nullptr, 0, 0, false);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        int64_t lo, hi;
        sf_attn_range(a, i, off, npb, lo, hi);
        const int64_t mo = b * a.ms[0] + h * a.ms[1] + i * a.ms[2], bo = b * a.bs[0] + h * a.bs[1] + i * a.bs[2];
        sf_attn_row(sc + r * n, s0, c1, lo, hi, a, fm ? fm + mo : nullptr, bm ? bm + mo : nullptr,
                    a.bias2 ? bias2 + bo : nullptr, sinks ? sinks[h] : -std::numeric_limits<float>::infinity());
      }
      // the output rows from the probabilities of keys [c0, c1)
      const float* pc = sc + (c0 - s0);
      if (pre) {
        const float* vp = kp + nkp * a.D * SF_PANEL + c0 * SF_PANEL;  // V's panels from key c0
        sf_sgemm_driver(rows, a.Dv, c1 - c0, pc, n, 1, SfPrepacked{vp, a.L, a.Dv}, yb, a.ys[2], 1.0f, nullptr, 0, 0);
      } else {
        sf_sgemm(rows, a.Dv, c1 - c0, pc, n, 1, v + b * a.vs[0] + hk * a.vs[1] + c0 * a.vs[2], a.vs[2], 1, yb,
                 a.ys[2], 1.0f, nullptr, 0, 0, false);
      }
    }
  }
}

}  // namespace
