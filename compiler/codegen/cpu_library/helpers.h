// ---- Shardflow CPU kernel library: helpers --------------------------------------------------
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <limits>
#include <algorithm>
#include <utility>
#include <type_traits>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define SF_EXPORT extern "C" __attribute__((visibility("default")))
#define SF_INLINE static inline __attribute__((always_inline))
// A micro-kernel table T sf_NAME() defined where the library is, or (units compiled with
// -DSF_PREBUILT_TABLES) taken from the object compiled once for every library, which returns it from
// sf_rt_NAME() (templates_cpu.prebuilt_tables); used at namespace scope in the library's namespace.
#define SF_TABLE_FROM_PREBUILT(T, NAME)                                                                       \
  }                                                                                                           \
  extern "C" const void* sf_rt_##NAME();                                                                      \
  namespace {                                                                                                 \
  static const T& sf_##NAME() { return *static_cast<const T*>(sf_rt_##NAME()); }
// A call of the library function FN (a driver: a GEMM, a conv, the attention) from a generated kernel, with
// every argument (a pointer call knows no default arguments): FN itself where the library is, or (units
// compiled with -DSF_PREBUILT_TABLES) FN from the object compiled once for every library, which returns its
// address from sf_rt_fn_NAME() (templates_cpu.prebuilt_tables, declared after the library's files): a
// library's units then compile their kernels only, not the drivers they call.
#ifdef SF_PREBUILT_TABLES
#define SF_LIB(NAME, ...) (reinterpret_cast<decltype(&__VA_ARGS__)>(sf_rt_fn_##NAME()))
#else
#define SF_LIB(NAME, ...) __VA_ARGS__
#endif

namespace {

// Scratch memory: one grow-only buffer per slot and calling thread, kept for the process lifetime
// (slot 0: a kernel's temporaries, 1-2: GEMM packing, 3: im2col, the bfloat16 GEMM's widened A, or the integer
// conv's panels, 4: a conv's tap offsets (and the integer conv's padded image), 5: a packed conv's transposed
// output, 6-7: a packed conv's plain image and output around the blocked layout).
// Units compiled with -DSF_PREBUILT_TABLES take them from the object compiled once for every library
// (sf_rt_workspace, templates_cpu.prebuilt_tables): the kernels and the drivers of the other prebuilt
// objects (SF_LIB) share one set of buffers per library, as when all were one unit.
#ifdef SF_PREBUILT_TABLES
}  // namespace
extern "C" void* sf_rt_workspace(int slot, size_t bytes);
namespace {
static inline void* sf_workspace(int slot, size_t bytes) { return sf_rt_workspace(slot, bytes); }
#else
static size_t sf_workspace_held = 0;  // bytes held by every thread's buffers (sf_rt_workspace_bytes)
struct SfWorkspace {
  void* p[8] = {};
  size_t n[8] = {};
  ~SfWorkspace() {
    for (int i = 0; i < 8; ++i) {
      std::free(p[i]);
      __atomic_fetch_sub(&sf_workspace_held, n[i], __ATOMIC_RELAXED);
    }
  }
};
static void* sf_workspace(int slot, size_t bytes) {
  static thread_local SfWorkspace ws;
  if (bytes == 0) bytes = 64;
  if (ws.n[slot] < bytes) {
    std::free(ws.p[slot]);
    __atomic_fetch_sub(&sf_workspace_held, ws.n[slot], __ATOMIC_RELAXED);
    ws.n[slot] = 0;
    size_t sz = (bytes + 4095) & ~size_t(4095);
    ws.p[slot] = std::aligned_alloc(64, sz);
    if (!ws.p[slot]) {  // (a kernel has no way to return an error: say why the rank stops)
      std::fprintf(stderr, "shardflow: a cpu kernel's scratch memory: cannot allocate %zu bytes (slot %d); "
                   "the rank stops\n", sz, slot);
      std::abort();
    }
    ws.n[slot] = sz;
    __atomic_fetch_add(&sf_workspace_held, sz, __ATOMIC_RELAXED);
  }
  return ws.p[slot];
}
#endif

// ---- instruction sets -----------------------------------------------------------------------------
// The widest instruction set the kernels may use: SHARDFLOW_CPU_ISA (for tests) names it, unset allows
// all that the CPU has; an unknown name allows the portable loops only. Each kernel table checks the CPU.
enum { SF_ISA_GENERIC = 0, SF_ISA_AVX2 = 1, SF_ISA_AVX512 = 2, SF_ISA_AVX512BF16 = 3, SF_ISA_AMX = 4 };
static inline int sf_isa_cap() {
  const char* force = std::getenv("SHARDFLOW_CPU_ISA");
  if (!force) return SF_ISA_AMX;
  static const char* const names[] = {"generic", "avx2", "avx512", "avx512bf16", "amx"};
  for (int i = 0; i < 5; ++i)
    if (std::strcmp(force, names[i]) == 0) return i;
  return SF_ISA_GENERIC;
}

// ---- bfloat16 storage ---------------------------------------------------------------------------
// The upper half of a float32 (this GCC has no __bf16 arithmetic type): loads widen exactly, stores
// round to nearest even as ml_dtypes and CUDA's __float2bfloat16_rn do (a NaN stays a quiet NaN).
struct sf_bf16 { uint16_t bits; };
SF_INLINE float sf_bf16_to_float(sf_bf16 h) {
  uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
SF_INLINE sf_bf16 sf_float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return sf_bf16{uint16_t((u >> 16) | 0x40u)};
  return sf_bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
SF_INLINE float sf_bf16_round(float f) { return sf_bf16_to_float(sf_float_to_bf16(f)); }
#if defined(__x86_64__)
// 16 and 8 lanes rounded to bfloat16's values as sf_bf16_round rounds them (the same integer steps; a NaN
// made quiet), kept in float32: the low 16 bits of each lane zero
__attribute__((target("avx512f"), always_inline))
static inline __m512 sf_bf16_round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 sf_bf16_round8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256 t = _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan);
  return _mm256_and_ps(t, _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
}
#endif

// ---- float16 storage ----------------------------------------------------------------------------
// Values in memory as their bits (uint16_t), converted in 32-bit integer and float32 steps that GCC
// vectorizes (its _Float16 casts convert one value at a time, by F16C's scalar form or a library call,
// and kept every loop over float16 values scalar): loads widen exactly, stores round to nearest even as
// F16C's vcvtps2ph and numpy do (overflow to infinity; a NaN stays a quiet NaN with its payload's top
// bits). Both match F16C on every input (checked over all 2^16 and 2^32 bit patterns).
SF_INLINE float sf_h2f32(uint32_t b) {  // (every step on 32 bits: GCC vectorizes that at full width)
  // exponent and mantissa in float32's places, scaled by 2^112 (127 - 15): exact for normal and subnormal
  // values (a float32 subnormal times a power of two)
  const uint32_t em = (b << 13) & 0x0fffe000u;
  uint32_t u = em;
  float f;
  std::memcpy(&f, &u, 4);
  f *= 5.192296858534828e+33f;
  std::memcpy(&u, &f, 4);
  // infinity or NaN: exponent all ones (a NaN quiet, as vcvtph2ps makes it)
  u = em >= 0x0f800000u ? u | (em > 0x0f800000u ? 0x7fc00000u : 0x7f800000u) : u;
  u |= (b << 16) & 0x80000000u;
  std::memcpy(&f, &u, 4);
  return f;
}
SF_INLINE uint32_t sf_f2h32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  float a;
  std::memcpy(&a, &u, 4);
  const float t = a + 0.5f;  // |x| < 2^-14: the subnormal's 10 bits at the bottom, rounded by the addition
  uint32_t sub;
  std::memcpy(&sub, &t, 4);
  sub -= 0x3f000000u;
  const uint32_t norm = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;  // rebiased (-112 << 23), rounded
  const uint32_t big = u > 0x7f800000u ? 0x7e00u | ((u >> 13) & 0x3ffu) : 0x7c00u;  // NaN; infinity, overflow
  const uint32_t o = u >= 0x47800000u ? big : u < 0x38800000u ? sub : norm;
  return o | sign;
}
SF_INLINE float sf_h2f(uint16_t h) { return sf_h2f32(h); }
SF_INLINE uint16_t sf_f2h(float x) { return uint16_t(sf_f2h32(x)); }
// a double rounded once, straight to float16 (as numpy does; one value at a time)
SF_INLINE uint16_t sf_f2h(double x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
// float32 rounded to float16's values, kept in float32 (as sf_h2f32(sf_f2h32(x)), in fewer steps; no 16-bit
// step: GCC's narrowing of it kept such loops scalar): 11 significant bits to nearest even where float16 is
// normal, multiples of 2^-24 below 2^-14 (rounded by adding 0.5, whose ulp that is), infinity from 65520 on,
// a NaN quiet with its payload's top 10 bits
SF_INLINE float sf_f16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = u & 0x80000000u;
  u &= 0x7fffffffu;
  float a;
  std::memcpy(&a, &u, 4);
  const float t = (a + 0.5f) - 0.5f;
  uint32_t sub;
  std::memcpy(&sub, &t, 4);
  const uint32_t norm = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
  const uint32_t big = u > 0x7f800000u ? (u | 0x00400000u) & 0xffffe000u : 0x7f800000u;
  const uint32_t o = (u >= 0x477ff000u ? big : u < 0x38800000u ? sub : norm) | sign;
  std::memcpy(&a, &o, 4);
  return a;
}

// ---- numpy-equal scalar semantics --------------------------------------------------------------
template <class T> SF_INLINE bool sf_isfloat() { return std::numeric_limits<T>::is_iec559; }

// x != x through a call, so that the printed expression names its argument once (a QDQ chain's
// NaN tests nest: inline, each doubled the text of the steps below it)
template <class T> SF_INLINE bool sf_isnan(T x) { return x != x; }

// np.maximum(x, c) / np.minimum(x, c) for a constant c neither NaN nor zero (the printer checks):
// one comparison, a select GCC keeps branch-free; a NaN x fails it and passes through, and x == c
// has c's bits. A call, so that the printed expression names x once (nested clamps would double it)
template <class T> SF_INLINE T sf_max_const(T x, T c) { return c > x ? c : x; }
template <class T> SF_INLINE T sf_min_const(T x, T c) { return c < x ? c : x; }

// np.maximum / np.minimum: NaN propagates (bitwise | keeps them branch-free: a max of data is unpredictable)
SF_INLINE float sf_max(float a, float b) { return ((a > b) | (a != a)) ? a : b; }
SF_INLINE double sf_max(double a, double b) { return ((a > b) | (a != a)) ? a : b; }
SF_INLINE float sf_min(float a, float b) { return ((a < b) | (a != a)) ? a : b; }
SF_INLINE double sf_min(double a, double b) { return ((a < b) | (a != a)) ? a : b; }
template <class T> SF_INLINE T sf_max(T a, T b) { return a > b ? a : b; }
template <class T> SF_INLINE T sf_min(T a, T b) { return a < b ? a : b; }

// arg-reductions: strictly better, NaN beats numbers, the first NaN stays
template <class T> SF_INLINE bool sf_better_max(T v, T best) {
  if constexpr (std::numeric_limits<T>::is_iec559) return v > best || (v != v && best == best);
  else return v > best;
}
template <class T> SF_INLINE bool sf_better_min(T v, T best) {
  if constexpr (std::numeric_limits<T>::is_iec559) return v < best || (v != v && best == best);
  else return v < best;
}

// Python/numpy floor division and modulo (integer division by zero gives 0, as numpy does)
template <class T> SF_INLINE T sf_floordiv(T a, T b) {
  if constexpr (std::numeric_limits<T>::is_integer) {
    if (b == 0) return T(0);
    if constexpr (std::numeric_limits<T>::is_signed) {
      if (b == T(-1)) return T(T(0) - a);  // wraps like numpy for the minimum value
      T q = a / b;
      if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
      return q;
    } else {
      return a / b;
    }
  } else {
    if (b == 0) return a / b;
    T mod = std::fmod(a, b);
    T div = (a - mod) / b;
    if (mod != 0 && ((b < 0) != (mod < 0))) div -= T(1);
    T fl;
    if (div != 0) {
      fl = std::floor(div);
      if (div - fl > T(0.5)) fl += T(1);
    } else {
      fl = std::copysign(T(0), a / b);
    }
    return fl;
  }
}
template <class T> SF_INLINE T sf_mod(T a, T b) {
  if constexpr (std::numeric_limits<T>::is_integer) {
    if (b == 0) return T(0);
    if constexpr (std::numeric_limits<T>::is_signed) {
      if (b == T(-1)) return T(0);
      T r = a % b;
      if (r != 0 && ((r < 0) != (b < 0))) r += b;
      return r;
    } else {
      return a % b;
    }
  } else {
    T mod = std::fmod(a, b);
    if (b == 0) return mod;
    if (mod != 0) {
      if ((b < 0) != (mod < 0)) mod += b;
    } else {
      mod = std::copysign(T(0), b);
    }
    return mod;
  }
}
template <class T> SF_INLINE T sf_fmod(T a, T b) {
  if constexpr (std::numeric_limits<T>::is_integer) {
    if (b == 0) return T(0);
    if constexpr (std::numeric_limits<T>::is_signed) { if (b == T(-1)) return T(0); }
    return a % b;
  } else {
    return std::fmod(a, b);
  }
}
template <class T> SF_INLINE T sf_truncdiv(T a, T b) {
  if constexpr (std::numeric_limits<T>::is_integer) {
    if (b == 0) return T(0);
    if constexpr (std::numeric_limits<T>::is_signed) { if (b == T(-1)) return T(T(0) - a); }
    return a / b;
  } else {
    return a / b;
  }
}
template <class T> SF_INLINE T sf_pow(T a, T b) {
  if constexpr (std::numeric_limits<T>::is_integer) {
    // a negative exponent: the real power truncated toward zero (0 unless |a| == 1; 0 for a == 0 too)
    if constexpr (std::numeric_limits<T>::is_signed) {
      if (b < 0) return a == T(1) ? T(1) : (a == T(-1) ? ((b & 1) ? T(-1) : T(1)) : T(0));
    }
    T r = 1;
    while (b) { if (b & 1) r = T(r * a); a = T(a * a); b >>= 1; }
    return r;
  } else {
    return std::pow(a, b);
  }
}
template <class T> SF_INLINE T sf_shl(T a, T b) {
  if (b < 0 || b >= T(sizeof(T) * 8)) return T(0);
  return T((typename std::make_unsigned<T>::type)(a) << b);
}
template <class T> SF_INLINE T sf_shr(T a, T b) {
  if (b < 0 || b >= T(sizeof(T) * 8)) return (std::numeric_limits<T>::is_signed && a < 0) ? T(-1) : T(0);
  return T(a >> b);
}
template <class T> SF_INLINE T sf_abs(T a) {
  if constexpr (std::numeric_limits<T>::is_iec559) return std::fabs(a);
  else if constexpr (std::numeric_limits<T>::is_signed) return a < 0 ? T(T(0) - a) : a;
  else return a;
}
template <class T> SF_INLINE T sf_sign(T a) {
  if constexpr (std::numeric_limits<T>::is_iec559) return a > 0 ? T(1) : (a < 0 ? T(-1) : (a == 0 ? T(0) : a));
  else if constexpr (std::numeric_limits<T>::is_signed) return T((a > 0) - (a < 0));
  else return T(a > 0);
}
template <class T> SF_INLINE T sf_reciprocal(T a) {
  // numpy: 1 // 0 gives the minimum for 32- and 64-bit signed ints, else 0
  if constexpr (std::numeric_limits<T>::is_integer)
    return a == 0 ? ((std::numeric_limits<T>::is_signed && sizeof(T) >= 4) ? std::numeric_limits<T>::min() : T(0))
                  : T(T(1) / a);
  else return T(1) / a;
}

// ---- float32 math that vectorizes (branch-free, inlined) ----------------------------------------
SF_INLINE float sf_bits_to_float(int32_t i) { float f; std::memcpy(&f, &i, 4); return f; }
SF_INLINE int32_t sf_float_to_bits(float f) { int32_t i; std::memcpy(&i, &f, 4); return i; }

// exp: Cody-Waite reduction and the Cephes polynomial (about 1 ulp); NaN and +-inf handled. The integer n
// is read from the bits of the rounding sum m (0x4B400000 + n; no float-to-int conversion), and a NaN x
// stays NaN through the clamps (their comparisons are false) and the product
#define SF_EXP_REDUCED(xc)                                                                              \
  const float m = (xc) * 1.44269504088896341f + 12582912.0f;                                            \
  const float n = m - 12582912.0f;                                                                      \
  float r = (xc) - n * 0.693359375f;                                                                    \
  r = r - n * -2.12194440e-4f;                                                                          \
  float p = 1.9875691500E-4f;                                                                           \
  p = p * r + 1.3981999507E-3f;                                                                         \
  p = p * r + 8.3334519073E-3f;                                                                         \
  p = p * r + 4.1665795894E-2f;                                                                         \
  p = p * r + 1.6666665459E-1f;                                                                         \
  p = p * r + 5.0000001201E-1f;                                                                         \
  const float y = p * (r * r) + r + 1.0f;                                                               \
  const int32_t ni = sf_float_to_bits(m) - 0x4B400000;
SF_INLINE float sf_exp(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  SF_EXP_REDUCED(xc)
  const int32_t n1 = ni >> 1, n2 = ni - n1;  // two scalings: n in [-150, 128]
  return y * sf_bits_to_float((n1 + 127) << 23) * sf_bits_to_float((n2 + 127) << 23);
}
// exp of x <= 0 or NaN (x - max(x): a softmax's shift; the lowering proves it): n in [-150, 0], so one
// scaling by 2^(n + 24), a normal number, then the exact 2^-24: the same bits as sf_exp there (checked
// on every such float) without the second scaling (a standalone 6144x512 softmax loop 0.75 -> 0.55 ms,
// rfcs/0002 "Exponentials")
SF_INLINE float sf_exp_nonpos(float x) {
  const float xc = x < -104.0f ? -104.0f : x;
  SF_EXP_REDUCED(xc)
  return y * sf_bits_to_float((ni + 151) << 23) * 5.9604644775390625e-8f;
}
#undef SF_EXP_REDUCED
SF_INLINE double sf_exp(double x) { return std::exp(x); }

// log: Cephes logf (about 1 ulp); denormals scaled, log(0) = -inf, log(<0) = NaN
SF_INLINE float sf_log(float x) {
  float xs = x < 1.17549435e-38f ? x * 8388608.0f : x;
  int32_t bias = x < 1.17549435e-38f ? 23 : 0;
  int32_t bits = sf_float_to_bits(xs);
  int32_t e = ((bits >> 23) & 0xff) - 126 - bias;
  float m = sf_bits_to_float((bits & 0x007fffff) | 0x3f000000);
  bool small = m < 0.707106781186547524f;
  float ef = (float)(small ? e - 1 : e);
  m = small ? (m + m - 1.0f) : (m - 1.0f);
  float z = m * m;
  float y = 7.0376836292E-2f;
  y = y * m - 1.1514610310E-1f;
  y = y * m + 1.1676998740E-1f;
  y = y * m - 1.2420140846E-1f;
  y = y * m + 1.4249322787E-1f;
  y = y * m - 1.6668057665E-1f;
  y = y * m + 2.0000714765E-1f;
  y = y * m - 2.4999993993E-1f;
  y = y * m + 3.3333331174E-1f;
  y = y * m * z;
  y += -2.12194440e-4f * ef;
  y += -0.5f * z;
  float r = m + y;
  r += 0.693359375f * ef;
  r = x == 0.0f ? -std::numeric_limits<float>::infinity() : r;
  r = x < 0.0f ? std::numeric_limits<float>::quiet_NaN() : r;
  r = !(x < std::numeric_limits<float>::infinity()) ? x : r;  // +inf and NaN (one comparison, see sf_tanh)
  return r;
}
SF_INLINE double sf_log(double x) { return std::log(x); }

// tanh: rational approximation (Eigen's ptanh_float, a few ulp), exact sign, +-1 beyond +-7.9
SF_INLINE float sf_tanh(float x) {
  float xc = x < -7.90531110763549805f ? -7.90531110763549805f : (x > 7.90531110763549805f ? 7.90531110763549805f : x);
  float x2 = xc * xc;
  float p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  p = p * xc;
  float q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  float r = p / q;
  // one comparison, not two joined by && (GCC 12 if-converted that into a mask of another width
  // than the clamps' around a QDQ model's tanh, and left GPT-2's GELU kernels scalar: 13 ms, not 0.7)
  r = std::fabs(x) < 0.0004f ? x : r;
  return r;
}
SF_INLINE double sf_tanh(double x) { return std::tanh(x); }

// erf: Eigen's rational approximation (odd degree 13 over even degree 8) on x clamped to [-4, 4],
// the result clamped to [-1, 1]: at most 7.5 ulp (4.5e-7 absolute) from erf on a grid of 2.1 million
// points, 3.7x faster than a Taylor series and the Numerical Recipes erfc fit (3 ulp, an exp and a
// division per element; measured in a BERT GELU loop on Zen 3)
SF_INLINE float sf_erf(float x) {
  float xc = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
  float x2 = xc * xc;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  p = p * xc;
  float q = -1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  float r = p / q;
  r = r > 1.0f ? 1.0f : (r < -1.0f ? -1.0f : r);
  return x != x ? x : r;
}
SF_INLINE double sf_erf(double x) { return std::erf(x); }

// pow: a * a and a * a * a for the exponents 2 and 3 (squares, GELU's cube), else exp(b * log|a|)
// (a few ulp) with numpy's special cases: negative base gives NaN unless b is an integer (then the
// sign of an odd power), zero base gives 0 or inf, b == 0 or a == 1 gives 1. Branch-free, so a loop
// whose exponent is a literal vectorizes (GCC 12; one whose exponent is read from memory does not).
SF_INLINE float sf_pow(float a, float b) {
  // bitwise & and | (not && and ||): no short-circuit branches, so the loop stays if-convertible
  const float inf = std::numeric_limits<float>::infinity();
  float aa = a < 0 ? -a : a;
  float g = sf_exp(b * sf_log(aa));
  // whether b is an integer, and an odd one, without std::nearbyint (with it GCC 12 vectorized no such
  // loop): below 2^23 through an int32 conversion; from 2^23 on every float is an integer, and below
  // 2^24 its parity is the lowest mantissa bit (above, all are even). (A NaN b counts as an integer
  // here: g is NaN then, and so is the result.)
  float ab = b < 0 ? -b : b;
  bool small = ab < 8388608.0f;  // (false for NaN)
  float bs = small ? b : 0.0f;
  int32_t bi = (int32_t)bs;
  bool bint = (float)bi == bs;
  bool bodd = bint & (small ? (bi & 1) != 0 : (ab < 16777216.0f) & ((sf_float_to_bits(b) & 1) != 0));
  float sg = bodd ? -g : g;
  float r = (a < 0) & !(bint | (a == -inf)) ? std::numeric_limits<float>::quiet_NaN() : (a < 0 ? sg : g);
  float z = b > 0 ? 0.0f : inf;
  z = bodd ? std::copysign(z, a) : z;
  r = (a == 0) & (b == b) ? z : r;
  r = b == 2.0f ? a * a : (b == 3.0f ? a * a * a : r);
  r = (b == 0.0f) | (a == 1.0f) | ((a == -1.0f) & ((b == inf) | (b == -inf))) ? 1.0f : r;
  return r;
}
SF_INLINE double sf_pow(double a, double b) { return std::pow(a, b); }
// sf_pow's values for the exponents 2 and 3 (a literal exponent; cpp.py prints these)
template <class T> SF_INLINE T sf_square(T a) { return a * a; }
template <class T> SF_INLINE T sf_cube(T a) { return a * a * a; }

SF_INLINE float sf_sqrt(float x) { return std::sqrt(x); }
SF_INLINE double sf_sqrt(double x) { return std::sqrt(x); }
SF_INLINE float sf_rsqrt(float x) { return 1.0f / std::sqrt(x); }
SF_INLINE double sf_rsqrt(double x) { return 1.0 / std::sqrt(x); }
SF_INLINE float sf_sigmoid(float x) { return 1.0f / (1.0f + sf_exp(-x)); }
SF_INLINE double sf_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
// std::nearbyint: GCC vectorizes it as roundps/roundpd (SSE4.1, x86-64-v2 and up). An arithmetic
// form (adding and subtracting 2^23 below 2^23, with the sign restored) measured 1.1x slower on a QDQ
// BERT's quantize kernels (1.16-1.47x per kernel, session 26)
SF_INLINE float sf_round(float x) { return std::nearbyint(x); }
SF_INLINE double sf_round(double x) { return std::nearbyint(x); }

}  // namespace

// ---- exponentials and float16 conversions through the vector function ABI ------------------------
// sfv_exp, sfv_exp_nonpos, sfv_h2f, sfv_f2h and sfv_f16_round compute sf_exp, sf_exp_nonpos, sf_h2f32,
// sf_f2h32 and sf_f16_round, bit for bit, for the generated kernels' loops (cpp.py prints them where a call
// is not under a condition nor in a reduction's loop). Declared `omp declare simd` without a body: where
// GCC vectorizes a loop calling them it calls their 4-, 8- and 16-lane forms under the x86-64 vector
// function ABI's names (_ZGVbN4v_, _ZGVcN8v_ (sfv_f2h: _ZGVcN4v_), _ZGVdN8v_, _ZGVeN16v_ + the name; any form
// the loop's instruction set runs that matches its vectorization factor: vmath.h), which the library's
// `vmath` objects define (vmath.h; templates_cpu.prebuilt_tables): the exponential's 16-lane form clamps
// with vminps/vmaxps and scales with one vscalefps, where GCC's vectorization of the inline helper spends
// 33 instructions per 16 values (compares, blends and a two-step integer scaling; rfcs/0002 "Exponentials
// in vector form"); the float16 conversions' forms at AVX2 and AVX-512 are F16C's (about ten integer steps
// each inline). Without the prebuilt objects, or with another compiler, they are the inline helpers.
#if defined(SF_VMATH_UNIT)
extern "C" float sfv_exp(float x);
extern "C" float sfv_exp_nonpos(float x);
extern "C" float sfv_h2f(uint32_t b);
extern "C" uint32_t sfv_f2h(float x);
extern "C" float sfv_f16_round(float x);
#elif defined(SF_PREBUILT_TABLES) && defined(__x86_64__) && defined(_OPENMP) && defined(__GNUC__) \
    && !defined(__clang__)
extern "C" {
#pragma omp declare simd notinbranch
__attribute__((const, nothrow)) float sfv_exp(float x);
#pragma omp declare simd notinbranch
__attribute__((const, nothrow)) float sfv_exp_nonpos(float x);
#pragma omp declare simd notinbranch
__attribute__((const, nothrow)) float sfv_h2f(uint32_t b);
#pragma omp declare simd notinbranch
__attribute__((const, nothrow)) uint32_t sfv_f2h(float x);
#pragma omp declare simd notinbranch
__attribute__((const, nothrow)) float sfv_f16_round(float x);
}
#else
#define sfv_exp sf_exp
#define sfv_exp_nonpos sf_exp_nonpos
#define sfv_h2f sf_h2f32
#define sfv_f2h sf_f2h32
#define sfv_f16_round sf_f16_round
#endif
namespace {
SF_INLINE float sfv_sigmoid(float x) { return 1.0f / (1.0f + sfv_exp(-x)); }
}  // namespace
