"""Run generated CUDA kernels on the host, without a GPU (a test tool, not part of shardflow).

The cuda target's element-wise and row kernels are C++ with a few CUDA constructs: thread and
block indices, ``__shared__`` arrays, ``__syncthreads``, ``__shfl_xor_sync``, half-precision
conversions and device math. :func:`build` compiles a generated translation unit with g++ against
a small emulation of those: every CUDA thread of a block is a coroutine (``ucontext``) on one host
thread, a block's threads run until each finishes or waits at a barrier, a barrier opens when every
thread of the block (or, for a shuffle or ``__syncwarp``, of the warp) that has not exited waits at
it, and the blocks of the grid run one after another. Nothing runs concurrently, so a result does
not depend on timing; a barrier that can never open (threads of one block waiting at different
barriers) is reported as a deadlock instead of hanging.

Host math (glibc) is not bit-identical to CUDA's device math (within a few ulps either way), so
checks use the tolerances of the GPU tests. Tensor-core kernels (wmma, mma, wgmma, TMA) are out of
reach: :func:`build` refuses them.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile

import numpy as np

_SHIM = r"""
#include <math.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

typedef _Float16 __half;
struct __nv_bfloat16 { unsigned short x; };
static inline float __half2float(__half h) { return (float)h; }
static inline __half __float2half_rn(float f) { return (__half)f; }
static inline __half __double2half(double d) { return (__half)d; }
static inline float __bfloat162float(__nv_bfloat16 b) {
  unsigned u = (unsigned)b.x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40u)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return {(unsigned short)(u >> 16)};
}
static inline __nv_bfloat16 __double2bfloat16(double d) { return __float2bfloat16_rn((float)d); }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
template <typename A, typename B> static inline auto min(A a, B b) -> decltype(a < b ? a : b) { return a < b ? a : b; }
template <typename A, typename B> static inline auto max(A a, B b) -> decltype(a < b ? a : b) { return a < b ? b : a; }
using std::isnan;
using std::isinf;

struct SfDim3 { unsigned x, y, z; };
static SfDim3 threadIdx, blockIdx, blockDim, gridDim;

namespace sf_emu {
enum State { RUN, BAR, WARP, DONE };
struct Thread { ucontext_t ctx; State state; int buf; SfDim3 idx; };
static std::vector<Thread> threads;
static std::vector<std::vector<char>> stacks;
static std::vector<unsigned long long> slots[2];  // shuffle values, double-buffered per thread
static int cur;
static ucontext_t sched;
static void (*body)(void**);
static void** body_args;

static void entry() {
  body(body_args);
  threads[cur].state = DONE;
  swapcontext(&threads[cur].ctx, &sched);
}
static void wait(State s) {
  threads[cur].state = s;
  swapcontext(&threads[cur].ctx, &sched);
}
}  // namespace sf_emu

static inline void __syncthreads() { sf_emu::wait(sf_emu::BAR); }
static inline void __syncwarp(unsigned = 0xffffffffu) { sf_emu::wait(sf_emu::WARP); }
template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  using namespace sf_emu;
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  const int me = cur, buf = threads[me].buf;
  threads[me].buf ^= 1;
  unsigned long long raw = 0;
  memcpy(&raw, &v, sizeof(T));
  slots[buf][me] = raw;
  wait(WARP);
  const int lane = me & 31;
  const int src = (me & ~31) | (((lane ^ lane_mask) < (lane / width + 1) * width) ? (lane ^ lane_mask) : lane);
  T r;
  raw = slots[buf][src];
  memcpy(&r, &raw, sizeof(T));
  return r;
}

// runs body(args) as every thread of every block; returns 0, or 1 on a deadlock
extern "C" int sf_emu_launch(void (*body)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                             unsigned bx, unsigned by, unsigned bz) {
  using namespace sf_emu;
  const int n = (int)(bx * by * bz);
  threads.assign(n, Thread());
  if ((int)stacks.size() < n) stacks.resize(n, std::vector<char>(256 * 1024));
  slots[0].assign(n, 0);
  slots[1].assign(n, 0);
  sf_emu::body = body;
  body_args = args;
  blockDim = {bx, by, bz};
  gridDim = {gx, gy, gz};
  for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
    blockIdx = {x, y, z};
    for (int t = 0; t < n; ++t) {
      Thread& th = threads[t];
      th.state = RUN;
      th.buf = 0;
      th.idx = {(unsigned)t % bx, ((unsigned)t / bx) % by, (unsigned)t / (bx * by)};
      getcontext(&th.ctx);
      th.ctx.uc_stack.ss_sp = stacks[t].data();
      th.ctx.uc_stack.ss_size = stacks[t].size();
      th.ctx.uc_link = nullptr;
      makecontext(&th.ctx, entry, 0);
    }
    for (;;) {
      for (int t = 0; t < n; ++t) {
        if (threads[t].state != RUN) continue;
        cur = t;
        threadIdx = threads[t].idx;
        swapcontext(&sched, &threads[t].ctx);
      }
      bool done = true, released = false;
      for (int w = 0; w < n; w += 32) {  // a warp whose live lanes all wait at a shuffle or __syncwarp
        bool all = true, any = false;
        for (int t = w; t < w + 32 && t < n; ++t) {
          if (threads[t].state == DONE) continue;
          any = true;
          all = all && threads[t].state == WARP;
        }
        if (any && all) {
          for (int t = w; t < w + 32 && t < n; ++t) if (threads[t].state == WARP) threads[t].state = RUN;
          released = true;
        }
      }
      bool all_bar = true;
      for (int t = 0; t < n; ++t) {
        if (threads[t].state != DONE) done = false;
        if (threads[t].state != DONE && threads[t].state != BAR) all_bar = false;
      }
      if (done) break;
      if (!released && all_bar) {
        for (int t = 0; t < n; ++t) if (threads[t].state == BAR) threads[t].state = RUN;
        released = true;
      }
      bool running = false;
      for (int t = 0; t < n; ++t) running = running || threads[t].state == RUN;
      if (!running) return 1;  // every live thread waits, and no barrier can open
    }
  }
  return 0;
}
"""

#: constructs of the tensor-core templates, which the emulation cannot run
_REFUSED = ("nvcuda::wmma", "asm volatile", "wgmma", "SfTmap")


class HostKernels:
    """A generated translation unit compiled for the host; :meth:`launch` runs one kernel."""

    def __init__(self, lib: ctypes.CDLL, signatures: dict[str, list[str]]):
        self.lib = lib
        self.signatures = signatures
        self.lib.sf_emu_launch.restype = ctypes.c_int

    def launch(self, symbol: str, grid, block, arrays) -> None:
        """Run ``symbol`` over ``grid`` x ``block`` on numpy ``arrays`` (its parameters, in
        order: contiguous arrays whose memory the kernel reads and writes)."""
        types = self.signatures[symbol]
        if len(types) != len(arrays):
            raise ValueError(f"{symbol} takes {len(types)} arguments, got {len(arrays)}")
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError(f"{symbol}: arguments must be C-contiguous arrays")
        ptrs = (ctypes.c_void_p * max(1, len(arrays)))(*[a.ctypes.data for a in arrays])
        body = ctypes.cast(getattr(self.lib, f"sf_emu_body_{symbol}"), ctypes.c_void_p)
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        if self.lib.sf_emu_launch(body, ptrs, *g, *b):
            raise RuntimeError(f"{symbol}: deadlock (the threads of a block wait at barriers that cannot open)")


def _signatures(text: str) -> dict[str, list[str]]:
    sigs = {}
    for m in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)', text):
        params = [p.strip() for p in m.group(2).split(",") if p.strip()]
        types = []
        for p in params:
            typ = p.rsplit(" ", 1)[0].replace("__restrict__", "").strip()
            if not typ.endswith("*"):
                raise ValueError(f"kernel {m.group(1)}: parameter {p!r} is not a pointer")
            types.append(typ)
        sigs[m.group(1)] = types
    return sigs


def build(text: str, work_dir: str | None = None) -> HostKernels:
    """Compile the generated CUDA translation unit ``text`` for the host (g++, cached by content
    under ``work_dir``) and load it."""
    for c in _REFUSED:
        if c in text:
            raise ValueError(f"the host emulation cannot run tensor-core kernels ({c!r} in the source)")
    sigs = _signatures(text)
    body = "\n".join(ln for ln in text.splitlines() if not ln.startswith("#include <cuda") and ln != "#include <mma.h>")
    tramp = []
    for sym, types in sigs.items():
        args = ", ".join(f"({t})a[{i}]" for i, t in enumerate(types))
        tramp.append(f'extern "C" void sf_emu_body_{sym}(void** a) {{ {sym}({args}); }}')
    src = _SHIM + body + "\n" + "\n".join(tramp) + "\n"
    work_dir = work_dir or tempfile.mkdtemp(prefix="sf-cuda-host-")
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    lib = os.path.join(work_dir, f"k{key}.so")
    if not os.path.exists(lib):
        cpp = os.path.join(work_dir, f"k{key}.cpp")
        with open(cpp, "w") as f:
            f.write(src)
        tmp = lib + ".tmp"
        proc = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w", "-o", tmp, cpp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed on {cpp}:\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib)
    return HostKernels(ctypes.CDLL(lib), sigs)


def run(kernels: HostKernels, launch, inputs, output_specs) -> list[np.ndarray]:
    """Run one generated kernel (its :class:`KernelLaunch`) on numpy ``inputs``; outputs of
    ``output_specs`` (``(shape, dtype)``) start poisoned, so an element the kernel misses shows."""
    ins = [np.ascontiguousarray(a) for a in inputs]
    outs = [np.empty(s, d) for s, d in output_specs]
    for o in outs:
        o.reshape(-1).view(np.uint8)[...] = 0x5A
    if launch.shared_mem:
        raise ValueError(f"{launch.symbol}: dynamic shared memory is not emulated")
    kernels.launch(launch.symbol, launch.grid, launch.block, ins + outs)
    return outs
