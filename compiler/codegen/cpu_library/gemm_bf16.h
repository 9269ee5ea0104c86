// ---- bfloat16 GEMM (PackedMatMulBf16: bfloat16 A times a packed bfloat16 weight, float32 sums) ------
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
namespace {

// The weight comes packed at compile time (ops.linalg.pack_bf16_panels): panels of SF_BF_PANEL columns,
// each [Kp / 2][16][2] (Kp = K rounded up to SF_BF_KSTEP), b[k, j] at [j / 16][k / 2][j % 16][k % 2], zero
// past K and N: the pairs along k that AMX's tdpbf16ps and AVX-512's vdpbf16ps multiply and add into one
// float32 lane, and a whole AMX tile (16 pairs of rows x 16 columns, 1 KB) at every multiple of 32 in k.
// A is copied per call into rows of Kp values, zero past K (and zero rows up to a whole tile for AMX).
// Every path computes each product of two bfloat16 values exactly in float32 and sums in float32; they
// differ in the order of the sums only, and in subnormals: AMX's tdpbf16ps and vdpbf16ps read subnormal
// inputs as zero and flush subnormal results (Intel's definitions of both; MXCSR is not read).
constexpr int64_t SF_BF_PANEL = 16;
constexpr int64_t SF_BF_KSTEP = 32;

static inline int64_t sf_bf_kp(int64_t K) { return (K + SF_BF_KSTEP - 1) / SF_BF_KSTEP * SF_BF_KSTEP; }

#if defined(__x86_64__)
// whether the CPU has AMX with the products of CPUID.7.0:EDX bit `feature` (22: AMX-BF16, 25: AMX-INT8) and
// the kernel lets this process use the tile registers (Linux asks each process to request them:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once for all its threads)
static bool sf_amx_usable(int feature) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << feature)) || !(d & (1u << 24))) return false;
#if defined(SYS_arch_prctl)
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
  return false;
#endif
}

static bool sf_avx512bf16_usable() {
  unsigned a, b, c, d;
  return __builtin_cpu_supports("avx512f") && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}
#endif

// the kernels a bfloat16 product runs on (once per process): SF_ISA_AMX (tiles), SF_ISA_AVX512BF16
// (vdpbf16ps), or SF_ISA_GENERIC: both operands widened to float32 and the float32 GEMM (whichever
// kernel sf_ukr picked)
static int sf_bf16_isa() {
  static const int isa = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int cap = sf_isa_cap();
    if (cap >= SF_ISA_AMX && sf_amx_usable(22)) return int(SF_ISA_AMX);
    if (cap >= SF_ISA_AVX512BF16 && sf_avx512bf16_usable()) return int(SF_ISA_AVX512BF16);
#endif
    return int(SF_ISA_GENERIC);
  }();
  return isa;
}

// Ap[rows_padded][Kp] = A's rows [0, M) (lda elements apart), zero past K and in the rows [M, rows_padded)
static void sf_bf_pack_a(int64_t M, int64_t K, const uint16_t* __restrict__ A, int64_t lda, int64_t rows_padded,
                         int64_t Kp, uint16_t* __restrict__ Ap, bool par) {
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t i = 0; i < rows_padded; ++i) {
    uint16_t* dst = Ap + i * Kp;
    if (i < M) {
      std::memcpy(dst, A + i * lda, sizeof(uint16_t) * K);
      std::memset(dst + K, 0, sizeof(uint16_t) * (Kp - K));
    } else {
      std::memset(dst, 0, sizeof(uint16_t) * Kp);
    }
  }
}

// C[i0 + r, j0 + c] = alpha * T[r][c] (+ bias) for the rows and columns of a block of T (ldt floats a row)
// that lie inside C (the float32 GEMM's epilogue on the copied block)
static inline void sf_bf_store(const float* __restrict__ T, int64_t ldt, int64_t rows, int64_t cols, float* C,
                               int64_t ldc, int64_t i0, int64_t j0, float alpha, const float* bias, int64_t rbs,
                               int64_t cbs) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(C + (i0 + r) * ldc + j0, T + r * ldt, sizeof(float) * cols);
  if (alpha != 1.0f || bias) sf_gemm_epilogue(C, ldc, i0, i0 + rows, j0, j0 + cols, alpha, bias, rbs, cbs);
}

#if defined(__x86_64__)
// ---- AMX: blocks of 2 x 2 tiles of 16 x 16 float32 sums ----
struct SfAmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// every tile 16 rows of 64 bytes: 0-3 the sums (16 x 16 float32), 4-5 A (16 rows x 32 bfloat16), 6-7 B
// (16 pairs of rows x 16 columns x 2); the integer GEMM's tiles have the same shapes (gemm_int8.h). A constant in memory: GCC's _tile_loadconfig tells the compiler it
// reads 8 bytes, so a configuration built on the stack lost its other zeros to dead-store elimination
alignas(64) static const SfAmxConfig sf_amx_config = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

__attribute__((target("amx-tile")))
static void sf_amx_configure() { _tile_loadconfig(&sf_amx_config); }

__attribute__((target("amx-tile")))
static void sf_amx_release() { _tile_release(); }

// T[32][32] (rows 16.. with MT = 2, columns 16.. with NT = 2) = the 16 MT rows of A (lda bytes apart) . the
// NT panels at B0 (ldp bytes apart) over `steps` steps of k, each 64 bytes of A's rows and a whole tile of
// 1 KB of each panel: bfloat16 pairs (tdpbf16ps, float32 sums) or, with INT8, unsigned bytes of A times
// signed bytes of B in groups of 4 (tdpbusd, int32 sums); only the instructions of the one asked run
template <int MT, int NT, bool INT8>
__attribute__((target("amx-tile,amx-bf16,amx-int8")))
static void sf_amx_block(const char* A, int64_t lda, int64_t steps, const char* B0, int64_t ldp, void* T) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NT > 1) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, A + 64 * s, lda);
    _tile_loadd(6, B0 + 1024 * s, 64);
    if constexpr (NT > 1) _tile_loadd(7, B0 + ldp + 1024 * s, 64);
    if constexpr (MT > 1) _tile_loadd(5, A + 16 * lda + 64 * s, lda);
    if constexpr (INT8) {
      _tile_dpbusd(0, 4, 6);
      if constexpr (NT > 1) _tile_dpbusd(1, 4, 7);
      if constexpr (MT > 1) _tile_dpbusd(2, 5, 6);
      if constexpr (MT > 1 && NT > 1) _tile_dpbusd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NT > 1) _tile_dpbf16ps(1, 4, 7);
      if constexpr (MT > 1) _tile_dpbf16ps(2, 5, 6);
      if constexpr (MT > 1 && NT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  char* t = static_cast<char*>(T);  // (rows of 32 four-byte sums)
  _tile_stored(0, t, 128);
  if constexpr (NT > 1) _tile_stored(1, t + 64, 128);
  if constexpr (MT > 1) _tile_stored(2, t + 16 * 128, 128);
  if constexpr (MT > 1 && NT > 1) _tile_stored(3, t + 16 * 128 + 64, 128);
}

// Every block of 32 x 32 sums of mt row tiles of A (whole tiles, lda bytes a row) by np panels (ldp bytes
// apart) on AMX, handed to out(T, i0, j0) (T: 32 x 32 floats or int32s; rows and columns past the matrix
// are the padding's): the threads split each chunk of 8 row blocks' (column block, row block) pairs in
// order, so a thread's blocks share B's columns while the chunk's A (up to 256 rows) stays in the cache
template <bool INT8, typename Out>
static void sf_amx_blocks(int64_t mt, int64_t np, int64_t steps, const char* A, int64_t lda, const char* B,
                          int64_t ldp, bool par, Out out) {
  const int64_t rb = (mt + 1) / 2, cb = (np + 1) / 2, chunk = 8;
  #pragma omp parallel if (par)
  {
    sf_amx_configure();
    alignas(64) float T[32 * 32];
    for (int64_t r0 = 0; r0 < rb; r0 += chunk) {
      const int64_t nr = std::min(chunk, rb - r0);
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < cb * nr; ++t) {
        const int64_t c = t / nr, r = r0 + t % nr;
        const bool two_m = 2 * r + 1 < mt, two_n = 2 * c + 1 < np;
        const char* Ab = A + 32 * r * lda;
        const char* B0 = B + 2 * c * ldp;
        if (two_m && two_n) sf_amx_block<2, 2, INT8>(Ab, lda, steps, B0, ldp, T);
        else if (two_m) sf_amx_block<2, 1, INT8>(Ab, lda, steps, B0, ldp, T);
        else if (two_n) sf_amx_block<1, 2, INT8>(Ab, lda, steps, B0, ldp, T);
        else sf_amx_block<1, 1, INT8>(Ab, lda, steps, B0, ldp, T);
        out(static_cast<const void*>(T), 32 * r, 32 * c);
      }
    }
    sf_amx_release();
  }
}

// sf_bf_store into a bfloat16 C with AVX-512F (every CPU with AMX has it), 16 values at a time, rounded as
// sf_float_to_bf16 rounds them (sf_bf16_round16)
__attribute__((target("avx512f")))
static void sf_bf_store16(const float* __restrict__ T, int64_t ldt, int64_t rows, int64_t cols, sf_bf16* C,
                          int64_t ldc, int64_t i0, int64_t j0, float alpha, const float* bias, int64_t rbs,
                          int64_t cbs) {
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t r = 0; r < rows; ++r) {
    const float* t = T + r * ldt;
    uint16_t* c = reinterpret_cast<uint16_t*>(C + (i0 + r) * ldc + j0);
    const float* b = bias ? bias + (i0 + r) * rbs + j0 * cbs : nullptr;
    for (int64_t j = 0; j < cols; j += 16) {
      const int64_t n = std::min<int64_t>(16, cols - j);
      const __mmask16 m = (__mmask16)((1u << n) - 1u);
      __m512 v = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, t + j));
      if (b && cbs == 0) {
        v = _mm512_add_ps(v, _mm512_set1_ps(b[0]));
      } else if (b && cbs == 1) {
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + j));
      } else if (b) {
        alignas(64) float bb[16] = {};
        for (int64_t q = 0; q < n; ++q) bb[q] = b[(j + q) * cbs];
        v = _mm512_add_ps(v, _mm512_load_ps(bb));
      }
      // (the rounded value's upper 16 bits, vpmovdw)
      _mm512_mask_cvtepi32_storeu_epi16(c + j, m, _mm512_srli_epi32(_mm512_castps_si512(sf_bf16_round16(v)), 16));
    }
  }
}

// sf_bf_store into a float32 C, or sf_bf_store16 into a bfloat16 one
template <typename CT>
static inline void sf_bf_store_to(const float* __restrict__ T, int64_t ldt, int64_t rows, int64_t cols, CT* C,
                                  int64_t ldc, int64_t i0, int64_t j0, float alpha, const float* bias, int64_t rbs,
                                  int64_t cbs) {
  if constexpr (std::is_same<CT, sf_bf16>::value)
    sf_bf_store16(T, ldt, rows, cols, C, ldc, i0, j0, alpha, bias, rbs, cbs);
  else
    sf_bf_store(T, ldt, rows, cols, C, ldc, i0, j0, alpha, bias, rbs, cbs);
}

// C = alpha * (A @ B) + bias on AMX: A packed to whole tiles, rows of Kp values; C float32 or bfloat16
template <typename CT>
static void sf_bgemm_amx(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bp,
                         CT* C, int64_t ldc, float alpha, const float* bias, int64_t rbs, int64_t cbs, bool par) {
  const int64_t Kp = sf_bf_kp(K), pstride = Kp * SF_BF_PANEL;
  const int64_t mt = (M + 15) / 16, np = (N + SF_BF_PANEL - 1) / SF_BF_PANEL;
  uint16_t* Ap = static_cast<uint16_t*>(sf_workspace(1, sizeof(uint16_t) * mt * 16 * Kp));
  sf_bf_pack_a(M, K, A, lda, mt * 16, Kp, Ap, par);
  sf_amx_blocks<false>(mt, np, Kp / SF_BF_KSTEP, reinterpret_cast<const char*>(Ap), 2 * Kp,
                       reinterpret_cast<const char*>(Bp), 2 * pstride, par, [&](const void* T, int64_t i0, int64_t j0) {
    const int64_t rows = std::min<int64_t>(32, M - i0), cols = std::min<int64_t>(32, N - j0);
    sf_bf_store_to(static_cast<const float*>(T), 32, rows, cols, C, ldc, i0, j0, alpha, bias, rbs, cbs);
  });
}

// ---- AVX-512 BF16: MR rows x 32 columns (two panels), vdpbf16ps on pairs of k ----
// T[MR][32] (+)= A's MR rows (lda values apart, at the block's first pair) @ the panels at B0 and B1 (B1 = B0
// where the tile has one panel: its sums are not stored), g pairs of k
template <int MR>
__attribute__((target("avx512f,avx512bf16")))
static void sf_bf_ukr_dp(int64_t g, const uint16_t* __restrict__ A, int64_t lda, const uint16_t* __restrict__ B0,
                         const uint16_t* __restrict__ B1, float* __restrict__ T, bool first) {
  __m512 acc[MR][2];
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(T + 32 * i);
    acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(T + 32 * i + 16);
  }
  for (int64_t p = 0; p < g; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B0 + 32 * p);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B1 + 32 * p);
    #pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      int32_t two;
      std::memcpy(&two, A + i * lda + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(two);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(T + 32 * i, acc[i][0]);
    _mm512_storeu_ps(T + 32 * i + 16, acc[i][1]);
  }
}

using SfBfUkr = void (*)(int64_t, const uint16_t*, int64_t, const uint16_t*, const uint16_t*, float*, bool);
constexpr int64_t SF_BF_MR = 12;
// pairs of k per block: 2 panels x 512 k (64 KB) of B stay in L2 across A's rows
constexpr int64_t SF_BF_KB2 = 256;

// The vdpbf16ps GEMM of Ap [M][Kp] (rows packed Kp apart, zero past K: sf_bf_pack_a's, or a conv's weight rows as
// packed at compile time) by the panels Bp: the threads split the columns in tiles of 32; each tile runs down
// all of K in blocks, A's rows 12 at a time, its sums in a per-thread buffer T [M][32], which
// store(T, j0, cols) then writes out (the tile's columns [j0, j0 + cols))
template <typename Store>
static void sf_bgemm_dp_blocks(int64_t M, int64_t N, int64_t K, const uint16_t* Ap, const uint16_t* Bp, bool par,
                               Store&& store) {
  static const SfBfUkr fn[SF_BF_MR] = {sf_bf_ukr_dp<1>, sf_bf_ukr_dp<2>, sf_bf_ukr_dp<3>, sf_bf_ukr_dp<4>,
                                       sf_bf_ukr_dp<5>, sf_bf_ukr_dp<6>, sf_bf_ukr_dp<7>, sf_bf_ukr_dp<8>,
                                       sf_bf_ukr_dp<9>, sf_bf_ukr_dp<10>, sf_bf_ukr_dp<11>, sf_bf_ukr_dp<12>};
  const int64_t Kp = sf_bf_kp(K), pstride = Kp * SF_BF_PANEL, g = Kp / 2;
  const int64_t np = (N + SF_BF_PANEL - 1) / SF_BF_PANEL, tiles = (np + 1) / 2;
  #pragma omp parallel if (par && tiles > 1)
  {
    float* T = static_cast<float*>(sf_workspace(2, sizeof(float) * M * 32));
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t j0 = 32 * t, cols = std::min<int64_t>(32, N - j0);
      const uint16_t* B0 = Bp + 2 * t * pstride;
      const uint16_t* B1 = cols > SF_BF_PANEL ? B0 + pstride : B0;
      for (int64_t g0 = 0; g0 < g; g0 += SF_BF_KB2) {
        const int64_t gn = std::min(SF_BF_KB2, g - g0);
        for (int64_t i0 = 0; i0 < M; i0 += SF_BF_MR) {
          const int64_t mr = std::min(SF_BF_MR, M - i0);
          fn[mr - 1](gn, Ap + i0 * Kp + 2 * g0, Kp, B0 + 32 * g0, B1 + 32 * g0, T + i0 * 32, g0 == 0);
        }
      }
      store(static_cast<const float*>(T), j0, cols);
    }
  }
}

// C = alpha * (A @ B) + bias with vdpbf16ps (A's rows packed first, unless they already lie Kp apart with
// nothing past K: K a multiple of the k step, rows contiguous); C float32 or bfloat16
template <typename CT>
static void sf_bgemm_dp(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bp,
                        CT* C, int64_t ldc, float alpha, const float* bias, int64_t rbs, int64_t cbs, bool par) {
  const int64_t Kp = sf_bf_kp(K);
  const uint16_t* Ap = A;
  if (Kp != K || lda != K) {
    uint16_t* packed = static_cast<uint16_t*>(sf_workspace(1, sizeof(uint16_t) * M * Kp));
    sf_bf_pack_a(M, K, A, lda, M, Kp, packed, par);
    Ap = packed;
  }
  sf_bgemm_dp_blocks(M, N, K, Ap, Bp, par, [&](const float* T, int64_t j0, int64_t cols) {
    sf_bf_store_to(T, 32, M, cols, C, ldc, 0, j0, alpha, bias, rbs, cbs);
  });
}
#endif

// ---- any CPU: both operands widened to float32 for the float32 GEMM (its kernel, its blocking) ----
static void sf_bgemm_widened(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bp,
                             float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs, int64_t cbs,
                             bool par) {
  const int64_t pstride = sf_bf_kp(K) * SF_BF_PANEL;
  if (M <= 2) {
    // a row or two (decoding): the panels read once, in place, the threads splitting them (widening B
    // first took 3.5x the float32 GEMV's time at 1 x 768 @ 768 x 3072)
    const int64_t np = (N + SF_BF_PANEL - 1) / SF_BF_PANEL;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t pi = 0; pi < np; ++pi) {
      const uint16_t* panel = Bp + pi * pstride;
      const int64_t j0 = pi * SF_BF_PANEL, cols = std::min<int64_t>(SF_BF_PANEL, N - j0);
      for (int64_t i = 0; i < M; ++i) {
        const uint16_t* a = A + i * lda;
        float acc[SF_BF_PANEL] = {};
        for (int64_t k = 0; k + 1 < K; k += 2) {
          const float a0 = sf_bf16_to_float(sf_bf16{a[k]}), a1 = sf_bf16_to_float(sf_bf16{a[k + 1]});
          const uint16_t* pair = panel + (k >> 1) * 32;
          for (int q = 0; q < SF_BF_PANEL; ++q)
            acc[q] += a0 * sf_bf16_to_float(sf_bf16{pair[2 * q]}) + a1 * sf_bf16_to_float(sf_bf16{pair[2 * q + 1]});
        }
        if (K & 1) {
          const float a0 = sf_bf16_to_float(sf_bf16{a[K - 1]});
          const uint16_t* pair = panel + ((K - 1) >> 1) * 32;
          for (int q = 0; q < SF_BF_PANEL; ++q) acc[q] += a0 * sf_bf16_to_float(sf_bf16{pair[2 * q]});
        }
        sf_bf_store(acc, SF_BF_PANEL, 1, cols, C, ldc, i, j0, alpha, bias, rbs, cbs);
      }
    }
    return;
  }
  float* Af = static_cast<float*>(sf_workspace(3, sizeof(float) * M * K));  // (slot 0 may hold the bias)
  #pragma omp parallel for schedule(static) if (par)
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) Af[i * K + k] = sf_bf16_to_float(sf_bf16{A[i * lda + k]});
  // columns jc + p*nr .. of the chunk (nc of them; zeros past), rows k0 .. k0 + kc, as [kc][nr]: a whole
  // panel's 16 columns at a time where they lie in one (the kernels' widths are 8, 16 or 32 columns, the
  // chunks start at multiples of 16), two rows of k from each 64 bytes of pairs, in loops GCC vectorizes
  auto pack = [=](int64_t jc, int64_t nc, int64_t p, int64_t nr, int64_t k0, int64_t kc, float* Bf) {
    for (int64_t q0 = 0; q0 < nr; q0 += SF_BF_PANEL) {
      const int64_t j0 = jc + p * nr + q0, w = std::min<int64_t>(SF_BF_PANEL, nr - q0);
      if (p * nr + q0 >= nc) {
        for (int64_t k = 0; k < kc; ++k) std::memset(Bf + k * nr + q0, 0, sizeof(float) * w);
        continue;
      }
      const uint16_t* panel = Bp + (j0 / SF_BF_PANEL) * pstride;
      const int64_t c0 = j0 % SF_BF_PANEL;  // (columns past nc are the panel's zeros, or the next panel's:
      // the driver stores none of them)
      for (int64_t k = k0; k < k0 + kc; ++k) {
        const uint16_t* pair = panel + (k >> 1) * 32 + 2 * c0 + (k & 1);
        float* dst = Bf + (k - k0) * nr + q0;
        for (int64_t q = 0; q < w; ++q) dst[q] = sf_bf16_to_float(sf_bf16{pair[2 * q]});
      }
    }
  };
  // the block of m rows from i0 and n columns from j0 (a multiple of SF_BF_PANEL) on the calling thread
  auto block = [&](int64_t i0, int64_t m, int64_t j0, int64_t n) {
    sf_sgemm_packed(m, n, K, Af + i0 * K, K, 1, sf_pack_from(pack, j0), C + i0 * ldc + j0, ldc, alpha,
                    sf_bias_at(bias, rbs, cbs, i0, j0), rbs, cbs);
  };
  if (par)  // threads that own blocks of C (sf_gemm_blocks), each widening its own columns of B
    sf_gemm_blocks(M, N, K, std::max<int64_t>(sf_ukr().nr, SF_BF_PANEL), 80.0, sf_max_threads(), block);
  else
    block(0, M, 0, N);
}

// C[M, N] (rows ldc apart) = alpha * (A @ B) + bias for A [M, K] bfloat16 (rows lda values apart) and B packed
// as above (bias[i * rbs + j * cbs], or nullptr)
static void sf_bgemm_prepacked(int64_t M, int64_t N, int64_t K, const sf_bf16* A, int64_t lda, const sf_bf16* B,
                               float* C, int64_t ldc, float alpha, const float* bias, int64_t rbs, int64_t cbs,
                               bool allow_parallel) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    sf_gemm_empty_k(M, N, C, ldc, alpha, bias, rbs, cbs);
    return;
  }
  const uint16_t* a = reinterpret_cast<const uint16_t*>(A);
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(B);
  const bool par = sf_gemm_parallel(M, N, K, allow_parallel);
#if defined(__x86_64__)
  const int isa = sf_bf16_isa();
  if (isa == SF_ISA_AMX) return sf_bgemm_amx(M, N, K, a, lda, bp, C, ldc, alpha, bias, rbs, cbs, par);
  if (isa == SF_ISA_AVX512BF16) return sf_bgemm_dp(M, N, K, a, lda, bp, C, ldc, alpha, bias, rbs, cbs, par);
#endif
  sf_bgemm_widened(M, N, K, a, lda, bp, C, ldc, alpha, bias, rbs, cbs, par);
}

// ... with C bfloat16 (each value rounded to nearest even as it is stored: a bfloat16 model's product): stored
// from AMX's blocks or the vdpbf16ps kernel's sums directly, else through a float32 C
static void sf_bgemm_prepacked_bf16(int64_t M, int64_t N, int64_t K, const sf_bf16* A, int64_t lda, const sf_bf16* B,
                                    sf_bf16* C, int64_t ldc, float alpha, const float* bias, int64_t rbs, int64_t cbs,
                                    bool allow_parallel) {
  if (M <= 0 || N <= 0) return;
#if defined(__x86_64__)
  const int isa = K > 0 ? sf_bf16_isa() : -1;
  const uint16_t* a = reinterpret_cast<const uint16_t*>(A);
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(B);
  if (isa == SF_ISA_AMX)
    return sf_bgemm_amx(M, N, K, a, lda, bp, C, ldc, alpha, bias, rbs, cbs, sf_gemm_parallel(M, N, K, allow_parallel));
  if (isa == SF_ISA_AVX512BF16)
    return sf_bgemm_dp(M, N, K, a, lda, bp, C, ldc, alpha, bias, rbs, cbs, sf_gemm_parallel(M, N, K, allow_parallel));
#endif
  float* t = static_cast<float*>(sf_workspace(5, sizeof(float) * M * N));
  sf_bgemm_prepacked(M, N, K, A, lda, B, t, N, alpha, bias, rbs, cbs, allow_parallel);
  #pragma omp parallel for schedule(static) if (allow_parallel && M * N >= (1 << 16))
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = sf_float_to_bf16(t[i * N + j]);
}

}  // namespace
