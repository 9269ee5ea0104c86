// ---- GEMM (float64) ---------------------------------------------------------------------------------
namespace {

// C[M, N] = alpha * A[M, K] @ B[K, N] (+ bias[i * rbs + j * cbs]; null: none) for float64 products
// (rfcs/0002 "Float64 products"; they ran the generic nest, 46x onnxruntime's time). Goto's blocking: per
// K block of at most SF_DKC rows, B is packed by all threads into panels of nr columns ([kc][nr], zero past
// N), then each task (a block of up to 8 row panels times a range of column panels) packs its rows of A,
// scaled by alpha, into panels of mr rows ([kc][mr], zero past M) and runs the mr x nr micro-kernel over
// its column panels; the first K block stores C, the others add to it, and the last adds the bias.
constexpr int64_t SF_DKC = 256;
// products of fewer multiply-adds run on one thread (and a batch of them one per thread)
constexpr double SF_DSMALL = 262144.0;

typedef void (*SfDukrFn)(int64_t kc, const double* __restrict__ Ap, const double* __restrict__ Bp,
                         double* __restrict__ C, int64_t ldc, int64_t mr, int64_t nr, bool first);

#if defined(__x86_64__)
// MR x 16 tile, AVX-512 (A panels of 12 rows: a tail panel of MR rows computes those only)
template <int MR>
__attribute__((target("avx512f")))
static void sf_dukr_avx512(int64_t kc, const double* __restrict__ Ap, const double* __restrict__ Bp,
                           double* __restrict__ C, int64_t ldc, int64_t mr, int64_t nr, bool first) {
  __m512d acc[MR][2];
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_pd();
  for (int64_t k = 0; k < kc; ++k) {
    const __m512d b0 = _mm512_loadu_pd(Bp + 16 * k), b1 = _mm512_loadu_pd(Bp + 16 * k + 8);
    const double* a = Ap + 12 * k;
    #pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512d av = _mm512_set1_pd(a[i]);
      acc[i][0] = _mm512_fmadd_pd(av, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_pd(av, b1, acc[i][1]);
    }
  }
  const __mmask8 m0 = nr >= 8 ? (__mmask8)0xff : (__mmask8)((1u << nr) - 1u);
  const __mmask8 m1 = nr >= 16 ? (__mmask8)0xff : (nr > 8 ? (__mmask8)((1u << (nr - 8)) - 1u) : (__mmask8)0);
  #pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    if (i >= mr) break;
    double* cr = C + i * ldc;
    __m512d v0 = acc[i][0], v1 = acc[i][1];
    if (!first) {
      v0 = _mm512_add_pd(v0, _mm512_maskz_loadu_pd(m0, cr));
      v1 = _mm512_add_pd(v1, _mm512_maskz_loadu_pd(m1, cr + 8));
    }
    _mm512_mask_storeu_pd(cr, m0, v0);
    _mm512_mask_storeu_pd(cr + 8, m1, v1);
  }
}

// MR x 8 tile, AVX2 + FMA (A panels of 6 rows)
template <int MR>
__attribute__((target("avx2,fma")))
static void sf_dukr_avx2(int64_t kc, const double* __restrict__ Ap, const double* __restrict__ Bp,
                         double* __restrict__ C, int64_t ldc, int64_t mr, int64_t nr, bool first) {
  __m256d acc[MR][2];
  #pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_pd();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256d b0 = _mm256_loadu_pd(Bp + 8 * k), b1 = _mm256_loadu_pd(Bp + 8 * k + 4);
    const double* a = Ap + 6 * k;
    #pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256d av = _mm256_broadcast_sd(a + i);
      acc[i][0] = _mm256_fmadd_pd(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_pd(av, b1, acc[i][1]);
    }
  }
  // lane j of the two vectors is column j (0..3) and 4 + j: stored where the column is below nr
  const __m256i lanes = _mm256_set_epi64x(3, 2, 1, 0);
  const __m256i k0 = _mm256_cmpgt_epi64(_mm256_set1_epi64x(nr), lanes);
  const __m256i k1 = _mm256_cmpgt_epi64(_mm256_set1_epi64x(nr - 4), lanes);
  #pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    if (i >= mr) break;
    double* cr = C + i * ldc;
    __m256d v0 = acc[i][0], v1 = acc[i][1];
    if (!first) {
      v0 = _mm256_add_pd(v0, _mm256_maskload_pd(cr, k0));
      v1 = _mm256_add_pd(v1, _mm256_maskload_pd(cr + 4, k1));
    }
    _mm256_maskstore_pd(cr, k0, v0);
    _mm256_maskstore_pd(cr + 4, k1, v1);
  }
}
#endif

// 4 x 8 tile, portable
static void sf_dukr_generic(int64_t kc, const double* __restrict__ Ap, const double* __restrict__ Bp,
                            double* __restrict__ C, int64_t ldc, int64_t mr, int64_t nr, bool first) {
  double t[4][8] = {};
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < 4; ++i) {
      const double a = Ap[4 * k + i];
      for (int j = 0; j < 8; ++j) t[i][j] += a * Bp[8 * k + j];
    }
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) C[i * ldc + j] = first ? t[i][j] : C[i * ldc + j] + t[i][j];
}

// fn[MR - 1]: the kernel for a panel of MR rows (every entry the full one where a kernel has one size)
struct SfDukr { SfDukrFn fn[12]; int64_t mr, nr; };

static SfDukr sf_pick_dukr() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (sf_isa_cap() >= SF_ISA_AVX512 && __builtin_cpu_supports("avx512f"))
    return {{sf_dukr_avx512<1>, sf_dukr_avx512<2>, sf_dukr_avx512<3>, sf_dukr_avx512<4>, sf_dukr_avx512<5>,
             sf_dukr_avx512<6>, sf_dukr_avx512<7>, sf_dukr_avx512<8>, sf_dukr_avx512<9>, sf_dukr_avx512<10>,
             sf_dukr_avx512<11>, sf_dukr_avx512<12>}, 12, 16};
  if (sf_isa_cap() >= SF_ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {{sf_dukr_avx2<1>, sf_dukr_avx2<2>, sf_dukr_avx2<3>, sf_dukr_avx2<4>, sf_dukr_avx2<5>, sf_dukr_avx2<6>},
            6, 8};
#endif
  SfDukr u = {{}, 4, 8};
  for (auto& f : u.fn) f = sf_dukr_generic;
  return u;
}

static const SfDukr& sf_dukr() { static const SfDukr u = sf_pick_dukr(); return u; }

// rows [i0, i0 + rows) and K rows [k0, k0 + kc) of alpha * A into Ap, panels of mr rows ([kc][mr], zero past rows)
static void sf_dpack_a(const double* __restrict__ A, int64_t rsa, int64_t csa, int64_t i0, int64_t rows, int64_t k0,
                       int64_t kc, int64_t mr, double alpha, double* __restrict__ Ap) {
  for (int64_t p = 0; p < rows; p += mr, Ap += kc * mr) {
    const int64_t n = std::min(mr, rows - p);
    for (int64_t k = 0; k < kc; ++k) {
      const double* a = A + (i0 + p) * rsa + (k0 + k) * csa;
      double* d = Ap + k * mr;
      for (int64_t r = 0; r < n; ++r) d[r] = alpha * a[r * rsa];
      for (int64_t r = n; r < mr; ++r) d[r] = 0.0;
    }
  }
}

// columns [j0, j0 + nr) (those below N) and K rows [k0, k0 + kc) of B into Bp, [kc][nr] (zero past N)
static void sf_dpack_b(const double* __restrict__ B, int64_t rsb, int64_t csb, int64_t N, int64_t j0, int64_t k0,
                       int64_t kc, int64_t nr, double* __restrict__ Bp) {
  const int64_t n = std::min(nr, N - j0);
  for (int64_t k = 0; k < kc; ++k) {
    const double* b = B + (k0 + k) * rsb + j0 * csb;
    double* d = Bp + k * nr;
    if (csb == 1) { for (int64_t j = 0; j < n; ++j) d[j] = b[j]; }
    else { for (int64_t j = 0; j < n; ++j) d[j] = b[j * csb]; }
    for (int64_t j = n; j < nr; ++j) d[j] = 0.0;
  }
}

// par: threads may share the product (sf_dgemm_batched runs small products one per thread)
static void sf_dgemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t rsa, int64_t csa, const double* B,
                     int64_t rsb, int64_t csb, double* C, int64_t ldc, double alpha, const double* bias, int64_t rbs,
                     int64_t cbs, bool par = true) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = bias ? bias[i * rbs + j * cbs] : 0.0;
    return;
  }
  const SfDukr& u = sf_dukr();
  const int64_t mr = u.mr, nr = u.nr;
  const int64_t nkb = (K + SF_DKC - 1) / SF_DKC, kcb = (K + nkb - 1) / nkb;
  const int64_t mp = (M + mr - 1) / mr, np = (N + nr - 1) / nr;
  const int nt = sf_max_threads();
  par = par && nt > 1 && (double)M * N * K >= SF_DSMALL;
  // tasks: row blocks of up to 8 panels times column ranges, more ranges until each thread has two
  const int64_t ntm = (mp + 7) / 8;
  int64_t ntn = (np + 31) / 32;
  while (par && ntm * ntn < 2 * nt && ntn < np) ++ntn;
  const int64_t ntask = ntm * ntn;
  double* Bp = static_cast<double*>(sf_workspace(1, sizeof(double) * kcb * np * nr));
  #pragma omp parallel num_threads(nt) if (par)
  {
    double* Ap = static_cast<double*>(sf_workspace(2, sizeof(double) * kcb * 8 * mr));
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t pc = kb * kcb, kc = std::min(kcb, K - pc);
      #pragma omp for schedule(static)
      for (int64_t q = 0; q < np; ++q) sf_dpack_b(B, rsb, csb, N, q * nr, pc, kc, nr, Bp + q * kc * nr);
      int64_t packed = -1;  // the row block whose A this thread has packed for this K block
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < ntask; ++t) {
        const int64_t tm = t / ntn, tn = t % ntn;
        const int64_t i0 = tm * 8 * mr, i1 = std::min(M, i0 + 8 * mr);
        if (packed != tm) sf_dpack_a(A, rsa, csa, i0, i1 - i0, pc, kc, mr, alpha, Ap);
        packed = tm;
        const int64_t q0 = np * tn / ntn, q1 = np * (tn + 1) / ntn;
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t j = q * nr, cols = std::min(nr, N - j);
          for (int64_t i = i0; i < i1; i += mr) {
            const int64_t rows = std::min(mr, i1 - i);
            u.fn[rows - 1](kc, Ap + (i - i0) * kc, Bp + q * kc * nr, C + i * ldc + j, ldc, rows, cols, kb == 0);
          }
        }
        if (bias && kb == nkb - 1)
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t j = q0 * nr; j < std::min(N, q1 * nr); ++j) C[i * ldc + j] += bias[i * rbs + j * cbs];
      }
    }
  }
}

// sf_dgemm over the batch dims bshape[nb] of C (element strides astr, bstr, cstr per dim; 0: broadcast); the
// products run one per thread where there are at least two per thread, or small ones at least one (16 products
// of [128, 64] @ [64, 128] took 4.2x onnxruntime's time each shared by the threads)
static void sf_dgemm_batched(int64_t nb, const int64_t* bshape, const int64_t* astr, const int64_t* bstr,
                             const int64_t* cstr, int64_t M, int64_t N, int64_t K, const double* A, int64_t rsa,
                             int64_t csa, const double* B, int64_t rsb, int64_t csb, double* C, int64_t ldc,
                             double alpha, const double* bias, int64_t rbs, int64_t cbs) {
  int64_t count = 1;
  for (int64_t d = 0; d < nb; ++d) count *= bshape[d];
  const int nt = sf_max_threads();
  const bool each = count >= 2 * nt || (count >= nt && (double)M * N * K < SF_DSMALL);
  #pragma omp parallel for schedule(static) if (each && nt > 1)
  for (int64_t b = 0; b < count; ++b) {
    int64_t ao = 0, bo = 0, co = 0;
    for (int64_t d = nb - 1, r = b; d >= 0; --d) {
      const int64_t v = r % bshape[d];
      r /= bshape[d];
      ao += v * astr[d];
      bo += v * bstr[d];
      co += v * cstr[d];
    }
    sf_dgemm(M, N, K, A + ao, rsa, csa, B + bo, rsb, csb, C + co, ldc, alpha, bias, rbs, cbs, !each);
  }
}

}  // namespace
