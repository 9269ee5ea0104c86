"""Run generated CUDA kernels on the host, without a GPU (a test tool, not part of shardflow).

The cuda target's kernels are C++ with a few CUDA constructs: thread and block indices,
``__shared__`` arrays, ``__syncthreads``, ``__shfl_xor_sync``, half-precision conversions and
device math; the portable GEMM template's ``nvcuda::wmma`` API (each lane holds its fragment's
whole tile: the template only uses fragments through the API or element-wise); the attention
kernel's ``ldmatrix``, ``mma.sync.m16n8k16`` and ``m16n8k8`` (TF32: an operand not converted to
TF32 fails the launch) (after the PTX ISA's fragment layouts: a warp's matrix instruction waits
for all its lanes, like a shuffle); and the Hopper GEMMs' asynchronous machinery, modelled so that a
missing wait shows: ``cp.async`` copies land only at the ``wait_group`` that covers their group,
``wgmma`` products (operands read through their shared-memory descriptors, 128-byte swizzle) run
only at the ``wait_group`` that covers them, bulk tensor copies (TMA, from the emulation's own
tensor maps) land a random number of scheduler rounds after they were issued and in any order,
completing their bytes on mbarriers (phases, parity waits, transaction counts), named
barriers (``bar.sync``/``bar.arrive``) count their threads, and the blocks of a cluster
(``__cluster_dims__``, the launch's ``cluster``) are resident together, reach each other's
shared memory and mbarriers (``mapa`` addresses) and wait at the cluster barrier; a store or an
arrival in a block that has exited fails the run (on a GPU it is an error).
:func:`build` compiles a generated translation unit with g++ against that shim: every CUDA thread
of a block is a coroutine (a stack of its own; switched by swapping registers on x86-64, elsewhere by
``ucontext``) on one host thread, a block's threads run until each finishes or waits at a barrier,
a barrier opens when every thread of the block (or, for a warp instruction or ``__syncwarp``, of
the warp) that has not exited waits at it, and the blocks of
the grid run one after another, or a given number at a time with their threads interleaved (as
blocks resident on different multiprocessors run at once; a persistent kernel takes a smaller
grid, each block looping over more tiles). Nothing runs in parallel: a run is one interleaving,
chosen by a seed (with a seed above 1, threads also sit out scheduler rounds at random). A wait
that can never end (lanes of one warp at different barriers, or every live thread polling what
nothing changes any more) is reported as a deadlock instead of hanging, and a vector access (``SfVec4``, ``float4``,
``float2``) at an address that is not a multiple of its size, which faults on a GPU, fails the run
(arguments are aligned as in the runtime's arena).

Host math (glibc) is not bit-identical to CUDA's device math (within a few ulps either way), so
checks use the tolerances of the GPU tests. Kernels whose blocks wait for each other (split-K
spread over a full grid, stream-K) need all their blocks resident (``resident``); run alone, one
waiting for a later block is reported as a deadlock. Inline PTX the shim does not replace is not
emulated (:func:`build` refuses it). What the shim cannot show: timing, the memory model (a missing
``__threadfence``), bank conflicts, register and shared-memory limits, and the wmma fragments'
real register layout.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
import threading

import numpy as np
from shardflow.compiler.codegen.toolchain import _precompiled_header

_SHIM = r"""
#include <math.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <map>
#include <memory>
#include <type_traits>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __expf(x) expf(x)  // (glibc declares an internal __expf it does not export)
#define __grid_constant__
#define __cluster_dims__(...)
#define SF_EMU_API __attribute__((visibility("default")))  // (builds hide the rest: -fvisibility=hidden)

typedef _Float16 __half;
struct __nv_bfloat16 { unsigned short x; };
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half_rn(float f) { return (__half)f; }
inline __half __double2half(double d) { return (__half)d; }
inline float __bfloat162float(__nv_bfloat16 b) {
  unsigned u = (unsigned)b.x << 16; float f; memcpy(&f, &u, 4); return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40u)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return {(unsigned short)(u >> 16)};
}
inline __nv_bfloat16 __double2bfloat16(double d) { return __float2bfloat16_rn((float)d); }
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __half2 __floats2half2_rn(float a, float b) { return {(__half)a, (__half)b}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
template <typename A, typename B> inline std::common_type_t<A, B> min(A a, B b) { return a < b ? a : b; }
template <typename A, typename B> inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
using std::isnan;
using std::isinf;

// the portable wmma GEMM template's API: every lane holds its fragment's whole tile (the
// emulation's layout; the template only touches fragments element-wise or through this API)
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision { struct tf32 {}; }
template <typename T> struct element { typedef T type; };
template <> struct element<precision::tf32> { typedef float type; };
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
  static_assert(!std::is_same<Layout, col_major>::value, "the emulation loads row-major fragments only");
  static constexpr int rows = std::is_same<Use, matrix_b>::value ? K : M;
  static constexpr int cols = std::is_same<Use, matrix_a>::value ? K : N;
  static constexpr int num_elements = rows * cols;
  typename element<T>::type x[rows * cols];
};
inline float value(float v) { return v; }
inline float value(__half v) { return (float)v; }
inline float value(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename F, typename V> inline void fill_fragment(F& f, V v) {
  for (int i = 0; i < F::num_elements; ++i) f.x[i] = v;
}
template <typename F, typename P> inline void load_matrix_sync(F& f, const P* p, unsigned ld) {
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c) f.x[r * F::cols + c] = p[r * ld + c];
}
// (every lane computes the whole product, k in order for each element; vectorized along n)
template <typename D, typename A, typename B, typename C>
__attribute__((optimize("O3"))) static inline void mma_sync(D& d, const A& a, const B& b, const C& c) {
  float out[D::num_elements], bv[B::num_elements];
  for (int i = 0; i < B::num_elements; ++i) bv[i] = value(b.x[i]);
  for (int i = 0; i < D::num_elements; ++i) out[i] = c.x[i];
  for (int r = 0; r < D::rows; ++r)
    for (int k = 0; k < A::cols; ++k) {
      const float av = value(a.x[r * A::cols + k]);
      for (int n = 0; n < D::cols; ++n) out[r * D::cols + n] += av * bv[k * B::cols + n];
    }
  for (int i = 0; i < D::num_elements; ++i) d.x[i] = out[i];
}
template <typename F> inline void store_matrix_sync(float* p, const F& f, unsigned ld, layout_t layout) {
  if (layout != mem_row_major) { fprintf(stderr, "sf_emu: column-major stores are not emulated\n"); abort(); }
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c) p[r * ld + c] = f.x[r * F::cols + c];
}
inline float __float_to_tf32(float x) {  // cvt.rna.tf32.f32: 10 mantissa bits, ties away from 0
  unsigned u;
  memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  memcpy(&x, &u, 4);
  return x;
}
}  // namespace wmma
}  // namespace nvcuda

struct SfDim3 { unsigned x, y, z; };
struct alignas(64) SfTmap {  // the emulation's own tensor map: what the copies need (128 bytes, as CUtensorMap)
  unsigned long long base, dim0, dim1, stride1;
  unsigned box0, box1, elem, swizzle;
  unsigned char pad[128 - 48];
};
inline SfDim3 threadIdx, blockIdx, blockDim, gridDim;

namespace sf_emu {
enum State { RUN, BAR, WARP, DONE, SPIN, CLUSTER };  // SPIN: runnable, but polling something
struct Copy { unsigned dst; const void* src; bool full; };  // a 16-byte cp.async
struct Mma { float* d; unsigned long long da, db; int bn, ty, ta, tb; };  // a wgmma (ty: 0 f16, 1 bf16, 2 tf32)
// a thread's asynchronous operations in groups (the last one still open, not committed)
template <typename T> struct Groups {
  std::vector<std::vector<T>> g{1};
  void add(const T& op) { g.back().push_back(op); }
  void commit() { g.emplace_back(); }
  template <typename F> void wait(int n, F run) {  // until at most n committed groups are pending
    while ((int)g.size() - 1 > n) {
      for (const T& op : g.front()) run(op);
      g.erase(g.begin());
    }
  }
};
// a coroutine's saved context, and the switch from the running one to another. On x86-64 the callee-saved
// registers pushed on the coroutine's own stack and its stack pointer (sf_emu_switch, in the runtime):
// glibc's swapcontext also saves and restores the signal mask, a system call at every switch, which took
// 38% of the float32 attention cases' time (perf). Elsewhere, swapcontext. (The
// floating-point control words are not switched: nothing in the emulation changes them.)
#if defined(__x86_64__)
struct Ctx { void* sp; };
extern "C" void sf_emu_switch(void** save, void* to);
inline void switch_to(Ctx& from, const Ctx& to) { sf_emu_switch(&from.sp, to.sp); }
inline void start(Ctx& c, char* stack, size_t size, void (*fn)()) {  // the first switch to c calls fn
  void** top = (void**)(((uintptr_t)(stack + size)) & ~(uintptr_t)15);
  top[-1] = nullptr;  // (fn's return address: it never returns)
  top[-2] = (void*)fn;  // (sf_emu_switch's, so fn starts with the stack aligned as after a call)
  for (int i = 3; i <= 8; ++i) top[-i] = nullptr;  // rbp, rbx, r12-r15
  c.sp = top - 8;
}
#else
struct Ctx { ucontext_t uc; };
inline void switch_to(Ctx& from, const Ctx& to) { swapcontext(&from.uc, &to.uc); }
inline void start(Ctx& c, char* stack, size_t size, void (*fn)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, fn, 0);
}
#endif
struct Thread { Ctx ctx; State state; int buf, xbuf; SfDim3 idx; Groups<Copy> copies; Groups<Mma> mmas; };
inline std::vector<Thread> threads;
// the threads' stacks: allocated uninitialized (glibc maps blocks this large on demand, so only the
// pages a thread touches become resident: a full persistent grid, 132 blocks of 384 threads, would
// hold 13 GB zero-filled) and released at the end of each launch
static const size_t kStack = 256 * 1024;
inline std::vector<std::unique_ptr<char[]>> stacks;
inline std::vector<unsigned long long> slots[2];  // shuffle values, double-buffered per thread
struct Words { unsigned w[8]; };
inline std::vector<Words> xslots[2];  // the operands of warp-wide matrix instructions, likewise
inline std::vector<unsigned char> dyn;  // the current block's dynamic shared memory
inline int cur;  // the running thread (over the resident blocks: block cur / nthr, thread cur % nthr)
inline int nthr;  // threads per block
inline int lane_of(int t) { return (t % nthr) & 31; }
inline int warp_of(int t) { return t - lane_of(t); }  // the thread of lane 0 of t's warp
inline unsigned long long epoch;  // counts events that can end a wait (deadlock detection)
inline Ctx sched;
inline void (*body)(void**);
inline void** body_args;

inline void entry() {
  body(body_args);
  threads[cur].state = DONE;
  ++epoch;
  switch_to(threads[cur].ctx, sched);
}
inline void wait(State s) {
  threads[cur].state = s;
  switch_to(threads[cur].ctx, sched);
}
// what the emulated program did that a GPU would not run: the launch fails with this message (the
// thread stops here), instead of the process
inline char fault[256];
inline void fail(const char* what, unsigned addr) {
  snprintf(fault, sizeof fault, what, addr);
  wait(DONE);
  abort();  // (never resumed)
}
// a warp-wide instruction: every lane gives its operands; returns the warp's 32, by lane
inline const Words* exchange(const unsigned* w, int n) {
  const int me = cur, buf = threads[me].xbuf;
  threads[me].xbuf ^= 1;
  memcpy(xslots[buf][me].w, w, n * sizeof(unsigned));
  wait(WARP);
  return &xslots[buf][warp_of(me)];
}
inline float half_value(unsigned bits, bool bf) {  // the low 16 bits as a half value
  const unsigned short h = (unsigned short)bits;
  if (bf) return __bfloat162float({h});
  __half x;
  memcpy(&x, &h, 2);
  return (float)x;
}
// ldmatrix .x4 (.trans): lanes 8m..8m+7 address the rows of 8 x 8 matrix m; lane l gets, of matrix
// m, row l/4, columns 2(l%4) and 2(l%4)+1 (transposed: column l/4, rows 2(l%4) and 2(l%4)+1)
inline void ldmatrix(unsigned addr, unsigned* r, bool trans) {
  const Words* all = exchange(&addr, 1);
  const int lane = lane_of(cur);
  for (int m = 0; m < 4; ++m) {
    unsigned short lo, hi;
    if (!trans) {
      const unsigned short* row = reinterpret_cast<const unsigned short*>(dyn.data() + all[m * 8 + lane / 4].w[0]);
      lo = row[(lane % 4) * 2];
      hi = row[(lane % 4) * 2 + 1];
    } else {
      const int rr = (lane % 4) * 2;
      lo = reinterpret_cast<const unsigned short*>(dyn.data() + all[m * 8 + rr].w[0])[lane / 4];
      hi = reinterpret_cast<const unsigned short*>(dyn.data() + all[m * 8 + rr + 1].w[0])[lane / 4];
    }
    r[m] = (unsigned)lo | ((unsigned)hi << 16);
  }
}
// this lane's C fragment of an m16n8kK product, C += A B: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
template <int K> inline void accumulate(float* c, const float (*A)[K], const float (*B)[8]) {
  const int lane = lane_of(cur), g = lane / 4, t = lane % 4;
  for (int q = 0; q < 4; ++q) {
    const int row = g + (q / 2) * 8, col = 2 * t + (q % 2);
    float acc = c[q];
    for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
    c[q] = acc;
  }
}
// mma.sync.m16n8k16.row.col, float accumulators (PTX ISA fragment layouts; g = lane/4, t = lane%4):
// A regs: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); B regs: (2t..2t+1, g), (2t+8.., g);
// C: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
inline void mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1, bool bf) {
  const unsigned mine[6] = {a0, a1, a2, a3, b0, b1};
  const Words* all = exchange(mine, 6);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 2; ++i) {
      A[g][2 * t + i] = half_value(all[l].w[0] >> (16 * i), bf);
      A[g + 8][2 * t + i] = half_value(all[l].w[1] >> (16 * i), bf);
      A[g][2 * t + 8 + i] = half_value(all[l].w[2] >> (16 * i), bf);
      A[g + 8][2 * t + 8 + i] = half_value(all[l].w[3] >> (16 * i), bf);
      B[2 * t + i][g] = half_value(all[l].w[4] >> (16 * i), bf);
      B[2 * t + 8 + i][g] = half_value(all[l].w[5] >> (16 * i), bf);
    }
  }
  accumulate<16>(c, A, B);
}
// mma.sync.m16n8k8.row.col with TF32 operands (each register one value; g = lane/4, t = lane%4):
// A regs: (g, t), (g+8, t), (g, t+4), (g+8, t+4); B regs: (t, g), (t+4, g); C as m16n8k16's. An
// operand must be TF32 (its low 13 bits clear, as cvt.rna.tf32.f32 leaves them): the kernels convert
// every one, so a value that is not fails the launch
inline void mma_tf32(float* c, const unsigned* mine) {
  const Words* all = exchange(mine, 6);
  float A[16][8], B[8][8];
  for (int l = 0; l < 32; ++l) {
    for (int r = 0; r < 6; ++r)
      if ((all[l].w[r] & 0x7f800000u) != 0x7f800000u && (all[l].w[r] & 0x1fffu))
        fail("an mma.sync TF32 operand is not TF32 (bits %08x): convert it with cvt.rna.tf32.f32", all[l].w[r]);
    const int g = l / 4, t = l % 4;
    float v[6];
    memcpy(v, all[l].w, sizeof v);
    A[g][t] = v[0];
    A[g + 8][t] = v[1];
    A[g][t + 4] = v[2];
    A[g + 8][t + 4] = v[3];
    B[t][g] = v[4];
    B[t + 4][g] = v[5];
  }
  accumulate<8>(c, A, B);
}
inline void spin() { wait(SPIN); }

// mbarriers (keyed by their shared-memory address) and named barriers of the current block
struct Mbar { unsigned count, pending, phase; long long tx; };
inline std::map<unsigned, Mbar> mbars;
struct Named { unsigned arrived, generation; };
inline Named named[16];
inline void mbar_check(Mbar& b) {
  if (b.pending == 0 && b.tx == 0) { b.phase += 1; b.pending = b.count; ++epoch; }
}
inline Mbar& mbar(unsigned addr) {
  auto it = mbars.find(addr);
  if (it == mbars.end()) fail("mbarrier %u used before init", addr);
  return it->second;
}
inline unsigned swizzle128(unsigned a) { return a ^ (((a >> 7) & 7u) << 4); }
inline void copy16(const Copy& c) {
  if (c.full) memcpy(dyn.data() + c.dst, c.src, 16);
  else memset(dyn.data() + c.dst, 0, 16);
}
struct Tma { unsigned dst; SfTmap map; int c0, c1; unsigned bar; };
inline std::vector<Tma> tmas;  // bulk tensor copies in flight
// the state of each resident block; the current block's lives in the globals above (switching
// swaps it back: the shared memory's storage, which threads hold pointers into, never moves)
struct Block { std::vector<unsigned char> dyn; std::map<unsigned, Mbar> mbars; Named named[16]; std::vector<Tma> tmas;
               SfDim3 idx; };
inline std::vector<Block> blocks;
inline int curblk = -1;
inline void swap_state(Block& b) {
  std::swap(dyn, b.dyn);
  std::swap(mbars, b.mbars);
  std::swap(named, b.named);
  std::swap(tmas, b.tmas);
}
inline void enter(int b) {  // make block b the current one
  if (b == curblk) return;
  if (curblk >= 0) swap_state(blocks[curblk]);
  swap_state(blocks[b]);
  curblk = b;
  blockIdx = blocks[b].idx;
}
// clusters: blocks 0-1, 2-3, ... of a wave (whose first block is a multiple of the cluster size)
inline int csize = 1;
inline int exited_access;  // a cluster access to a block whose threads have all exited
inline std::vector<unsigned char>& dyn_of(int b) { return b == curblk ? dyn : blocks[b].dyn; }
inline std::map<unsigned, Mbar>& mbars_of(int b) { return b == curblk ? mbars : blocks[b].mbars; }
inline std::vector<Tma>& tmas_of(int b) { return b == curblk ? tmas : blocks[b].tmas; }
inline bool block_live(int b) {  // a thread of resident block b has not exited
  for (int t = b * nthr; t < (b + 1) * nthr; ++t)
    if (threads[t].state != DONE) return true;
  return false;
}
// the resident block of rank `rank` in the running thread's cluster (an access to it after all its
// threads exited is counted: on a GPU it is an error)
inline int cluster_block(int rank) {
  const int b = cur / nthr / csize * csize + rank;
  if (!block_live(b)) ++exited_access;
  return b;
}
inline int misaligned;  // vector accesses whose address is not a multiple of their size (a GPU faults)
inline int trapped;  // a thread called __trap()
// clock64(): advances by clock_step a call; a step above 1 also counts as progress, so that a wait
// with a time limit reaches it instead of being reported as a deadlock
inline unsigned long long clock_now, clock_step = 1;
template <typename V, typename P> inline V* at(P* p) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(V)) ++misaligned;
  return reinterpret_cast<V*>(p);
}
inline unsigned long long rng = 1;  // which copies land in a round (deterministic)
inline bool coin() { rng = rng * 6364136223846793005ull + 1442695040888963407ull; return (rng >> 33) & 1; }
}  // namespace sf_emu

// the TMA kernels' helpers (cuda_wgmma.WGMMA_HELPERS; its sf_smem_desc is kept as generated)
// cp.async: a copy lands when a wait_group lets no later than its group be pending
inline void sf_cp_async16(unsigned dst, const void* src, bool full) {
  sf_emu::threads[sf_emu::cur].copies.add({dst, src, full});
}
inline void sf_cp_commit() { sf_emu::threads[sf_emu::cur].copies.commit(); }
template <int N> inline void sf_cp_wait() { sf_emu::threads[sf_emu::cur].copies.wait(N, sf_emu::copy16); }
inline void sf_mbar_init(unsigned bar, unsigned count) { sf_emu::mbars[bar] = {count, count, 0, 0}; }
inline void sf_mbar_arrive(unsigned bar) {
  sf_emu::Mbar& b = sf_emu::mbar(bar);
  b.pending -= 1;
  ++sf_emu::epoch;
  sf_emu::mbar_check(b);
}
inline void sf_mbar_expect_tx(unsigned bar, unsigned bytes) {
  sf_emu::Mbar& b = sf_emu::mbar(bar);
  b.tx += bytes;
  sf_mbar_arrive(bar);
}
// try_wait.parity: passes once the phase of that parity has completed (the current phase differs)
inline void sf_mbar_wait(unsigned bar, unsigned parity) {
  while ((sf_emu::mbar(bar).phase & 1u) == (parity & 1u)) sf_emu::spin();
}
// a 2-D bulk tensor copy: the box at (c0, c1) (elements outside the tensor read as 0) into shared
// memory with the 128-byte swizzle, completing its bytes on mbarrier `bar`; copies in flight land
// in a random order, a few rounds of the scheduler after they were issued
inline void sf_tma_land(const sf_emu::Tma& t) {
  const SfTmap& m = t.map;
  unsigned char* smem = sf_emu::dyn.data();
  const unsigned row = m.box0 * m.elem;
  for (unsigned y = 0; y < m.box1; ++y)
    for (unsigned x = 0; x < m.box0; ++x) {
      const long long gx = (long long)t.c0 + x, gy = (long long)t.c1 + y;
      unsigned a = t.dst + y * row + x * m.elem;
      if (m.swizzle == 128) a = sf_emu::swizzle128(a);
      if (gx >= 0 && gy >= 0 && gx < (long long)m.dim0 && gy < (long long)m.dim1)
        memcpy(smem + a, reinterpret_cast<const unsigned char*>(m.base) + gy * m.stride1 + gx * m.elem, m.elem);
      else
        memset(smem + a, 0, m.elem);
    }
  sf_emu::Mbar& b = sf_emu::mbar(t.bar);
  b.tx -= (long long)row * m.box1;
  ++sf_emu::epoch;
  sf_emu::mbar_check(b);
}
inline void sf_tma_2d(unsigned dst, const SfTmap* m, int c0, int c1, unsigned bar) {
  sf_emu::tmas.push_back({dst, *m, c0, c1, bar});
}
// multicast: the same box into each block of the cluster in `mask`, at `dst` and completing on `bar`
// there (each copy lands on its own, at random, like any other)
inline void sf_tma_2d_mc(unsigned dst, const SfTmap* m, int c0, int c1, unsigned bar, unsigned short mask) {
  for (int r = 0; r < sf_emu::csize; ++r)
    if (mask >> r & 1) sf_emu::tmas_of(sf_emu::cluster_block(r)).push_back({dst, *m, c0, c1, bar});
}
inline void sf_tma_prefetch(const SfTmap*) {}
// bar.sync / bar.arrive: barrier `id` completes when `count` threads arrived at it
inline void sf_bar_arrive(int id, int count) {
  sf_emu::Named& b = sf_emu::named[id];
  ++sf_emu::epoch;
  if (++b.arrived == (unsigned)count) { b.arrived = 0; b.generation += 1; }
}
inline void sf_bar_sync(int id, int count) {
  const unsigned gen = sf_emu::named[id].generation;
  sf_bar_arrive(id, count);
  while (sf_emu::named[id].generation == gen) sf_emu::spin();
}
inline void sf_fence_async_smem() {}
inline void sf_wgmma_fence() {}
inline float sf_tf32(float x) { return nvcuda::wmma::__float_to_tf32(x); }  // cvt.rna.tf32.f32
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline void sf_emu_wgmma_run(const sf_emu::Mma& op);
// wgmma: a group's products run (reading shared memory then) when a wait_group lets no later than
// it be pending, so a stage freed too early shows as wrong operands
inline void sf_wgmma_commit() { sf_emu::threads[sf_emu::cur].mmas.commit(); }
template <int N> inline void sf_wgmma_wait() { sf_emu::threads[sf_emu::cur].mmas.wait(N, sf_emu_wgmma_run); }
// wgmma.mma_async m64nNk16 (halves) or m64nNk8 (TF32), float accumulators, operands in shared
// memory (128-byte swizzle) by descriptor: K-major (trans 0) element (row r, k) at start + (r/8) SBO
// + (r%8) 128 + size k; MN-major (halves only, trans 1) element (k, r) at start + (r/64) LBO + (k/8)
// SBO + (k%8) 128 + 2 (r%64). A TF32 operand is a float32 whose low 13 mantissa bits are ignored.
// Each thread of the warpgroup updates its own accumulators (warp w, lane l: rows 16w + l/4 (+8),
// columns 8j + 2(l%4) (+1)); the operands are read when a wait_group completes the instruction.
inline float sf_emu_operand(unsigned long long desc, int trans, int r, int k, int ty) {
  const unsigned start = (unsigned)(desc & 0x3FFFull) << 4, lbo = (unsigned)((desc >> 16) & 0x3FFFull) << 4;
  const unsigned sbo = (unsigned)((desc >> 32) & 0x3FFFull) << 4;
  if (ty == 2) {
    if (trans) sf_emu::fail("a TF32 wgmma operand must be K-major (descriptor %u)", start);
    unsigned u;
    memcpy(&u, sf_emu::dyn.data() + sf_emu::swizzle128(start + (r / 8) * sbo + (r % 8) * 128 + 4 * k), 4);
    u &= 0xffffe000u;
    float x;
    memcpy(&x, &u, 4);
    return x;
  }
  const unsigned a = trans ? start + (r / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + 2 * (r % 64)
                           : start + (r / 8) * sbo + (r % 8) * 128 + 2 * k;
  unsigned short h;
  memcpy(&h, sf_emu::dyn.data() + sf_emu::swizzle128(a), 2);
  return sf_emu::half_value(h, ty == 1);
}
inline void sf_emu_wgmma(float* d, unsigned long long da, unsigned long long db, int bn, int ty, int ta,
                                int tb) {
  sf_emu::threads[sf_emu::cur].mmas.add({d, da, db, bn, ty, ta, tb});
}
inline void sf_emu_wgmma_run(const sf_emu::Mma& op) {
  const int t = sf_emu::cur % sf_emu::nthr % 128, w = t / 32, l = t % 32;
  for (int j = 0; j < op.bn / 8; ++j)
    for (int q = 0; q < 4; ++q) {
      const int row = 16 * w + l / 4 + (q / 2) * 8, col = 8 * j + 2 * (l % 4) + (q % 2);
      float acc = op.d[4 * j + q];
      for (int k = 0; k < (op.ty == 2 ? 8 : 16); ++k)
        acc += sf_emu_operand(op.da, op.ta, row, k, op.ty) * sf_emu_operand(op.db, op.tb, col, k, op.ty);
      op.d[4 * j + q] = acc;
    }
}
// clusters: mapa encodes the block's rank above the shared-memory offset (offsets are below 2^20)
inline unsigned sf_cluster_rank() { return blockIdx.x % (unsigned)sf_emu::csize; }
inline void sf_cluster_sync() { sf_emu::wait(sf_emu::CLUSTER); }
inline unsigned sf_mapa(unsigned addr, unsigned rank) { return (addr & 0xFFFFFu) | ((rank + 1u) << 20); }
inline int sf_emu_cluster_block(unsigned addr) {  // the resident block a shared::cluster address is in
  const int rank = (int)(addr >> 20) - 1;
  return rank < 0 ? sf_emu::cur / sf_emu::nthr : sf_emu::cluster_block(rank);
}
inline void sf_st_cluster2(unsigned addr, float x, float y) {
  const int b = sf_emu_cluster_block(addr);
  if (addr % 8) ++sf_emu::misaligned;
  float v[2] = {x, y};
  memcpy(sf_emu::dyn_of(b).data() + (addr & 0xFFFFFu), v, 8);
}
inline void sf_mbar_arrive_cluster(unsigned addr) {
  const int b = sf_emu_cluster_block(addr);
  auto& bars = sf_emu::mbars_of(b);
  auto it = bars.find(addr & 0xFFFFFu);
  if (it == bars.end()) sf_emu::fail("remote mbarrier %u used before init", addr & 0xFFFFFu);
  it->second.pending -= 1;
  ++sf_emu::epoch;
  sf_emu::mbar_check(it->second);
}
inline void sf_mbar_wait_cluster(unsigned bar, unsigned parity) { sf_mbar_wait(bar, parity); }
inline void __threadfence() {}
inline void __nanosleep(unsigned) { sf_emu::spin(); }
inline long long clock64() {
  sf_emu::clock_now += sf_emu::clock_step;
  if (sf_emu::clock_step > 1) ++sf_emu::epoch;
  return (long long)sf_emu::clock_now;
}
inline void __trap() {  // the launch fails (the thread stops here)
  sf_emu::trapped = 1;
  sf_emu::wait(sf_emu::DONE);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  ++sf_emu::epoch;
  return old;
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = v;
  ++sf_emu::epoch;
  return old;
}
inline void __stcg(float* p, float v) { *p = v; }
inline float __ldcg(const float* p) { return *p; }

inline unsigned __cvta_generic_to_shared(const void* p) {
  return (unsigned)(reinterpret_cast<const unsigned char*>(p) - sf_emu::dyn.data());
}
// the attention kernel's helpers (cuda_attention.ATTENTION_HELPERS): cp.async as above
inline void sf_att_cp16(unsigned dst, const void* src, bool full) { sf_cp_async16(dst, src, full); }
inline void sf_att_commit() { sf_cp_commit(); }
template <int N> inline void sf_att_wait() { sf_cp_wait<N>(); }
inline void sf_ldm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  unsigned r[4];
  sf_emu::ldmatrix(addr, r, false);
  r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}
inline void sf_ldm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  unsigned r[4];
  sf_emu::ldmatrix(addr, r, true);
  r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}
inline void sf_emu_mma(bool bf, float& c0, float& c1, float& c2, float& c3, unsigned a0, unsigned a1,
                              unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  float c[4] = {c0, c1, c2, c3};
  sf_emu::mma(c, a0, a1, a2, a3, b0, b1, bf);
  c0 = c[0]; c1 = c[1]; c2 = c[2]; c3 = c[3];
}

inline void sf_emu_mma_tf32(float& c0, float& c1, float& c2, float& c3, unsigned a0, unsigned a1,
                                   unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  float c[4] = {c0, c1, c2, c3};
  const unsigned ab[6] = {a0, a1, a2, a3, b0, b1};
  sf_emu::mma_tf32(c, ab);
  c0 = c[0]; c1 = c[1]; c2 = c[2]; c3 = c[3];
}
// the float32 attention kernels' conversion (cuda_attention.ATTENTION_FLOAT_HELPERS; sf_att_split kept)
inline unsigned sf_att_tf32(float x) { return __float_as_uint(nvcuda::wmma::__float_to_tf32(x)); }

inline void __syncthreads() { sf_emu::wait(sf_emu::BAR); }
inline void __syncwarp(unsigned = 0xffffffffu) { sf_emu::wait(sf_emu::WARP); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  using namespace sf_emu;
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  const int me = cur, buf = threads[me].buf;
  threads[me].buf ^= 1;
  unsigned long long raw = 0;
  memcpy(&raw, &v, sizeof(T));
  slots[buf][me] = raw;
  wait(WARP);
  const int lane = lane_of(me);
  const int src = warp_of(me) + (((lane ^ lane_mask) < (lane / width + 1) * width) ? (lane ^ lane_mask) : lane);
  T r;
  raw = slots[buf][src];
  memcpy(&r, &raw, sizeof(T));
  return r;
}

"""

#: the emulation's scheduler and entry points: compiled once into an object every build links
_SHIM_RUNTIME = r"""#if defined(__x86_64__)
// sf_emu_switch(save, to): push the callee-saved registers, store the stack pointer at *save, take `to`
// as the stack pointer, pop that coroutine's registers and return where it switched away (or, the first
// time, into its function: shim's start). Hidden: each library has its own.
asm(".pushsection .text\n.globl sf_emu_switch\n.hidden sf_emu_switch\n.type sf_emu_switch, @function\nsf_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size sf_emu_switch, .-sf_emu_switch\n.popsection\n");
#endif
// runs body(args) as every thread of every block, `resident` blocks at a time (their threads
// interleaved, as blocks resident on different multiprocessors run at once); returns 0, 1 on a
// deadlock, 2 after a misaligned vector access, 3 after a __trap()
static int sf_emu_run(void (*body)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                      unsigned bx, unsigned by, unsigned bz, unsigned smem, unsigned seed, unsigned resident,
                      unsigned long long clock_step, unsigned cluster) {
  using namespace sf_emu;
  const int n = (int)(bx * by * bz), total = (int)(gx * gy * gz);
  const int nb = (int)std::max(1u, std::min(resident, (unsigned)total));
  csize = (int)cluster;
  if (total % csize || nb % csize) return 5;  // a cluster's blocks run together: whole clusters only
  exited_access = 0;
  nthr = n;
  threads.assign(n * nb, Thread());
  while ((int)stacks.size() < n * nb) stacks.emplace_back(new char[kStack]);
  slots[0].assign(n * nb, 0);
  slots[1].assign(n * nb, 0);
  xslots[0].assign(n * nb, Words());
  xslots[1].assign(n * nb, Words());
  misaligned = trapped = 0;
  fault[0] = 0;
  sf_emu::clock_step = clock_step;
  sf_emu::clock_now = 0;
  sf_emu::body = body;
  body_args = args;
  blockDim = {bx, by, bz};
  gridDim = {gx, gy, gz};
  for (int first = 0; first < total; first += nb) {  // a wave of resident blocks
    const int live = std::min(nb, total - first);
    if (curblk >= 0) swap_state(blocks[curblk]);
    curblk = -1;
    blocks.assign(live, Block());
    for (int b = 0; b < live; ++b) {
      const unsigned i = (unsigned)(first + b);
      blocks[b].idx = {i % gx, (i / gx) % gy, i / (gx * gy)};
      blocks[b].dyn.assign(smem, 0x5A);  // (garbage, as on a GPU)
    }
    rng = seed;
    const int nt = n * live;
    for (int t = 0; t < nt; ++t) {
      Thread& th = threads[t];
      th.state = RUN;
      th.buf = th.xbuf = 0;
      th.copies = Groups<Copy>();
      th.mmas = Groups<Mma>();
      const unsigned l = (unsigned)(t % n);
      th.idx = {l % bx, (l / bx) % by, l / (bx * by)};
      start(th.ctx, stacks[t].get(), kStack, entry);
    }
    int idle = 0;  // rounds in a row in which nothing happened that could end a wait
    for (;;) {
      const unsigned long long before = epoch;
      bool spinning_only = true;
      bool skipped = false;
      for (int t = 0; t < nt; ++t) {
        if (threads[t].state != RUN && threads[t].state != SPIN) continue;
        if (seed > 1 && !coin() && !coin()) {  // with a seed: a thread sits out a round now and then
          skipped = true;
          continue;
        }
        spinning_only = spinning_only && threads[t].state == SPIN;
        threads[t].state = RUN;
        cur = t;
        enter(t / n);
        threadIdx = threads[t].idx;
        switch_to(sched, threads[t].ctx);
      }
      bool in_flight = false;
      for (int b = 0; b < live; ++b) {  // some of the copies in flight land
        enter(b);
        for (size_t i = 0; i < tmas.size();) {
          if (coin()) {
            sf_tma_land(tmas[i]);
            tmas.erase(tmas.begin() + i);
          } else {
            ++i;
          }
        }
        in_flight = in_flight || !tmas.empty();
      }
      bool done = true, released = false;
      for (int b = 0; b < live; ++b) {
        for (int w = b * n; w < (b + 1) * n; w += 32) {  // a warp whose live lanes all wait at a shuffle or __syncwarp
          bool all = true, any = false;
          for (int t = w; t < w + 32 && t < (b + 1) * n; ++t) {
            if (threads[t].state == DONE) continue;
            any = true;
            all = all && threads[t].state == WARP;
          }
          if (any && all) {
            for (int t = w; t < w + 32 && t < (b + 1) * n; ++t) if (threads[t].state == WARP) threads[t].state = RUN;
            released = true;
            ++epoch;
          }
        }
        bool all_bar = true, any_bar = false;
        for (int t = b * n; t < (b + 1) * n; ++t) {
          if (threads[t].state != DONE) done = false;
          if (threads[t].state != DONE && threads[t].state != BAR) all_bar = false;
          any_bar = any_bar || threads[t].state == BAR;
        }
        if (all_bar && any_bar) {
          for (int t = b * n; t < (b + 1) * n; ++t) if (threads[t].state == BAR) threads[t].state = RUN;
          released = true;
          ++epoch;
        }
      }
      for (int c = 0; c < live; c += csize) {  // a cluster whose live threads all wait at its barrier
        bool all = true, any = false;
        for (int t = c * n; t < (c + csize) * n; ++t) {
          if (threads[t].state == DONE) continue;
          all = all && threads[t].state == CLUSTER;
          any = any || threads[t].state == CLUSTER;
        }
        if (all && any) {
          for (int t = c * n; t < (c + csize) * n; ++t) if (threads[t].state == CLUSTER) threads[t].state = RUN;
          released = true;
          ++epoch;
        }
      }
      if (trapped) return 3;
      if (fault[0]) return 6;
      if (clock_now > (1ull << 40)) return 1;  // past any time limit: waiting for what never comes
      if (done) break;
      bool running = false, spinning = false;
      for (int t = 0; t < nt; ++t) {
        running = running || threads[t].state == RUN;
        spinning = spinning || threads[t].state == SPIN;
      }
      if (!running && !spinning && !released) return 1;  // every live thread waits, and no barrier can open
      idle = (!running && spinning_only && epoch == before && !in_flight) ? idle + 1 : 0;
      if (idle > (skipped ? 64 : 1)) return 1;  // polling what nothing changes any more
    }
  }
  return misaligned ? 2 : exited_access ? 4 : 0;
}

extern "C" SF_EMU_API const char* sf_emu_fault() { return sf_emu::fault; }
extern "C" SF_EMU_API int sf_emu_launch(void (*body)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                                        unsigned bx, unsigned by, unsigned bz, unsigned smem, unsigned seed,
                                        unsigned resident, unsigned long long clock_step, unsigned cluster) {
  const int r = sf_emu_run(body, args, gx, gy, gz, bx, by, bz, smem, seed, resident, clock_step, cluster);
  std::vector<std::unique_ptr<char[]>>().swap(sf_emu::stacks);
  return r;
}
"""

_WGMMA = re.compile(r"__device__ __forceinline__ void sf_wgmma_(\d+)_(f16|bf16|tf32)_(\d)(\d)\(float\* d, "
                    r"unsigned long long da, unsigned long long db\) \{.*?\n\}\n", re.S)
_WGMMA_TYPES = ("f16", "bf16", "tf32")  # the shim's Mma::ty
_NO_OP_ASM = re.compile(r'asm volatile\("(?:setmaxnreg|fence\.mbarrier_init|griddepcontrol)[^"]*"[^;]*;')
#: the vector types of the generated code, whose accesses are checked for alignment
_VECTOR = re.compile(r"reinterpret_cast<(const )?((?:SfVec4<[\w ]+>)|float4|float2)\*>\(")
_MMA = re.compile(r'asm volatile\("mma\.sync\.aligned\.'
                  r'(m16n8k16\.row\.col\.f32\.(f16|bf16)\.\2|m16n8k8\.row\.col\.f32\.tf32\.tf32)'
                  r'\.f32 [^"]*" : ([^:]*) : ([^;]*)\);')


def _host_source(text: str) -> str:
    """The generated source with what the shim provides in its place: the helpers with inline PTX
    (but the descriptor encoding and the grid-wide wait, kept as generated), ``mma.sync``, ``wgmma`` and no-op PTX
    statements, the dynamic shared memory; vector accesses go through an alignment check."""
    from shardflow.compiler.codegen.cuda_attention import ATTENTION_FLOAT_HELPERS, ATTENTION_HELPERS
    from shardflow.compiler.codegen.cuda_wgmma import SPLIT_HELPERS, WGMMA_HELPERS

    def kept(helpers: str, *names: str) -> str:
        return "".join(re.search(rf"__device__ __forceinline__ [\w ]+ {name}\(.*?\n\}}\n", helpers, re.S).group(0)
                       for name in names)
    text = text.replace(ATTENTION_HELPERS, "")
    text = text.replace(ATTENTION_FLOAT_HELPERS, kept(ATTENTION_FLOAT_HELPERS, "sf_att_split"))
    text = text.replace(WGMMA_HELPERS, kept(WGMMA_HELPERS, "sf_smem_desc", "sf_grid_wait"))
    text = text.replace(SPLIT_HELPERS, kept(SPLIT_HELPERS, "sf_tf32_hi", "sf_split4"))  # (the shim's sf_tf32: no PTX)
    text = _VECTOR.sub(lambda m: f"sf_emu::at<{m.group(1) or ''}{m.group(2)}>(", text)
    text = re.sub(r"extern __shared__ __align__\((\d+)\) unsigned char sf_dyn\[\];",
                  "unsigned char* sf_dyn = sf_emu::dyn.data();", text)
    # register budgets, the mbarrier-init fence and the grid dependency control of programmatic
    # dependent launch (grids run one after another here): nothing to do
    text = _NO_OP_ASM.sub("", text)
    text = _WGMMA.sub(lambda m: (f"static inline void sf_wgmma_{m.group(1)}_{m.group(2)}_{m.group(3)}{m.group(4)}("
                                 "float* d, unsigned long long da, unsigned long long db) {\n"
                                 f"  sf_emu_wgmma(d, da, db, {m.group(1)}, {_WGMMA_TYPES.index(m.group(2))}, "
                                 f"{m.group(3)}, {m.group(4)});\n}}\n"), text)

    def mma(m: re.Match) -> str:
        c = re.findall(r'"\+f"\(([^)]*)\)', m.group(3))
        ab = re.findall(r'"r"\(([^)]*)\)', m.group(4))
        assert len(c) == 4 and len(ab) == 6, m.group(0)
        if m.group(2) is None:  # TF32
            return f"sf_emu_mma_tf32({', '.join(c + ab)});"
        return f"sf_emu_mma({'true' if m.group(2) == 'bf16' else 'false'}, {', '.join(c + ab)});"
    return _MMA.sub(mma, text)


class HostKernels:
    """A generated translation unit compiled for the host; :meth:`launch` runs one kernel."""

    def __init__(self, lib: ctypes.CDLL, signatures: dict[str, list[str]]):
        self.lib = lib
        self.signatures = signatures
        self.lib.sf_emu_launch.restype = ctypes.c_int
        self.lib.sf_emu_fault.restype = ctypes.c_char_p

    def launch(self, symbol: str, grid, block, arrays, shared_mem: int = 0, seed: int = 1, resident: int = 1,
               clock_step: int = 1, cluster: int = 1) -> None:
        """Run ``symbol`` over ``grid`` x ``block`` on numpy ``arrays`` (its parameters, in
        order: contiguous arrays whose memory the kernel reads and writes), with ``shared_mem``
        bytes of dynamic shared memory. ``seed`` > 1 also lets threads sit out scheduler rounds
        at random (another interleaving for each seed); bulk copies land at random either way.
        ``resident`` blocks run at once, their threads interleaved (blocks that wait for each
        other, as a persistent kernel's may, need all of theirs). ``clock64()`` advances by
        ``clock_step`` a call (above 1, waits with a time limit reach it). ``cluster``: blocks per
        cluster (the kernel's ``__cluster_dims__``): consecutive blocks, resident together (the
        grid and ``resident`` multiples of it), that reach each other's shared memory and
        mbarriers and wait at the cluster's barrier."""
        types = self.signatures[symbol]
        maps = [a for a in arrays if isinstance(a, np.ndarray) and a.dtype == _MAP]
        if len(types) != len(arrays) or len(maps) != types.count("const SfTmap"):
            raise ValueError(f"{symbol} takes {len(types)} arguments, got {len(arrays)}")
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError(f"{symbol}: arguments must be C-contiguous arrays")
        ptrs = (ctypes.c_void_p * max(1, len(arrays)))(*[a.ctypes.data for a in arrays])
        body = ctypes.cast(getattr(self.lib, f"sf_emu_body_{symbol}"), ctypes.c_void_p)
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        status = self.lib.sf_emu_launch(body, ptrs, *g, *b, ctypes.c_uint(shared_mem), ctypes.c_uint(seed),
                                        ctypes.c_uint(resident), ctypes.c_ulonglong(clock_step), ctypes.c_uint(cluster))
        if status == 1:
            raise RuntimeError(f"{symbol}: deadlock (threads wait at barriers that cannot open, or poll what nothing "
                               "changes any more)")
        if status == 3:
            raise RuntimeError(f"{symbol}: __trap() (the launch fails)")
        if status == 2:
            raise RuntimeError(f"{symbol}: a vector access at an address that is not a multiple of its size")
        if status == 4:
            raise RuntimeError(f"{symbol}: a store or arrival in the shared memory of a cluster block that has exited")
        if status == 5:
            raise ValueError(f"{symbol}: the grid and the resident blocks must be whole clusters of {cluster}")
        if status == 6:
            raise RuntimeError(f"{symbol}: {self.lib.sf_emu_fault().decode()}")


def _signatures(text: str) -> dict[str, list[str]]:
    sigs = {}
    for m in re.finditer(r'extern "C" __global__ void (?:__\w+__\([^)]*\) )*(\w+)\(([^)]*)\)', text):
        params = [p.strip() for p in m.group(2).split(",") if p.strip()]
        types = []
        for p in params:
            typ = " ".join(p.rsplit(" ", 1)[0].replace("__restrict__", "").replace("__grid_constant__", "").split())
            if not (typ.endswith("*") or typ == "const SfTmap"):
                raise ValueError(f"kernel {m.group(1)}: parameter {p!r} is not a pointer or tensor map")
            types.append(typ)
        sigs[m.group(1)] = types
    return sigs


_SHIM_LOCK = threading.Lock()
_SHIM_LINES = _SHIM.count("\n")


def _host_has_f16c() -> bool:
    """Whether this x86-64 Linux host converts half values in hardware (F16C)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " f16c" in line for line in f)
    except OSError:
        return False


#: g++'s flags for the emulation. With F16C the ``__half`` (``_Float16``) conversions are vcvtph2ps and
#: vcvtps2ph (the same values as libgcc's, nearest even) instead of calls of libgcc's software
#: ``__extendhfsf2``, which took 23% of test_cuda_host.py's cpu time (perf).
_FLAGS = ["-std=c++17", "-fPIC", "-w", "-fvisibility=hidden"] + (["-mf16c"] if _host_has_f16c() else [])


@functools.lru_cache(maxsize=None)
def _compiled_shim(opt: str) -> tuple[str, str | None]:
    """The shim compiled once at ``opt`` for every build of the machine's processes (in
    ``$TMPDIR/sf-cuda-host-<key>``, each file written through a rename): the object of its
    scheduler and entry points (``_SHIM_RUNTIME``), which each library links (statically, so each
    keeps its own state: every name but the entry points is hidden), and the path to ``-include``
    for the precompiled ``_SHIM`` (None if g++ cannot precompile it: the sources then hold its text).
    Together they take about 1.5 s off each build."""
    version = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256((_SHIM + _SHIM_RUNTIME + opt + " ".join(_FLAGS) + version).encode()).hexdigest()[:16]
    d = os.path.join(tempfile.gettempdir(), f"sf-cuda-host-{key}")
    runtime = os.path.join(d, "runtime.o")
    with _SHIM_LOCK:
        os.makedirs(d, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            if not os.path.exists(runtime):
                src = os.path.join(tmp, "runtime.cpp")
                with open(src, "w") as f:
                    f.write(_SHIM + _SHIM_RUNTIME)
                proc = subprocess.run(["g++", opt, *_FLAGS, "-c", src, "-o", src[:-4] + ".o"], capture_output=True,
                                      text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"g++ failed on the emulation's runtime:\n{proc.stderr[-4000:]}")
                os.replace(src[:-4] + ".o", runtime)
            # (the cpu library's mechanism: <key>.h and its .gch in d, written by rename)
            header = _precompiled_header(_SHIM, ["g++", opt, *_FLAGS], version, d, tmp)
    return runtime, header


def build(text: str, work_dir: str | None = None, opt: str = "-O1") -> HostKernels:
    """Compile the generated CUDA translation unit ``text`` for the host (g++ at optimization
    ``opt``, cached by content under ``work_dir``) and load it. (-O1: the tests compile more than
    they run; test_cuda_host.py took 25% more cpu time at -O2, and more at -O0, whose runs are slow.)"""
    text = _host_source(text)
    if "asm volatile" in text:
        raise ValueError("the host emulation has no replacement for some inline PTX of this source")
    sigs = _signatures(text)
    body = "\n".join(ln for ln in text.splitlines() if not ln.startswith("#include <cuda") and ln != "#include <mma.h>")
    tramp = []
    for sym, types in sigs.items():
        args = ", ".join(f"*(const SfTmap*)a[{i}]" if t == "const SfTmap" else f"({t})a[{i}]"
                         for i, t in enumerate(types))
        tramp.append(f'extern "C" SF_EMU_API void sf_emu_body_{sym}(void** a) {{ {sym}({args}); }}')
    src = _SHIM + body + "\n" + "\n".join(tramp) + "\n"
    work_dir = work_dir or tempfile.mkdtemp(prefix="sf-cuda-host-")
    key = hashlib.sha256((src + _SHIM_RUNTIME + opt + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    lib = os.path.join(work_dir, f"k{key}.so")
    if not os.path.exists(lib):
        # (builds of one text may run side by side, in threads or processes: each writes files of its own,
        # or one could read the source while another rewrites it, and install a library lacking kernels)
        tmp = f"{lib}.{os.getpid()}.{threading.get_ident()}.tmp"
        cpp = f"{tmp}.cpp"
        runtime, shim = _compiled_shim(opt)
        with open(cpp, "w") as f:  # (a #line keeps the line numbers of the whole text)
            f.write(f"#line {_SHIM_LINES + 1}\n" + src[len(_SHIM):] if shim else src)
        proc = subprocess.run(["g++", opt, *_FLAGS, "-shared"] + (["-include", shim] if shim else [])
                              + ["-o", tmp, cpp, runtime], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed on {cpp}:\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib)
        os.unlink(cpp)
    return HostKernels(ctypes.CDLL(lib), sigs)


def build_all(texts: list[str], work_dir: str | None = None, opt: str = "-O1") -> list[HostKernels]:
    """:func:`build` of each of ``texts``, the compilers running side by side (one per cpu)."""
    work_dir = work_dir or tempfile.mkdtemp(prefix="sf-cuda-host-")
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(texts), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda t: build(t, work_dir, opt), texts))


#: the emulation's tensor map (the shim's SfTmap): base, dims, row stride, box, element size, swizzle
_MAP = np.dtype([("base", "<u8"), ("dim0", "<u8"), ("dim1", "<u8"), ("stride1", "<u8"), ("box0", "<u4"),
                 ("box1", "<u4"), ("elem", "<u4"), ("swizzle", "<u4"), ("pad", "V80")], align=True)


def tensor_map(spec: dict, array: np.ndarray) -> np.ndarray:
    """The shim's tensor map of a launch's description ``spec`` (see shardflow.runtime.tma) over
    ``array``, as a one-element array (passed by value)."""
    if len(spec["dims"]) != 2:
        raise ValueError("the emulation copies 2-D boxes only")
    elem = np.dtype(np.float32 if spec["dtype"] == "float32" else np.uint16).itemsize
    m = np.zeros(1, _MAP)
    m["base"] = array.ctypes.data + int(spec.get("offset", 0)) * elem
    m["dim0"], m["dim1"] = spec["dims"]
    m["stride1"] = spec["strides"][0]
    m["box0"], m["box1"] = spec["box"]
    m["elem"], m["swizzle"] = elem, int(spec.get("swizzle", 128))
    return m


def _aligned(shape, dtype) -> np.ndarray:
    """An empty array aligned as the runtime's arena places buffers."""
    from shardflow.runtime.artifact import aligned_empty

    return aligned_empty(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize).view(dtype).reshape(shape)


def run(kernels: HostKernels, launch, inputs, output_specs, grid=None, seed: int = 1,
        resident: int = 1, clock_step: int = 1, alias: dict[int, int] | None = None,
        shift: dict[int, int] | None = None) -> list[np.ndarray]:
    """Run one generated kernel (its :class:`KernelLaunch`) on numpy ``inputs``; outputs of
    ``output_specs`` (``(shape, dtype)``) start poisoned, so an element the kernel misses shows;
    every argument is aligned as in the runtime's arena (64 bytes). ``alias``: ``{output index:
    input index}``, outputs given their input's buffer (a state written in place). ``shift``:
    ``{input index: bytes}``, inputs placed that many bytes past an aligned address (a kernel's
    path for unaligned operands).
    ``grid`` replaces the launch's (a persistent kernel takes any grid: a few blocks, each looping
    over several tiles, keep the emulation short); ``resident`` blocks run at once (see
    :meth:`HostKernels.launch`, also for ``clock_step``), rounded up to whole clusters (a cluster's
    blocks always run together)."""
    ins = [_aligned(np.shape(a), np.asarray(a).dtype) for a in inputs]
    for i, b in (shift or {}).items():
        a = np.asarray(inputs[i])
        ins[i] = _aligned((a.nbytes + b,), np.uint8)[b:].view(a.dtype).reshape(a.shape)
    for i, a in zip(ins, inputs):
        i[...] = a
    outs = [_aligned(s, d) for s, d in output_specs]
    for o in outs:
        o.reshape(-1).view(np.uint8)[...] = 0x5A
    for j, i in (alias or {}).items():
        outs[j] = ins[i]
    arrays = ins + outs
    maps = [tensor_map(spec, arrays[int(spec["arg"])]) for spec in launch.tensor_maps]
    cluster = getattr(launch, "cluster", 1)
    resident = -(-resident // cluster) * cluster
    kernels.launch(launch.symbol, grid or launch.grid, launch.block, arrays + maps, launch.shared_mem, seed, resident,
                   clock_step, cluster)
    return outs
