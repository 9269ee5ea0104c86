// ---- Low-bit weights (MatMulNBits: 2/4/8-bit codes in blocks along K, a scale per block) ----------
namespace {

// The weight as ops.linalg.MatMulNBits stores it: column j's codes in bytes q + j * ldq (ldq = blocks *
// bs * bits / 8), code k in byte k / per (per = 8 / bits), bits (k % per) * bits of it;
// W[k, j] = (code - zero(j, b)) * scale[j * blocks + b] with b = k / bs; zp null: 2^(bits - 1).
struct SfNbits {
  const uint8_t* q;
  const float* scale;
  const float* zp;
  int64_t K, N, bs, blocks, bits;  // bits 2, 4 or 8
  int64_t per() const { return 8 / bits; }
  int64_t ldq() const { return blocks * bs * bits / 8; }
  int64_t blob() const { return bs * bits / 8; }
  float zero(int64_t j, int64_t b) const { return zp ? zp[j * blocks + b] : float(1 << (bits - 1)); }
  // floats per row of the GEMV's copy of A (sf_nbits_phases)
  int64_t row_floats() const { return per() * ldq() + blocks; }
};

// A row a[K] for the GEMV kernels: ap[r * ldq + t] = a[per * t + r] (code r of each byte, its phase;
// zero past K), then asum[b] = the sum of a over block b. Then, for column j,
//   y[j] = sum_b scale[j, b] * (sum_r sum_t code_r(t) ap[r][t] - zero(j, b) * asum[b]),
// t over block b's bytes: the codes are multiplied as read, never stored as floats.
static void sf_nbits_phases(const SfNbits& w, const float* __restrict__ a, float* __restrict__ ap) {
  const int64_t per = w.per(), ldq = w.ldq();
  for (int64_t r = 0; r < per; ++r)
    for (int64_t t = 0; t < ldq; ++t) {
      const int64_t k = per * t + r;
      ap[r * ldq + t] = k < w.K ? a[k] : 0.0f;
    }
  float* asum = ap + per * ldq;
  for (int64_t b = 0; b < w.blocks; ++b) {
    float s = 0.0f;
    for (int64_t k = b * w.bs; k < std::min(w.K, (b + 1) * w.bs); ++k) s += a[k];
    asum[b] = s;
  }
}

// columns [j0, j1) of `rows` rows (their phases rf floats apart), any width and CPU
static void sf_nbits_cols(const SfNbits& w, int64_t rows, int64_t j0, int64_t j1, const float* __restrict__ ap,
                          float* __restrict__ y, int64_t ldy) {
  const int64_t per = w.per(), ldq = w.ldq(), blob = w.blob(), rf = w.row_floats();
  const int mask = (1 << w.bits) - 1;
  for (int64_t i = 0; i < rows; ++i) {
    const float* ai = ap + i * rf;
    const float* asum = ai + per * ldq;
    for (int64_t j = j0; j < j1; ++j) {
      const uint8_t* __restrict__ qj = w.q + j * ldq;
      float acc = 0.0f, zacc = 0.0f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        float d = 0.0f;
        for (int64_t r = 0; r < per; ++r) {
          const float* __restrict__ ar = ai + r * ldq;
          const int sh = int(r) * int(w.bits);
          #pragma omp simd reduction(+:d)
          for (int64_t t = b * blob; t < (b + 1) * blob; ++t) d += float((qj[t] >> sh) & mask) * ar[t];
        }
        const float s = w.scale[j * w.blocks + b];
        acc += s * d;
        zacc += s * w.zero(j, b) * asum[b];
      }
      y[i * ldy + j] = acc - zacc;
    }
  }
}

#if defined(__x86_64__)
// 4-bit codes, blocks of a multiple of 32 codes (16 bytes): R rows x C columns from column j0 (their
// sums are independent chains; each row's loads serve C columns, each column's codes R rows). A byte's
// low nibble is an even k, its high one the next odd k: a row's phases hold its even and odd elements.
template <int R, int C>
__attribute__((target("avx512f,avx512bw")))
static void sf_nbits4_tile_avx512(const SfNbits& w, int64_t j0, int64_t b0, int64_t b1, bool first,
                                  const float* __restrict__ ap, float* __restrict__ y,
                                  int64_t ldy) {
  const int64_t ldq = w.ldq(), blob = w.blob(), rf = w.row_floats();
  const __m128i m4 = _mm_set1_epi8(0x0F);
  __m512 acc[R][C];
  float zacc[R][C];
  #pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) { acc[i][c] = _mm512_setzero_ps(); zacc[i][c] = 0.0f; }
  for (int64_t b = b0; b < b1; ++b) {
    __m512 d[R][C];
    #pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
      #pragma GCC unroll 4
      for (int c = 0; c < C; ++c) d[i][c] = _mm512_setzero_ps();
    for (int64_t t = b * blob; t < (b + 1) * blob; t += 16) {
      __m512 lo[C], hi[C];
      #pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + (j0 + c) * ldq + t));
        lo[c] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, m4)));
        hi[c] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m4)));
      }
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m512 e = _mm512_loadu_ps(ap + i * rf + t), o = _mm512_loadu_ps(ap + i * rf + ldq + t);
        #pragma GCC unroll 4
        for (int c = 0; c < C; ++c) d[i][c] = _mm512_fmadd_ps(hi[c], o, _mm512_fmadd_ps(lo[c], e, d[i][c]));
      }
    }
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float s = w.scale[(j0 + c) * w.blocks + b], sz = s * w.zero(j0 + c, b);
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        acc[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(s), d[i][c], acc[i][c]);
        zacc[i][c] += sz * ap[i * rf + 2 * ldq + b];
      }
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float v = _mm512_reduce_add_ps(acc[i][c]) - zacc[i][c];
      y[i * ldy + j0 + c] = first ? v : y[i * ldy + j0 + c] + v;
    }
}

// bytes 0-7 of x as floats
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 sf_u8x8_ps(__m128i x) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)); }

template <int R, int C>
__attribute__((target("avx2,fma")))
static void sf_nbits4_tile_avx2(const SfNbits& w, int64_t j0, int64_t b0, int64_t b1, bool first,
                                  const float* __restrict__ ap, float* __restrict__ y,
                                int64_t ldy) {
  const int64_t ldq = w.ldq(), blob = w.blob(), rf = w.row_floats();
  const __m128i m4 = _mm_set1_epi8(0x0F);
  __m256 acc[R][C];
  float zacc[R][C];
  #pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) { acc[i][c] = _mm256_setzero_ps(); zacc[i][c] = 0.0f; }
  for (int64_t b = b0; b < b1; ++b) {
    __m256 d[R][C];
    #pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
      #pragma GCC unroll 4
      for (int c = 0; c < C; ++c) d[i][c] = _mm256_setzero_ps();
    for (int64_t t = b * blob; t < (b + 1) * blob; t += 16) {
      __m256 f[C][4];  // codes of k = 2t.. even (low nibbles, bytes 0-7 and 8-15), then odd
      #pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + (j0 + c) * ldq + t));
        const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
        f[c][0] = sf_u8x8_ps(lo);
        f[c][1] = sf_u8x8_ps(_mm_srli_si128(lo, 8));
        f[c][2] = sf_u8x8_ps(hi);
        f[c][3] = sf_u8x8_ps(_mm_srli_si128(hi, 8));
      }
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const float* e = ap + i * rf + t;
        const float* o = e + ldq;
        const __m256 e0 = _mm256_loadu_ps(e), e1 = _mm256_loadu_ps(e + 8);
        const __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8);
        #pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          __m256 s = _mm256_fmadd_ps(f[c][0], e0, d[i][c]);
          s = _mm256_fmadd_ps(f[c][1], e1, s);
          s = _mm256_fmadd_ps(f[c][2], o0, s);
          d[i][c] = _mm256_fmadd_ps(f[c][3], o1, s);
        }
      }
    }
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float s = w.scale[(j0 + c) * w.blocks + b], sz = s * w.zero(j0 + c, b);
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        acc[i][c] = _mm256_fmadd_ps(_mm256_set1_ps(s), d[i][c], acc[i][c]);
        zacc[i][c] += sz * ap[i * rf + 2 * ldq + b];
      }
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      alignas(32) float t[8];
      _mm256_store_ps(t, acc[i][c]);
      const float v = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7])) - zacc[i][c];
      y[i * ldy + j0 + c] = first ? v : y[i * ldy + j0 + c] + v;
    }
}

// one column group [j0, j0 + cols) of R rows by the ISA's tile: 4 columns (1 or 2 rows) or 2 (3 or 4
// rows: the sums of R x C tiles and their block sums stay in registers), single columns for the tail;
// K in chunks of about 2048 codes, so that the R rows' phases (8 KB a row) stay in L1 across the group's
// columns (measured: 4 rows of K = 4096, 64 KB, took 2.2x the time of 2 rows)
template <int R>
static void sf_nbits4_group(int isa, const SfNbits& w, int64_t j0, int64_t cols, const float* ap, float* y,
                            int64_t ldy) {
  constexpr int C = R <= 2 ? 4 : 2;
  const int64_t step = std::max<int64_t>(1, 2048 / w.bs);
  for (int64_t b0 = 0; b0 < w.blocks; b0 += step) {
    const int64_t b1 = std::min(w.blocks, b0 + step);
    int64_t j = j0;
    for (; j + C <= j0 + cols; j += C)
      if (isa == 2) sf_nbits4_tile_avx512<R, C>(w, j, b0, b1, b0 == 0, ap, y, ldy);
      else sf_nbits4_tile_avx2<R, C>(w, j, b0, b1, b0 == 0, ap, y, ldy);
    for (; j < j0 + cols; ++j)
      if (isa == 2) sf_nbits4_tile_avx512<R, 1>(w, j, b0, b1, b0 == 0, ap, y, ldy);
      else sf_nbits4_tile_avx2<R, 1>(w, j, b0, b1, b0 == 0, ap, y, ldy);
  }
}
#endif

// 2: the AVX-512 tiles, 1: the AVX2 ones (4-bit codes in whole 16-byte chunks per block), 0: the portable loop
static int sf_nbits_isa(const SfNbits& w) {
#if defined(__x86_64__)
  if (w.bits == 4 && w.blob() % 16 == 0) {
    static const int isa = [] {
      if (sf_isa_cap() >= SF_ISA_AVX512 && __builtin_cpu_supports("avx512f")
          && __builtin_cpu_supports("avx512bw"))
        return 2;
      return sf_avx2_helpers() ? 1 : 0;
    }();
    return isa;
  }
#endif
  return 0;
}

// Y[rows, N] = A[rows, K] @ W for rows <= 4 (ldy: Y's row stride), threads splitting the columns (par)
static void sf_nbits_gemv(const SfNbits& w, int64_t rows, const float* A, float* Y, int64_t ldy, bool par) {
  const int64_t rf = w.row_floats();
  float* ap = static_cast<float*>(sf_workspace(0, sizeof(float) * rows * rf));
  for (int64_t i = 0; i < rows; ++i) sf_nbits_phases(w, A + i * w.K, ap + i * rf);
  const int isa = sf_nbits_isa(w);
  constexpr int64_t G = 16;  // columns per unit of work
  const int64_t groups = (w.N + G - 1) / G;
  #pragma omp parallel for schedule(static) if (par && groups > 1)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t j0 = G * g, cols = std::min(w.N - j0, G);
#if defined(__x86_64__)
    if (isa) {
      switch (rows) {
        case 1: sf_nbits4_group<1>(isa, w, j0, cols, ap, Y, ldy); break;
        case 2: sf_nbits4_group<2>(isa, w, j0, cols, ap, Y, ldy); break;
        case 3: sf_nbits4_group<3>(isa, w, j0, cols, ap, Y, ldy); break;
        default: sf_nbits4_group<4>(isa, w, j0, cols, ap, Y, ldy); break;
      }
      continue;
    }
#endif
    sf_nbits_cols(w, rows, j0, j0 + cols, ap, Y, ldy);
  }
}

// Column j's W[k0 .. k0 + kc) as floats into dst: a block's scale and zero point once, the codes of a
// byte by its phase (BITS a compile-time constant, so the loops vectorize)
template <int BITS>
static void sf_nbits_dequant_bits(const SfNbits& w, int64_t j, int64_t k0, int64_t kc, float* __restrict__ dst) {
  constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
  const uint8_t* __restrict__ qj = w.q + j * w.ldq();
  for (int64_t k = k0; k < k0 + kc;) {
    const int64_t b = k / w.bs, end = std::min(k0 + kc, (b + 1) * w.bs);
    const float s = w.scale[j * w.blocks + b], z = w.zero(j, b);
    for (; k < end && k % PER; ++k) dst[k - k0] = (float((qj[k / PER] >> ((k % PER) * BITS)) & MASK) - z) * s;
    const int64_t t0 = k / PER, t1 = end / PER;  // whole bytes
    float* __restrict__ o = dst + (k - k0);
    for (int64_t t = t0; t < t1; ++t)
      #pragma GCC unroll 4
      for (int r = 0; r < PER; ++r) o[(t - t0) * PER + r] = (float((qj[t] >> (r * BITS)) & MASK) - z) * s;
    for (k = t1 * PER; k < end; ++k) dst[k - k0] = (float((qj[k / PER] >> ((k % PER) * BITS)) & MASK) - z) * s;
  }
}

#if defined(__x86_64__)
// 4-bit codes of whole blocks of a multiple of 32 (k0 and kc on block bounds, or kc reaching K): the low
// and high nibbles interleaved back into k's order, 16 codes a conversion
__attribute__((target("avx512f,avx512bw")))
static void sf_nbits4_dequant_avx512(const SfNbits& w, int64_t j, int64_t k0, int64_t kc, float* __restrict__ dst) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const uint8_t* qj = w.q + j * w.ldq();
  for (int64_t b = k0 / w.bs; b * w.bs < k0 + kc; ++b) {
    const __m512 s = _mm512_set1_ps(w.scale[j * w.blocks + b]), nz = _mm512_set1_ps(-w.zero(j, b));
    for (int64_t k = b * w.bs; k < std::min(k0 + kc, (b + 1) * w.bs); k += 32) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qj + k / 2));
      const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
      const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
      const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
      const int64_t n = std::min<int64_t>(32, k0 + kc - k);  // the last block of K: codes past K unused
      const __mmask16 m0 = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      const __mmask16 m1 = n >= 32 ? __mmask16(0xFFFF) : n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1);
      _mm512_mask_storeu_ps(dst + (k - k0), m0, _mm512_mul_ps(_mm512_add_ps(c0, nz), s));
      _mm512_mask_storeu_ps(dst + (k - k0) + 16, m1, _mm512_mul_ps(_mm512_add_ps(c1, nz), s));
    }
  }
}

// r[c] = 16 bytes of column c -> r[t] = byte t of columns 0..15 (four rounds of interleaving: bytes,
// then pairs, quads and octets of columns)
__attribute__((target("avx512f,avx512bw"), always_inline))
static inline void sf_transpose_16x16_epi8(__m128i r[16]) {
  __m128i s1[16], s2[16], s3[16];
  for (int p = 0; p < 8; ++p) {  // s1[2p + h]: columns 2p, 2p + 1 interleaved, bytes 8h..8h + 7
    s1[2 * p] = _mm_unpacklo_epi8(r[2 * p], r[2 * p + 1]);
    s1[2 * p + 1] = _mm_unpackhi_epi8(r[2 * p], r[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q)  // s2[4q + g]: columns 4q..4q + 3, bytes 4g..4g + 3
    for (int h = 0; h < 2; ++h) {
      s2[4 * q + 2 * h] = _mm_unpacklo_epi16(s1[4 * q + h], s1[4 * q + 2 + h]);
      s2[4 * q + 2 * h + 1] = _mm_unpackhi_epi16(s1[4 * q + h], s1[4 * q + 2 + h]);
    }
  for (int o = 0; o < 2; ++o)  // s3[8o + m]: columns 8o..8o + 7, bytes 2m, 2m + 1
    for (int g = 0; g < 4; ++g) {
      s3[8 * o + 2 * g] = _mm_unpacklo_epi32(s2[8 * o + g], s2[8 * o + 4 + g]);
      s3[8 * o + 2 * g + 1] = _mm_unpackhi_epi32(s2[8 * o + g], s2[8 * o + 4 + g]);
    }
  for (int m = 0; m < 8; ++m) {
    r[2 * m] = _mm_unpacklo_epi64(s3[m], s3[8 + m]);
    r[2 * m + 1] = _mm_unpackhi_epi64(s3[m], s3[8 + m]);
  }
}

// The GEMM's panel of columns [j0, j0 + cols) (zeros up to nr, a multiple of 16) and K rows [k0, k0 + kc)
// (k0 on a block bound), Bp[k][c], straight from 4-bit codes in blocks of a multiple of 32: 16 columns'
// 16 bytes (32 codes each) transposed as bytes, then each byte row's low and high nibbles (k even, odd)
// dequantized 16 columns at a time, with the columns' scales and zero points of that block
__attribute__((target("avx512f,avx512bw")))
static void sf_nbits4_pack_avx512(const SfNbits& w, int64_t j0, int64_t cols, int64_t nr, int64_t k0, int64_t kc,
                                  float* __restrict__ Bp) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const int64_t ldq = w.ldq();
  for (int64_t c0 = 0; c0 < nr; c0 += 16) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, cols - c0));  // real columns of the group
    alignas(64) float sc[16], zz[16];
    int64_t block = -1;
    __m512 vs = _mm512_setzero_ps(), vz = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      if (k / w.bs != block) {  // this group's scales and zero points of the block
        block = k / w.bs;
        for (int64_t c = 0; c < 16; ++c) {
          sc[c] = c < n ? w.scale[(j0 + c0 + c) * w.blocks + block] : 0.0f;
          zz[c] = c < n ? w.zero(j0 + c0 + c, block) : 0.0f;
        }
        vs = _mm512_load_ps(sc);
        vz = _mm512_load_ps(zz);
      }
      __m128i r[16];
      for (int64_t c = 0; c < 16; ++c)
        r[c] = c < n ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + (j0 + c0 + c) * ldq + k / 2))
                     : _mm_setzero_si128();
      sf_transpose_16x16_epi8(r);
      const int64_t rows = std::min<int64_t>(32, k0 + kc - k);  // (the last block of K: codes past K unused)
      float* dst = Bp + (k - k0) * nr + c0;
      for (int64_t t = 0; 2 * t < rows; ++t) {
        const __m128i lo = _mm_and_si128(r[t], m4), hi = _mm_and_si128(_mm_srli_epi16(r[t], 4), m4);
        _mm512_storeu_ps(dst + 2 * t * nr,
                         _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vz), vs));
        if (2 * t + 1 < rows)
          _mm512_storeu_ps(dst + (2 * t + 1) * nr,
                           _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vz), vs));
      }
    }
  }
}
#endif

SF_CLONES
static void sf_nbits_dequant_any(const SfNbits& w, int64_t j, int64_t k0, int64_t kc, float* dst) {
  if (w.bits == 4) sf_nbits_dequant_bits<4>(w, j, k0, kc, dst);
  else if (w.bits == 2) sf_nbits_dequant_bits<2>(w, j, k0, kc, dst);
  else sf_nbits_dequant_bits<8>(w, j, k0, kc, dst);
}

// Rows up to which the GEMV runs, in groups of 4 (each group reads the codes again); more go through the
// GEMM, each panel of W dequantized as a tile uses it (SfNbitsPackOnUse, sf_nbits4_pack_avx512). Measured
// on the 2-core AVX-512 Xeon (benchmarks/cpu_lowbit.py, 4096 x 4096, session 36): the GEMV 1.46 ms at 4
// rows and 3.0 at 8, the GEMM 2.0 and 2.2 (and 3.0 at 16, 4.5 at 32, 14.6 at 128: within 5-40% of
// the float32 GEMM on the dequantized weight; it was 6.0 at 16 when whole chunks were dequantized ahead).
constexpr int64_t SF_NBITS_GEMV_ROWS = 4;
constexpr int64_t SF_NBITS_NC = 1024;
// Rows up to which the GEMM dequantizes each panel where a tile uses it (SfNbitsPackOnUse): the
// driver's tiles then span every row (144 at most), so no panel is dequantized twice
constexpr int64_t SF_NBITS_ON_USE_ROWS = 144;

// A B source for sf_sgemm_driver (see SfPackPerCall) that packs nothing ahead: panel() dequantizes the
// K block of the column panel it is asked for into the calling thread's buffer, which the tile's rows
// use before the next call
template <class PackB>
struct SfNbitsPackOnUse {
  const PackB& pack;
  int64_t chunk;
  void prepare(int64_t, int64_t, int64_t, int64_t, int64_t) const {}
  const float* panel(int64_t jc, int64_t, int64_t nr, int64_t cols, int64_t pc, int64_t kc, int64_t jp, int64_t& ldb,
                     int64_t& bnext) const {
    float* Bp = static_cast<float*>(sf_workspace(2, sizeof(float) * nr * SF_KC));
    pack(jc, jp * nr + cols, jp, nr, pc, kc, Bp);
    ldb = nr;
    bnext = 16;
    return Bp;
  }
};

// C[M, N] = A[M, K] @ W
static void sf_matmul_nbits(int64_t M, const SfNbits& w, const float* A, float* C) {
  if (M <= 0 || w.N <= 0) return;
  if (w.K <= 0) {
    sf_gemm_empty_k(M, w.N, C, w.N, 1.0f, nullptr, 0, 0);
    return;
  }
  if (M <= SF_NBITS_GEMV_ROWS) {
    // threads for any weight of 64K codes or more: the codes are read from memory once per group of rows
    const bool split = sf_max_threads() > 1 && w.N * w.K >= (1 << 16);
    for (int64_t i = 0; i < M; i += 4)
      sf_nbits_gemv(w, std::min<int64_t>(4, M - i), A + i * w.K, C + i * w.N, w.N, split);
    return;
  }
  const int isa = sf_nbits_isa(w);
  auto pack = [&w, isa](int64_t jc, int64_t nc, int64_t p, int64_t nr, int64_t k0, int64_t kc, float* Bp) {
    const int64_t cols = std::min(nr, nc - p * nr);
#if defined(__x86_64__)
    if (isa == 2 && k0 % w.bs == 0 && nr % 16 == 0) {
      sf_nbits4_pack_avx512(w, jc + p * nr, cols, nr, k0, kc, Bp);
      return;
    }
#endif
    float* t = static_cast<float*>(sf_workspace(3, sizeof(float) * nr * SF_KC));  // [cols][kc]
#if defined(__x86_64__)
    if (isa == 2 && k0 % w.bs == 0) {
      for (int64_t c = 0; c < cols; ++c) sf_nbits4_dequant_avx512(w, jc + p * nr + c, k0, kc, t + c * kc);
    } else
#endif
    for (int64_t c = 0; c < cols; ++c) sf_nbits_dequant_any(w, jc + p * nr + c, k0, kc, t + c * kc);
    sf_pack_b(t, 1, kc, cols, 0, nr, 0, kc, Bp);
  };
  const int64_t nr = sf_ukr().nr;
  // the block of m rows from i0 and n columns from j0 (a multiple of nr) on the calling thread
  auto block = [&](int64_t i0, int64_t m, int64_t j0, int64_t n) {
    const auto packj = sf_pack_from(pack, j0);
    const float* Ab = A + i0 * w.K;
    float* Cb = C + i0 * w.N + j0;
    if (m <= SF_NBITS_ON_USE_ROWS) {
      // one row of the driver's tiles holds every row: each K block of each column panel is used once,
      // so it is dequantized where it is used, into the thread's own 32 KB, and read back from L1
      const SfNbitsPackOnUse<decltype(packj)> src{packj, n};
      sf_sgemm_driver(m, n, w.K, Ab, w.K, 1, src, Cb, w.N, 1.0f, nullptr, 0, 0);
      return;
    }
    // chunks of SF_NBITS_NC columns (the GEMM's own are 4096): the chunk's dequantized panels, K x 512
    // floats, are read back from the cache rather than from memory
    const int64_t chunk = std::min<int64_t>(n, SF_NBITS_NC);
    float* Bp = static_cast<float*>(sf_workspace(2, sizeof(float) * ((chunk + nr - 1) / nr) * nr * w.K));
    const SfPackPerCall<decltype(packj)> src{packj, Bp, w.K, SF_NBITS_NC};
    sf_sgemm_driver(m, n, w.K, Ab, w.K, 1, src, Cb, w.N, 1.0f, nullptr, 0, 0);
  };
  // with threads, each owns a block of C (sf_gemm_blocks), dequantizing its own columns of W
  if (sf_gemm_parallel(M, w.N, w.K, true))
    sf_gemm_blocks(M, w.N, w.K, nr, 80.0, sf_max_threads(), block);
  else
    block(0, M, 0, w.N);
}

}  // namespace
