// Exhaustive check of the helpers in vector form (cpu_library/vmath.h, rfcs/0002 "Exponentials in vector
// form"): on all 2^32 floats, sfv_exp's forms (4 lanes SSE4.2, 8 lanes AVX and AVX2 + FMA, 16 lanes AVX-512) and
// its scalar clones against the inline sf_exp vectorized by GCC at the same instruction set, sfv_exp_nonpos's
// against sf_exp_nonpos on every float <= 0 and every NaN, sfv_f2h's and sfv_f16_round's against sf_f2h32 and
// sf_f16_round on every float, and sfv_h2f's against sf_h2f32 on every float16: the same bits expected (a NaN for
// a NaN). The
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
SF_VMATH_DEFINE_H2F
SF_VMATH_DEFINE_F2H
SF_VMATH_DEFINE_F16_ROUND
// the scalar clones by their local names (GCC's target_clones suffixes)
extern "C" float exp_v2(float) __asm__("sfv_exp.default");
extern "C" float exp_v3(float) __asm__("sfv_exp.arch_x86_64_v3");
extern "C" float exp_v4(float) __asm__("sfv_exp.arch_x86_64_v4");
extern "C" float nonpos_v2(float) __asm__("sfv_exp_nonpos.default");
extern "C" float nonpos_v3(float) __asm__("sfv_exp_nonpos.arch_x86_64_v3");
extern "C" float nonpos_v4(float) __asm__("sfv_exp_nonpos.arch_x86_64_v4");
extern "C" uint32_t f2h_v2(float) __asm__("sfv_f2h.default");
extern "C" uint32_t f2h_v3(float) __asm__("sfv_f2h.arch_x86_64_v3");
extern "C" uint32_t f2h_v4(float) __asm__("sfv_f2h.arch_x86_64_v4");
extern "C" float round_v2(float) __asm__("sfv_f16_round.default");
extern "C" float round_v3(float) __asm__("sfv_f16_round.arch_x86_64_v3");
extern "C" float round_v4(float) __asm__("sfv_f16_round.arch_x86_64_v4");
extern "C" float h2f_v2(uint32_t) __asm__("sfv_h2f.default");
extern "C" float h2f_v3(uint32_t) __asm__("sfv_h2f.arch_x86_64_v3");
extern "C" float h2f_v4(uint32_t) __asm__("sfv_h2f.arch_x86_64_v4");

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

// the float16 helpers: e = sf_f2h32's bits (in a float's place), z = sf_f16_round; and sf_h2f32 on float16 codes
#define HREF(NAME, ATTR)                                                       \
  ATTR void NAME(const float* x, float* e, float* z, int64_t n) {             \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) {                      \
      e[i] = sf_bits_to_float(int32_t(sf_f2h32(x[i])));                        \
      z[i] = sf_f16_round(x[i]);                                               \
    }                                                                          \
  }                                                                            \
  ATTR void NAME##_h2f(const uint32_t* b, float* y, int64_t n) {              \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) y[i] = sf_h2f32(b[i]); \
  }
HREF(href_v2, )
HREF(href_v3, __attribute__((target("arch=x86-64-v3"))))
HREF(href_v4, __attribute__((target("arch=x86-64-v4"))))
#define HFORM(NAME, ATTR, T, TI, L, LOAD, STORE, ILOAD, STOREI, F2H, ROUND, H2F) \
  ATTR void NAME(const float* x, float* e, float* z, int64_t n) {             \
    for (int64_t i = 0; i < n; i += L) {                                       \
      const T v = LOAD(x + i);                                                 \
      STOREI((TI*)(e + i), F2H(v));                                            \
      STORE(z + i, ROUND(v));                                                  \
    }                                                                          \
  }                                                                            \
  ATTR void NAME##_h2f(const uint32_t* b, float* y, int64_t n) {              \
    for (int64_t i = 0; i < n; i += L) STORE(y + i, H2F(ILOAD((const TI*)(b + i)))); \
  }
HFORM(hform_b, , __m128, __m128i, 4, _mm_loadu_ps, _mm_storeu_ps, _mm_loadu_si128, _mm_storeu_si128,
      _ZGVbN4v_sfv_f2h, _ZGVbN4v_sfv_f16_round, _ZGVbN4v_sfv_h2f)
// the AVX forms by the ABI's lanes: sfv_f2h's 4 (an integer result: AVX's integer vectors are 128 bits), sfv_h2f's
// 8 integer arguments in two 128-bit registers
__attribute__((target("avx"))) void hform_c(const float* x, float* e, float* z, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    _mm_storeu_si128((__m128i*)(e + i), _ZGVcN4v_sfv_f2h(_mm_loadu_ps(x + i)));
    _mm_storeu_si128((__m128i*)(e + i + 4), _ZGVcN4v_sfv_f2h(_mm_loadu_ps(x + i + 4)));
    _mm256_storeu_ps(z + i, _ZGVcN8v_sfv_f16_round(_mm256_loadu_ps(x + i)));
  }
}
__attribute__((target("avx"))) void hform_c_h2f(const uint32_t* b, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _ZGVcN8v_sfv_h2f(_mm_loadu_si128((const __m128i*)(b + i)),
                                             _mm_loadu_si128((const __m128i*)(b + i + 4))));
}
HFORM(hform_d, __attribute__((target("avx2,f16c"))), __m256, __m256i, 8, _mm256_loadu_ps, _mm256_storeu_ps,
      _mm256_loadu_si256, _mm256_storeu_si256, _ZGVdN8v_sfv_f2h, _ZGVdN8v_sfv_f16_round, _ZGVdN8v_sfv_h2f)
HFORM(hform_e, __attribute__((target("avx512f"))), __m512, __m512i, 16, _mm512_loadu_ps, _mm512_storeu_ps,
      _mm512_loadu_si512, _mm512_storeu_si512, _ZGVeN16v_sfv_f2h, _ZGVeN16v_sfv_f16_round, _ZGVeN16v_sfv_h2f)
#define HSCALAR(NAME, F2H, ROUND, H2F)                                         \
  void NAME(const float* x, float* e, float* z, int64_t n) {                  \
    for (int64_t i = 0; i < n; ++i) {                                          \
      e[i] = sf_bits_to_float(int32_t(F2H(x[i])));                             \
      z[i] = ROUND(x[i]);                                                      \
    }                                                                          \
  }                                                                            \
  void NAME##_h2f(const uint32_t* b, float* y, int64_t n) {                   \
    for (int64_t i = 0; i < n; ++i) y[i] = H2F(b[i]);                          \
  }
HSCALAR(hscalar_v2, f2h_v2, round_v2, h2f_v2)
HSCALAR(hscalar_v3, f2h_v3, round_v3, h2f_v3)
HSCALAR(hscalar_v4, f2h_v4, round_v4, h2f_v4)
typedef void (*FillH)(const uint32_t*, float*, int64_t);

static bool same(float a, float b) { return (a != a) ? (b != b) : (b == b && sf_float_to_bits(a) == sf_float_to_bits(b)); }

static uint64_t stride = 1, failures = 0;

// differing results of `got` against `ref` over every float (nonpos: the floats <= 0 and the NaNs), or every
// stride-th bit pattern
static void check(const char* what, Fill ref, Fill got, const char* e_name = "exp",
                  const char* z_name = "exp_nonpos", bool z_nonpos = true) {
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
        if (!same(e0[i], e1[i]) && de++ < 3) printf("  %s %s(%a): %a, expected %a\n", what, e_name, x[i], e1[i], e0[i]);
        if ((!z_nonpos || x[i] <= 0.0f || x[i] != x[i]) && !same(z0[i], z1[i]) && dz++ < 3)
          printf("  %s %s(%a): %a, expected %a\n", what, z_name, x[i], z1[i], z0[i]);
      }
    }
  }
  printf("%-34s %s differs %lu, %s differs %lu\n", what, e_name, (unsigned long)de, z_name, (unsigned long)dz);
  failures += de + dz;
}

// sf_h2f32 on every float16 code (the low 16 bits it reads), and the float16 rounding helpers on every float
static void check_half(const char* what, Fill ref, Fill got, FillH ref_h, FillH got_h) {
  check(what, ref, got, "f2h", "f16_round", false);
  std::vector<uint32_t> b(1 << 16);
  std::vector<float> y0(1 << 16), y1(1 << 16);
  for (uint32_t i = 0; i < (1u << 16); ++i) b[i] = i;
  ref_h(b.data(), y0.data(), 1 << 16);
  got_h(b.data(), y1.data(), 1 << 16);
  uint64_t d = 0;
  for (uint32_t i = 0; i < (1u << 16); ++i)
    if (!same(y0[i], y1[i]) && d++ < 3) printf("  %s h2f(%04x): %a, expected %a\n", what, i, y1[i], y0[i]);
  printf("%-34s h2f differs %lu\n", what, (unsigned long)d);
  failures += d;
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
  check_half("4 lanes (SSE4.2) vs x86-64-v2", href_v2, hform_b, href_v2_h2f, hform_b_h2f);
  check_half("scalar clone default vs x86-64-v2", href_v2, hscalar_v2, href_v2_h2f, hscalar_v2_h2f);
  if (__builtin_cpu_supports("avx")) {
    check("8 lanes (AVX) vs x86-64-v2", ref_v2, form_c);
    check_half("8 lanes (AVX) vs x86-64-v2", href_v2, hform_c, href_v2_h2f, hform_c_h2f);
  }
  if (v3) {
    check("8 lanes (AVX2, FMA) vs x86-64-v3", ref_v3, form_d);
    check("scalar clone v3 vs x86-64-v3", ref_v3, scalar_v3);
    if (__builtin_cpu_supports("f16c")) check_half("8 lanes (AVX2, F16C) vs x86-64-v3", href_v3, hform_d, href_v3_h2f, hform_d_h2f);
    check_half("scalar clone v3 vs x86-64-v3", href_v3, hscalar_v3, href_v3_h2f, hscalar_v3_h2f);
  } else {
    printf("(no AVX2 + FMA: the x86-64-v3 forms not checked)\n");
  }
  if (v4) {
    check("16 lanes (AVX-512) vs x86-64-v4", ref_v4, form_e);
    check("scalar clone v4 vs x86-64-v4", ref_v4, scalar_v4);
    check_half("16 lanes (AVX-512) vs x86-64-v4", href_v4, hform_e, href_v4_h2f, hform_e_h2f);
    check_half("scalar clone v4 vs x86-64-v4", href_v4, hscalar_v4, href_v4_h2f, hscalar_v4_h2f);
  } else {
    printf("(no AVX-512: the x86-64-v4 forms not checked)\n");
  }
  return failures ? 1 : 0;
}
