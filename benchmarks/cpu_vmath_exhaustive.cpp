// Exhaustive check of the exponentials in vector form (cpu_library/vmath.h, rfcs/0002 "Exponentials in vector
// form"): on all 2^32 floats, sfv_exp's forms (4 lanes SSE4.2, 8 lanes AVX and AVX2 + FMA, 16 lanes AVX-512) and
// its scalar clones against the inline sf_exp vectorized by GCC at the same instruction set, and sfv_exp_nonpos's
// against sf_exp_nonpos on every float <= 0 and every NaN: the same bits expected (a NaN for a NaN). The
// instruction sets this CPU lacks are skipped. Prints the differing counts (0 expected) and exits 1 if any. About
// two minutes on 2 cores; an argument S checks every S-th bit pattern instead (tests/codegen/test_vmath.py: 251):
//   g++ -std=c++17 -O3 -fopenmp -march=x86-64-v2 -mtune=generic -fno-math-errno -fno-trapping-math -fwrapv \
//       benchmarks/cpu_vmath_exhaustive.cpp -o /tmp/vmath_check && /tmp/vmath_check [S]
#define SF_VMATH_UNIT 1
#include "../compiler/codegen/cpu_library/helpers.h"
#define SF_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#include "../compiler/codegen/cpu_library/vmath.h"
#include <cstdio>
#include <cstdlib>
#include <vector>

SF_VMATH_DEFINE(sfv_exp, sf_exp, false)
SF_VMATH_DEFINE(sfv_exp_nonpos, sf_exp_nonpos, true)
// the scalar clones by their local names (GCC's target_clones suffixes)
extern "C" float exp_v2(float) __asm__("sfv_exp.default");
extern "C" float exp_v3(float) __asm__("sfv_exp.arch_x86_64_v3");
extern "C" float exp_v4(float) __asm__("sfv_exp.arch_x86_64_v4");
extern "C" float nonpos_v2(float) __asm__("sfv_exp_nonpos.default");
extern "C" float nonpos_v3(float) __asm__("sfv_exp_nonpos.arch_x86_64_v3");
extern "C" float nonpos_v4(float) __asm__("sfv_exp_nonpos.arch_x86_64_v4");

typedef void (*Fill)(const float*, float*, float*, int64_t);
// the references: the inline helpers in a loop GCC vectorizes, compiled for each instruction set
#define REF(NAME, ATTR)                                                        \
  ATTR void NAME(const float* x, float* e, float* z, int64_t n) {             \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) {                      \
      e[i] = sf_exp(x[i]);                                                     \
      z[i] = sf_exp_nonpos(x[i]);                                              \
    }                                                                          \
  }
REF(ref_v2, )
REF(ref_v3, __attribute__((target("arch=x86-64-v3"))))
REF(ref_v4, __attribute__((target("arch=x86-64-v4"))))
// the forms under test, over the same values
#define FORM(NAME, ATTR, T, L, LOAD, STORE, E, Z)                              \
  ATTR void NAME(const float* x, float* e, float* z, int64_t n) {             \
    for (int64_t i = 0; i < n; i += L) {                                       \
      const T v = LOAD(x + i);                                                 \
      STORE(e + i, E(v));                                                      \
      STORE(z + i, Z(v));                                                      \
    }                                                                          \
  }
FORM(form_b, , __m128, 4, _mm_loadu_ps, _mm_storeu_ps, _ZGVbN4v_sfv_exp, _ZGVbN4v_sfv_exp_nonpos)
FORM(form_c, __attribute__((target("avx"))), __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _ZGVcN8v_sfv_exp,
     _ZGVcN8v_sfv_exp_nonpos)
FORM(form_d, __attribute__((target("avx2,fma"))), __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _ZGVdN8v_sfv_exp,
     _ZGVdN8v_sfv_exp_nonpos)
FORM(form_e, __attribute__((target("avx512f"))), __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _ZGVeN16v_sfv_exp,
     _ZGVeN16v_sfv_exp_nonpos)
#define SCALAR(NAME, E, Z)                                                     \
  void NAME(const float* x, float* e, float* z, int64_t n) {                  \
    for (int64_t i = 0; i < n; ++i) {                                          \
      e[i] = E(x[i]);                                                          \
      z[i] = Z(x[i]);                                                          \
    }                                                                          \
  }
SCALAR(scalar_v2, exp_v2, nonpos_v2)
SCALAR(scalar_v3, exp_v3, nonpos_v3)
SCALAR(scalar_v4, exp_v4, nonpos_v4)

static bool same(float a, float b) { return (a != a) ? (b != b) : (b == b && sf_float_to_bits(a) == sf_float_to_bits(b)); }

static uint64_t stride = 1, failures = 0;

// differing results of `got` against `ref` over every float (nonpos: the floats <= 0 and the NaNs), or every
// stride-th bit pattern
static void check(const char* what, Fill ref, Fill got) {
  const int64_t N = 1 << 20;
  uint64_t de = 0, dz = 0;
  #pragma omp parallel reduction(+:de, dz)
  {
    std::vector<float> x(N), e0(N), z0(N), e1(N), z1(N);
    #pragma omp for schedule(dynamic)
    for (int64_t c = 0; c < int64_t(((uint64_t(1) << 32) / stride + N - 1) / N); ++c) {
      for (int64_t i = 0; i < N; ++i) x[i] = sf_bits_to_float(int32_t(uint32_t((c * N + i) * stride)));
      ref(x.data(), e0.data(), z0.data(), N);
      got(x.data(), e1.data(), z1.data(), N);
      for (int64_t i = 0; i < N; ++i) {
        if (!same(e0[i], e1[i]) && de++ < 3) printf("  %s exp(%a): %a, expected %a\n", what, x[i], e1[i], e0[i]);
        if ((x[i] <= 0.0f || x[i] != x[i]) && !same(z0[i], z1[i]) && dz++ < 3)
          printf("  %s exp_nonpos(%a): %a, expected %a\n", what, x[i], z1[i], z0[i]);
      }
    }
  }
  printf("%-34s exp differs %lu, exp_nonpos differs %lu\n", what, (unsigned long)de, (unsigned long)dz);
  failures += de + dz;
}

int main(int argc, char** argv) {
  if (argc > 1) stride = std::strtoull(argv[1], nullptr, 10);
  if (stride == 0) stride = 1;
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  check("4 lanes (SSE4.2) vs x86-64-v2", ref_v2, form_b);
  check("scalar clone default vs x86-64-v2", ref_v2, scalar_v2);
  if (__builtin_cpu_supports("avx")) check("8 lanes (AVX) vs x86-64-v2", ref_v2, form_c);
  if (v3) {
    check("8 lanes (AVX2, FMA) vs x86-64-v3", ref_v3, form_d);
    check("scalar clone v3 vs x86-64-v3", ref_v3, scalar_v3);
  } else {
    printf("(no AVX2 + FMA: the x86-64-v3 forms not checked)\n");
  }
  if (v4) {
    check("16 lanes (AVX-512) vs x86-64-v4", ref_v4, form_e);
    check("scalar clone v4 vs x86-64-v4", ref_v4, scalar_v4);
  } else {
    printf("(no AVX-512: the x86-64-v4 forms not checked)\n");
  }
  return failures ? 1 : 0;
}
