// ---- Shardflow CPU kernel library: sfv_exp and sfv_exp_nonpos and their vector forms -------------
// A translation unit of its own (templates_cpu.prebuilt_tables: compiled once per kernel cache, linked into
// the libraries whose kernels call them), after helpers.h with SF_VMATH_UNIT defined, which leaves out the
// `omp declare simd` declarations (with them GCC would make the vector forms itself, from the bodies).
//
// Each form computes what the inline helper (sf_exp, sf_exp_nonpos) computes at the same instruction set, bit
// for bit: the scalar functions are cloned as the kernels are (default, x86-64-v3, x86-64-v4) and call the
// helpers; the 4-lane (SSE4.2) and 8-lane (AVX; AVX2 + FMA) forms are the helpers' steps on GCC's vector
// types (the same expressions, so the same FMA contractions); the 16-lane form (AVX-512) clamps with
// vminps/vmaxps (which return their second operand, x, for a NaN, as the helpers' selects do) and scales by
// 2^n with one vscalefps, which rounds y * 2^n once, as the helpers' two exact-then-rounding products do.
// benchmarks/cpu_vmath_exhaustive.cpp checks every float against the inline helpers at each instruction set.

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
// e AVX-512F; N: unmasked; 4/8/16 lanes; v: one vector argument); a unit defines one NAME (each is linked
// into the libraries whose kernels refer to it, both into some)
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
#else
#define SF_VMATH_DEFINE(NAME, HELPER, NONPOS) extern "C" float NAME(float x) { return HELPER(x); }
#endif
