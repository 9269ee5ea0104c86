// Exhaustive check of the cpu exponentials (rfcs/0002 "Exponentials"): helpers.h's sf_exp against the
// form it had before session 84 (a float-to-int conversion and a NaN select; expA here) on all 2^32 floats,
// and sf_exp_nonpos against it on every float <= 0 and every NaN: the same bits. Prints the counts of
// differing results (0 expected). About 15 s:
//   g++ -std=c++17 -O3 -fopenmp -march=x86-64-v2 -mtune=generic -fno-math-errno -fno-trapping-math -fwrapv \
//       benchmarks/cpu_exp_exhaustive.cpp -o /tmp/exp_check && /tmp/exp_check
#include <cstdint>
#include <cstring>
#include <cstdio>
#include "../compiler/codegen/cpu_library/helpers.h"
static inline float b2f(int32_t i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int32_t f2b(float f) { int32_t i; std::memcpy(&i, &f, 4); return i; }
#define POLY \
  float r = xc - n * 0.693359375f; r = r - n * -2.12194440e-4f; float p = 1.9875691500E-4f; \
  p = p * r + 1.3981999507E-3f; p = p * r + 8.3334519073E-3f; p = p * r + 4.1665795894E-2f; \
  p = p * r + 1.6666665459E-1f; p = p * r + 5.0000001201E-1f; float y = p * (r * r) + r + 1.0f;
static inline __attribute__((always_inline)) float expA(float x) {
  float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  POLY
  int32_t ni = (int32_t)n; int32_t n1 = ni >> 1, n2 = ni - n1;
  y = y * b2f((n1 + 127) << 23) * b2f((n2 + 127) << 23);
  return x != x ? x : y;
}
__attribute__((target_clones("default","arch=x86-64-v3","arch=x86-64-v4")))
void chunk(uint32_t base, uint32_t n, float* a, float* b, float* c) {
  #pragma omp simd
  for (uint32_t i = 0; i < n; ++i) { uint32_t u = base + i; float x; std::memcpy(&x, &u, 4); a[i] = expA(x); b[i] = sf_exp(x); c[i] = sf_exp_nonpos(x); }
}
int main() {
  const uint32_t N = 1u << 20; static float a[1<<20], b[1<<20], c[1<<20];
  uint64_t dab = 0, dac = 0, nanbad = 0;
  for (uint64_t base = 0; base < (1ull << 32); base += N) {
    chunk((uint32_t)base, N, a, b, c);
    for (uint32_t i = 0; i < N; ++i) {
      uint32_t u = (uint32_t)base + i; float x; std::memcpy(&x, &u, 4);
      bool an = a[i] != a[i];
      if (an != (b[i] != b[i]) || (!an && f2b(a[i]) != f2b(b[i]))) { if (dab++ < 5) printf("AB %08x %g: %g %g\n", u, x, a[i], b[i]); }
      bool nonpos = (x <= 0) || (x != x);
      if (nonpos) { if (an != (c[i] != c[i]) || (!an && f2b(a[i]) != f2b(c[i]))) { if (dac++ < 5) printf("AC %08x %g: %g %g\n", u, x, a[i], c[i]); } }
      if ((x != x) && !an) nanbad++;
    }
  }
  printf("AB diffs %lu, AC diffs %lu, nan not kept %lu\n", dab, dac, nanbad);
}
