// ---- Integer GEMM (PackedMatMulInteger: uint8/int8 times a packed int8 weight, int32 sums) ----------
namespace {

// The weight comes packed at compile time (ops.linalg.pack_int8_panels): panels of SF_I8_PANEL columns,
// each [Kp / 4][16][4] signed bytes b' (b, or b - 128 for uint8; Kp: K rounded up to SF_I8_KSTEP, zero
// past K: every 64 values of k a whole AMX tile of 16 x 64 bytes), and bc[2][16 * panels]: the
// zero point in those terms and the column sums of b'. A is copied per call into rows of unsigned bytes
// a' (a, or a + 128 for int8) padded to a multiple of 4, with their sums; then
//   C = sum_k a' b' - bc[0] * rowsum(a') - z * bc[1] + K * z * bc[0]
// (z: A's zero point plus the same 128), which equals sum_k (a - azp)(b - bzp) modulo 2^32.
constexpr int64_t SF_I8_PANEL = 16;
constexpr int64_t SF_I8_KSTEP = 64;
// groups of 4 values of k in a packed panel
static inline int64_t sf_i8_groups(int64_t K) { return (K + SF_I8_KSTEP - 1) / SF_I8_KSTEP * (SF_I8_KSTEP / 4); }
// k groups of 4 per block (1024 values of k): a block of 4 panels (64 columns, 64 KB) stays in L2 across
// A's rows. Measured on Zen 4 (benchmarks/cpu_gemm.py int8_*): blocks of 64 groups (16 KB, L1) were
// 3-7% slower at K = 768 and 3072: C is read and written again after each block.
constexpr int64_t SF_I8_KGB = 256;

// C[0..mr)[0..nc) (+)= A'[rows][4 g0 .. 4 g1) . B'(same k), for one tile of the kernel's width:
// A' rows lda bytes (or int16s) apart; B at the tile's first panel and first group, panels ldp bytes apart
using SfI8Ukr = void (*)(int64_t ng, const void* A, int64_t lda, const int8_t* B, int64_t ldp, int32_t* C,
                         int64_t ldc, int64_t mr, int64_t nc, bool first);

static inline void sf_i8_store(int32_t* __restrict__ C, const int32_t* __restrict__ t, int64_t nc, bool first) {
  if (first)
    for (int64_t j = 0; j < nc; ++j) C[j] = t[j];
  else
    for (int64_t j = 0; j < nc; ++j) C[j] += t[j];
}

// 4 rows x one panel (16 columns), any CPU; A' as bytes
static void sf_i8ukr_generic(int64_t ng, const void* Av, int64_t lda, const int8_t* __restrict__ B, int64_t,
                             int32_t* __restrict__ C, int64_t ldc, int64_t mr, int64_t nc, bool first) {
  const uint8_t* __restrict__ A = static_cast<const uint8_t*>(Av);
  int32_t t[4][16] = {};
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t i = 0; i < mr; ++i)
      for (int j = 0; j < 16; ++j) {
        int32_t s = 0;
        for (int q = 0; q < 4; ++q) s += int32_t(A[i * lda + 4 * g + q]) * int32_t(B[64 * g + 4 * j + q]);
        t[i][j] += s;
      }
  for (int64_t i = 0; i < mr; ++i) sf_i8_store(C + i * ldc, t[i], nc, first);
}

#if defined(__x86_64__)
// MR rows x NP panels with AVX-512 VNNI: vpdpbusd adds four byte products into each int32 lane
template <int MR, int NP>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void sf_i8ukr_vnni(int64_t ng, const void* Av, int64_t lda, const int8_t* __restrict__ B, int64_t ldp,
                          int32_t* __restrict__ C, int64_t ldc, int64_t, int64_t nc, bool first) {
  const uint8_t* __restrict__ A = static_cast<const uint8_t*>(Av);
  __m512i acc[MR][NP];
  #pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_si512();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i b[NP];
    #pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) b[p] = _mm512_loadu_si512(B + p * ldp + 64 * g);
    #pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      int32_t four;
      std::memcpy(&four, A + i * lda + 4 * g, 4);
      const __m512i a = _mm512_set1_epi32(four);
      #pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], a, b[p]);
    }
  }
  #pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const int64_t cols = std::min<int64_t>(16, nc - 16 * p);
      if (cols <= 0) continue;
      const __mmask16 m = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
      int32_t* c = C + i * ldc + 16 * p;
      __m512i v = acc[i][p];
      if (!first) v = _mm512_add_epi32(v, _mm512_maskz_loadu_epi32(m, c));
      _mm512_mask_storeu_epi32(c, m, v);
    }
}

template <int MR>
static void sf_i8ukr_vnni_rows(int64_t ng, const void* A, int64_t lda, const int8_t* B, int64_t ldp, int32_t* C,
                               int64_t ldc, int64_t mr, int64_t nc, bool first) {
  switch ((nc + 15) / 16) {
    case 1: sf_i8ukr_vnni<MR, 1>(ng, A, lda, B, ldp, C, ldc, mr, nc, first); break;
    case 2: sf_i8ukr_vnni<MR, 2>(ng, A, lda, B, ldp, C, ldc, mr, nc, first); break;
    case 3: sf_i8ukr_vnni<MR, 3>(ng, A, lda, B, ldp, C, ldc, mr, nc, first); break;
    default: sf_i8ukr_vnni<MR, 4>(ng, A, lda, B, ldp, C, ldc, mr, nc, first); break;
  }
}

// MR rows x half a panel (8 columns) with AVX2: A' widened to int16 when packed, the weight's bytes
// widened as loaded; vpmaddwd sums products of pairs exactly, so each register holds two partial sums
// per column (k mod 4 in {0, 1} and {2, 3}), added pairwise at the end
template <int MR>
__attribute__((target("avx2")))
static void sf_i8ukr_avx2(int64_t ng, const void* Av, int64_t lda, const int8_t* __restrict__ B, int64_t,
                          int32_t* __restrict__ C, int64_t ldc, int64_t, int64_t nc, bool first) {
  const int16_t* __restrict__ A = static_cast<const int16_t*>(Av);
  __m256i lo[MR], hi[MR];
  #pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
  for (int64_t g = 0; g < ng; ++g) {
    const int8_t* b = B + 64 * g;
    const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
    #pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      int64_t four;
      std::memcpy(&four, A + i * lda + 4 * g, 8);
      const __m256i a = _mm256_set1_epi64x(four);
      lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(a, b0));
      hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(a, b1));
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    // hadd: [c0 c1 c4 c5 | c2 c3 c6 c7]; the permute puts the 64-bit pairs in column order
    const __m256i s = _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[i], hi[i]), 0xD8);
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), s);
    sf_i8_store(C + i * ldc, t, std::min<int64_t>(8, nc), first);
  }
}
#endif

// the kernel, its rows and columns per tile, and whether it reads A' as int16
struct SfI8Kernel { SfI8Ukr fn[6]; int64_t mr, width; bool wide; };

// the kernel the table holds: SF_ISA_AVX512 (VNNI), SF_ISA_AVX2 or SF_ISA_GENERIC (without building it)
static int sf_i8_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (sf_isa_cap() >= SF_ISA_AVX512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
      && __builtin_cpu_supports("avx512vnni"))
    return SF_ISA_AVX512;
  if (sf_isa_cap() >= SF_ISA_AVX2 && __builtin_cpu_supports("avx2")) return SF_ISA_AVX2;
#endif
  return SF_ISA_GENERIC;
}

static SfI8Kernel sf_pick_i8() {
#if defined(__x86_64__)
  const int isa = sf_i8_isa();
  if (isa == SF_ISA_AVX512)
    return {{sf_i8ukr_vnni_rows<1>, sf_i8ukr_vnni_rows<2>, sf_i8ukr_vnni_rows<3>, sf_i8ukr_vnni_rows<4>,
             sf_i8ukr_vnni_rows<5>, sf_i8ukr_vnni_rows<6>}, 6, 64, false};
  if (isa == SF_ISA_AVX2)
    return {{sf_i8ukr_avx2<1>, sf_i8ukr_avx2<2>, sf_i8ukr_avx2<3>, sf_i8ukr_avx2<4>, nullptr, nullptr}, 4, 8, true};
#endif
  return {{sf_i8ukr_generic, sf_i8ukr_generic, sf_i8ukr_generic, sf_i8ukr_generic, nullptr, nullptr}, 4, 16, false};
}
#ifdef SF_PREBUILT_TABLES
SF_TABLE_FROM_PREBUILT(SfI8Kernel, i8_kernel)
#else
static const SfI8Kernel& sf_i8_kernel() { static const SfI8Kernel k = sf_pick_i8(); return k; }
#endif

// A' row i (lda elements: K values a ^ flip, zeros after) from A's row (K bytes); returns its sum
template <typename T>
static inline int32_t sf_i8_pack_row(const uint8_t* __restrict__ src, int64_t K, uint8_t flip, T* __restrict__ dst,
                                     int64_t lda) {
  int32_t s = 0;
  for (int64_t k = 0; k < K; ++k) { const uint8_t v = src[k] ^ flip; dst[k] = T(v); s += v; }
  for (int64_t k = K; k < lda; ++k) dst[k] = 0;
  return s;
}

// A's zero point of row i plus the shift (128 for a signed A), in a' terms
static inline int32_t sf_i8_zero(const void* azp, bool azp_per_row, bool a_signed, int64_t i) {
  int32_t z = 0;
  if (azp) {
    const int64_t at = azp_per_row ? i : 0;
    z = a_signed ? int32_t(static_cast<const int8_t*>(azp)[at]) : int32_t(static_cast<const uint8_t*>(azp)[at]);
  }
  return z + (a_signed ? 128 : 0);
}

// c[j] = t[j] + (K z - rowsum) bc[0][j] - z bc[1][j] for j in [j0, j1), in wrapping int32: the zero points' terms
// of one row's sums t (t = c: in place)
static inline void sf_i8_finish(int32_t* c, const int32_t* t, int64_t j0, int64_t j1, int64_t K, int32_t z,
                                int32_t rowsum, const int32_t* bc, const int32_t* bsum) {
  const uint32_t u = uint32_t(K) * uint32_t(z) - uint32_t(rowsum);
  for (int64_t j = j0; j < j1; ++j)
    c[j] = int32_t(uint32_t(t[j - j0]) + u * uint32_t(bc[j]) - uint32_t(z) * uint32_t(bsum[j]));
}

#if defined(__x86_64__)
// ---- AMX: blocks of 2 x 2 tiles of 16 x 16 int32 sums; tdpbusd adds 64 byte products of k a time ----
// whether the tiles' integer products may run (once per process): AMX-INT8, allowed by SHARDFLOW_CPU_ISA
static bool sf_i8_amx() {
  static const bool ok = sf_isa_cap() >= SF_ISA_AMX && sf_amx_usable(25);
  return ok;
}

// the products of prepared rows on AMX: A' (bytes, lda apart, readable up to whole tiles of 16 rows),
// the bfloat16 GEMM's blocks of 32 x 32 (sf_amx_blocks), each finished with the zero points' terms as it
// is copied out
static void sf_igemm_amx(int64_t M, int64_t N, int64_t K, const uint8_t* Ap, int64_t lda, const int32_t* rowsum,
                         const int32_t* zrow, const int8_t* bp, const int32_t* bc, int32_t* C, int64_t ldc, bool par) {
  const int64_t ngp = sf_i8_groups(K), ldp = 64 * ngp;
  const int64_t mt = (M + 15) / 16, np = (N + SF_I8_PANEL - 1) / SF_I8_PANEL;
  const int32_t* bsum = bc + SF_I8_PANEL * np;  // bc's second row
  sf_amx_blocks<true>(mt, np, ngp / 16, reinterpret_cast<const char*>(Ap), lda, reinterpret_cast<const char*>(bp),
                      ldp, par, [&](const void* T, int64_t i0, int64_t j0) {
    const int32_t* t = static_cast<const int32_t*>(T);
    const int64_t rows = std::min<int64_t>(32, M - i0), j1 = std::min<int64_t>(j0 + 32, N);
    for (int64_t q = 0; q < rows; ++q)
      sf_i8_finish(C + (i0 + q) * ldc, t + 32 * q, j0, j1, K, zrow[i0 + q], rowsum[i0 + q], bc, bsum);
  });
}
#endif

// whether a product of M rows runs on AMX: 16 rows or more (fewer fill a tile's rows with zeros: the
// other kernels read only the rows there are)
static inline bool sf_i8_on_amx(int64_t M) {
#if defined(__x86_64__)
  return M >= 16 && sf_i8_amx();
#else
  (void)M;
  return false;
#endif
}

// C[M, N] (int32, rows ldc apart) = sum_k (a'[i][k] - zrow[i]) (b'[k][j] - bc[0][j]) for prepared rows A'
// (rowsum[i]: their sums): bytes lda apart, readable up to whole tiles of 16 rows on AMX (sf_i8_on_amx), int16s
// for the AVX2 kernel (sf_i8_kernel().wide), else bytes; K values of each and zeros up to a multiple of 4
// (of 64 on AMX); B packed as above
static void sf_igemm_rows(int64_t M, int64_t N, int64_t K, const void* Ap, int64_t lda, const int32_t* rowsum,
                          const int32_t* zrow, const int8_t* bp, const int32_t* bc, int32_t* C, int64_t ldc,
                          bool allow_parallel) {
  const double work = (double)M * N * K;
#if defined(__x86_64__)
  if (sf_i8_on_amx(M)) {
    const bool par = allow_parallel && sf_max_threads() > 1 && N > 32 && work >= 1048576.0;
    return sf_igemm_amx(M, N, K, static_cast<const uint8_t*>(Ap), lda, rowsum, zrow, bp, bc, C, ldc, par);
  }
#endif
  const SfI8Kernel& kr = sf_i8_kernel();
  const int64_t ng = (K + 3) / 4, ldp = 64 * sf_i8_groups(K), esz = kr.wide ? 2 : 1;
  const int32_t* bsum = bc + SF_I8_PANEL * ((N + SF_I8_PANEL - 1) / SF_I8_PANEL);  // bc's second row
  const int64_t tiles = (N + kr.width - 1) / kr.width;
  const bool par = allow_parallel && sf_max_threads() > 1 && tiles > 1 && work >= 1048576.0;
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t j0 = t * kr.width, nc = std::min(kr.width, N - j0);
    // the tile's first panel, and the half of it the AVX2 kernel's 8 columns start at
    const int8_t* Bt = bp + (j0 / SF_I8_PANEL) * ldp + 4 * (j0 % SF_I8_PANEL);
    for (int64_t g0 = 0; g0 < ng; g0 += SF_I8_KGB) {
      const int64_t gn = std::min(SF_I8_KGB, ng - g0);
      for (int64_t i0 = 0; i0 < M; i0 += kr.mr) {
        const int64_t mr = std::min(kr.mr, M - i0);
        const void* Ai = static_cast<const char*>(Ap) + (i0 * lda + 4 * g0) * esz;
        kr.fn[mr - 1](gn, Ai, lda, Bt + 64 * g0, ldp, C + i0 * ldc + j0, ldc, mr, nc, g0 == 0);
      }
    }
    for (int64_t i = 0; i < M; ++i) {
      int32_t* c = C + i * ldc;
      sf_i8_finish(c, c + j0, j0, j0 + nc, K, zrow[i], rowsum[i], bc, bsum);
    }
  }
}

// C[M, N] (int32, rows ldc apart) = (A - azp) @ (B - bzp) for A [M, K] (rows of K bytes, signed when
// a_signed) and B packed as above; azp: nullptr, one value (azp_per_row false) or one per row. A's rows
// are prepared per call (a ^ 0x80 for a signed A, their sums) for sf_igemm_rows
static void sf_igemm_prepacked(int64_t M, int64_t N, int64_t K, const void* A, bool a_signed, const void* azp,
                               bool azp_per_row, const int8_t* bp, const int32_t* bc, int32_t* C, int64_t ldc,
                               bool allow_parallel) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // nothing contracted: every sum is empty
    for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(int32_t) * N);
    return;
  }
  const uint8_t* a8 = static_cast<const uint8_t*>(A);
  const uint8_t flip = a_signed ? 0x80 : 0;  // a + 128 as an unsigned byte
  const bool amx = sf_i8_on_amx(M), wide = !amx && sf_i8_kernel().wide;
  // A' rows: K values and zeros up to a multiple of 4 (of 64 and whole tiles on AMX)
  const int64_t lda = amx ? 4 * sf_i8_groups(K) : 4 * ((K + 3) / 4), rows = amx ? (M + 15) / 16 * 16 : M;
  const int64_t esz = wide ? 2 : 1;
  char* ws = static_cast<char*>(sf_workspace(1, size_t(rows) * lda * esz + 2 * sizeof(int32_t) * M + 64));
  int32_t* rowsum = reinterpret_cast<int32_t*>(ws);
  int32_t* zrow = rowsum + M;
  char* Ap = ws + (2 * sizeof(int32_t) * M + 63) / 64 * 64;
  const bool par = allow_parallel && sf_max_threads() > 1 && (double)M * N * K >= 1048576.0;
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t i = 0; i < rows; ++i) {
    if (i >= M) {
      std::memset(Ap + i * lda * esz, 0, lda * esz);
      continue;
    }
    rowsum[i] = wide ? sf_i8_pack_row(a8 + i * K, K, flip, reinterpret_cast<int16_t*>(Ap) + i * lda, lda)
                     : sf_i8_pack_row(a8 + i * K, K, flip, reinterpret_cast<uint8_t*>(Ap) + i * lda, lda);
    zrow[i] = sf_i8_zero(azp, azp_per_row, a_signed, i);
  }
  sf_igemm_rows(M, N, K, Ap, lda, rowsum, zrow, bp, bc, C, ldc, allow_parallel);
}

}  // namespace
