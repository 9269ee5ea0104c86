// ---- Shardflow CPU kernel library: helpers in vector form ------------------------------------------
// sfv_exp, sfv_exp_nonpos (sf_exp, sf_exp_nonpos), sfv_h2f, sfv_f2h (float16 bits, in 32-bit lanes, to float and
// back: sf_h2f32, sf_f2h32) and sfv_f16_round (sf_f16_round), and their vector forms. Each is a translation unit
// of its own (templates_cpu.prebuilt_tables: compiled once per kernel cache, linked into the libraries whose
// kernels call it), after helpers.h with SF_VMATH_UNIT defined, which leaves out the `omp declare simd`
// declarations (with them GCC would make the vector forms itself, from the bodies).
//
// Each form computes what the inline helper computes at the same instruction set, bit for bit: the scalar
// functions are cloned as the kernels are (default, x86-64-v3, x86-64-v4) and call the helpers; the 4- and
// 8-lane forms of the exponentials (SSE4.2, AVX, AVX2 + FMA) are the helpers' steps on GCC's vector types (the
// same expressions, so the same FMA contractions), and their 16-lane (AVX-512) form clamps with vminps/vmaxps
// (which return their second operand, x, for a NaN, as the helpers' selects do) and scales by 2^n with one
// vscalefps, which rounds y * 2^n once, as the helpers' two exact-then-rounding products do; the float16
// conversions' forms are the helpers' steps at SSE4.2 and AVX, and F16C's vcvtph2ps/vcvtps2ph (nearest even) at
// AVX2 and AVX-512, which the helpers match on every input (helpers.h; the x86-64-v3 level includes F16C). benchmarks/cpu_vmath_exhaustive.cpp
// checks every float (every float16 for sfv_h2f) against the inline helpers at each instruction set.
// x86-64 only: elsewhere helpers.h's names are macros for the inline helpers, and no kernel refers to these.

#if defined(__x86_64__)
namespace {

// sf_exp's (NONPOS: sf_exp_nonpos's) steps on lanes F (a GCC vector of floats; I: of int32 of its size)
template <class F, class I, bool NONPOS>
SF_INLINE F sfv_exp_lanes(F x) {
  const F lo = F{} - 104.0f, hi = F{} + 89.0f;
  F xc = x;
  if (!NONPOS) xc = x > hi ? hi : xc;
  xc = x < lo ? lo : xc;
  const F m = xc * 1.44269504088896341f + 12582912.0f;
  const F n = m - 12582912.0f;
  F r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  const F y = p * (r * r) + r + 1.0f;
  const I ni = (I)m - 0x4B400000;
  if (NONPOS) return y * (F)((ni + 151) << 23) * 5.9604644775390625e-8f;
  const I n1 = ni >> 1, n2 = ni - n1;
  return y * (F)((n1 + 127) << 23) * (F)((n2 + 127) << 23);
}

typedef float sfv_f4 __attribute__((vector_size(16)));
typedef int32_t sfv_i4 __attribute__((vector_size(16)));
typedef float sfv_f8 __attribute__((vector_size(32)));
typedef int32_t sfv_i8 __attribute__((vector_size(32)));
typedef uint32_t sfv_u4 __attribute__((vector_size(16)));
typedef uint32_t sfv_u8 __attribute__((vector_size(32)));

// sf_h2f32's, sf_f2h32's and sf_f16_round's steps on lanes F (U: of uint32 of its size): the 4-lane and AVX forms
template <class F, class U>
SF_INLINE F sfv_h2f_lanes(U b) {
  const U em = (b << 13) & 0x0fffe000u;
  U u = (U)((F)em * 5.192296858534828e+33f);
  const U special = em > 0x0f800000u ? U{} + 0x7fc00000u : U{} + 0x7f800000u;
  u = em >= 0x0f800000u ? u | special : u;
  return (F)(u | ((b << 16) & 0x80000000u));
}
template <class F, class U>
SF_INLINE U sfv_f2h_lanes(F x) {
  U u = (U)x;
  const U sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  const U sub = (U)((F)u + 0.5f) - 0x3f000000u;
  const U norm = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
  const U big = u > 0x7f800000u ? (0x7e00u | ((u >> 13) & 0x3ffu)) : U{} + 0x7c00u;
  const U o = u >= 0x47800000u ? big : (u < 0x38800000u ? sub : norm);
  return o | sign;
}
template <class F, class U>
SF_INLINE F sfv_f16_round_lanes(F x) {
  U u = (U)x;
  const U sign = u & 0x80000000u;
  u &= 0x7fffffffu;
  const U sub = (U)(((F)u + 0.5f) - 0.5f);
  const U norm = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
  const U big = u > 0x7f800000u ? (u | 0x00400000u) & 0xffffe000u : U{} + 0x7f800000u;
  return (F)((u >= 0x477ff000u ? big : (u < 0x38800000u ? sub : norm)) | sign);
}

// the 16-lane form: the same steps as FMAs (where GCC contracts the helpers' products and sums), the
// clamps as min/max and the scaling as vscalefps
template <bool NONPOS>
__attribute__((target("avx512f"), always_inline)) static inline __m512 sfv_exp16(__m512 x) {
  if (!NONPOS) x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 m = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(12582912.0f));
  const __m512 n = _mm512_sub_ps(m, _mm512_set1_ps(12582912.0f));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

}  // namespace

// NAME (calling HELPER) and its forms under the vector function ABI's names (x86-64: b SSE, c AVX, d AVX2,
// e AVX-512F; N: unmasked; v: one vector argument). A form's lane count is the ABI's: the ISA's vector width
// for the function's characteristic type (its return type) over that type's size, where AVX's integer vectors
// are 128 bits: so sfv_f2h's AVX form has 4 lanes (_ZGVcN4v_), and sfv_h2f's AVX form takes its 8 integer
// arguments in two 128-bit registers. GCC calls, for a loop's vectorization factor, any form its function's
// ISA can run: an x86-64-v3 or v4 loop with 4 lanes (a remainder, or a loop over doubles) calls the SSE or AVX
// forms, and then computes the values the inline helper gives at that ISA (the exponentials without FMA,
// within the helper's accuracy of the FMA results; the float16 conversions are the same at every ISA).
// tests/codegen/test_vmath.py calls every form as GCC does, from loops at each ISA. A unit defines one name
// (and is linked into the libraries whose kernels refer to it).
#define SF_VMATH_DEFINE(NAME, HELPER, NONPOS)                                                                \
  extern "C" SF_CLONES float NAME(float x) { return HELPER(x); }                                             \
  extern "C" __m128 _ZGVbN4v_##NAME(__m128 x) { return (__m128)sfv_exp_lanes<sfv_f4, sfv_i4, NONPOS>(x); } \
  extern "C" __attribute__((target("avx"))) __m256 _ZGVcN8v_##NAME(__m256 x) {                            \
    return (__m256)sfv_exp_lanes<sfv_f8, sfv_i8, NONPOS>(x);                                                \
  }                                                                                                          \
  extern "C" __attribute__((target("avx2,fma"))) __m256 _ZGVdN8v_##NAME(__m256 x) {                       \
    return (__m256)sfv_exp_lanes<sfv_f8, sfv_i8, NONPOS>(x);                                                \
  }                                                                                                          \
  extern "C" __attribute__((target("avx512f"))) __m512 _ZGVeN16v_##NAME(__m512 x) { return sfv_exp16<NONPOS>(x); }

// the float16 conversions (their F16C forms at AVX2 and AVX-512; the AVX2 form of sfv_h2f keeps each lane's low 16
// bits, as sf_h2f32 reads them; the AVX forms are the 4-lane steps: sfv_h2f's twice)
#define SF_F16C_ROUND _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC
#define SF_VMATH_DEFINE_H2F                                                                                    \
  extern "C" SF_CLONES float sfv_h2f(uint32_t b) { return sf_h2f32(b); }                                       \
  extern "C" __m128 _ZGVbN4v_sfv_h2f(__m128i b) { return (__m128)sfv_h2f_lanes<sfv_f4, sfv_u4>((sfv_u4)b); }   \
  extern "C" __attribute__((target("avx"))) __m256 _ZGVcN8v_sfv_h2f(__m128i lo, __m128i hi) {               \
    const __m128 a = (__m128)sfv_h2f_lanes<sfv_f4, sfv_u4>((sfv_u4)lo);                                      \
    const __m128 b = (__m128)sfv_h2f_lanes<sfv_f4, sfv_u4>((sfv_u4)hi);                                      \
    return _mm256_insertf128_ps(_mm256_castps128_ps256(a), b, 1);                                             \
  }                                                                                                            \
  extern "C" __attribute__((target("avx2,f16c"))) __m256 _ZGVdN8v_sfv_h2f(__m256i b) {                       \
    const __m256i low = _mm256_and_si256(b, _mm256_set1_epi32(0xffff));                                      \
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));  \
  }                                                                                                            \
  extern "C" __attribute__((target("avx512f"))) __m512 _ZGVeN16v_sfv_h2f(__m512i b) {                       \
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(b));                                                         \
  }
#define SF_VMATH_DEFINE_F2H                                                                                    \
  extern "C" SF_CLONES uint32_t sfv_f2h(float x) { return sf_f2h32(x); }                                       \
  extern "C" __m128i _ZGVbN4v_sfv_f2h(__m128 x) { return (__m128i)sfv_f2h_lanes<sfv_f4, sfv_u4>((sfv_f4)x); }  \
  extern "C" __attribute__((target("avx"))) __m128i _ZGVcN4v_sfv_f2h(__m128 x) {                             \
    return (__m128i)sfv_f2h_lanes<sfv_f4, sfv_u4>((sfv_f4)x);                                                 \
  }                                                                                                            \
  extern "C" __attribute__((target("avx2,f16c"))) __m256i _ZGVdN8v_sfv_f2h(__m256 x) {                      \
    return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, SF_F16C_ROUND));                                         \
  }                                                                                                            \
  extern "C" __attribute__((target("avx512f"))) __m512i _ZGVeN16v_sfv_f2h(__m512 x) {                       \
    return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, SF_F16C_ROUND));                                          \
  }
#define SF_VMATH_DEFINE_F16_ROUND                                                                              \
  extern "C" SF_CLONES float sfv_f16_round(float x) { return sf_f16_round(x); }                                \
  extern "C" __m128 _ZGVbN4v_sfv_f16_round(__m128 x) {                                                        \
    return (__m128)sfv_f16_round_lanes<sfv_f4, sfv_u4>((sfv_f4)x);                                            \
  }                                                                                                            \
  extern "C" __attribute__((target("avx"))) __m256 _ZGVcN8v_sfv_f16_round(__m256 x) {                        \
    return (__m256)sfv_f16_round_lanes<sfv_f8, sfv_u8>((sfv_f8)x);                                           \
  }                                                                                                            \
  extern "C" __attribute__((target("avx2,f16c"))) __m256 _ZGVdN8v_sfv_f16_round(__m256 x) {                  \
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, SF_F16C_ROUND));                                                \
  }                                                                                                            \
  extern "C" __attribute__((target("avx512f"))) __m512 _ZGVeN16v_sfv_f16_round(__m512 x) {                  \
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, SF_F16C_ROUND));                                                \
  }
#endif
