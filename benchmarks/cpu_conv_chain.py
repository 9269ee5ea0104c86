"""Chains of blocked direct convs (``sf_conv2d_packed_direct``, both sides in the blocked layout) timed one conv
at a time, each reading what the one before wrote, as inside a CNN (the other thread wrote half of the image).

Compiles a small C++ program against the cpu kernel library as the code generator includes it
(``PRELUDE`` + the template files), with the toolchain's flags, and prints each conv's time and rate. The
chain alternates ``C0 -> C1`` and ``C1 -> C0``; weights are random, so the figures are the kernels' own
(``benchmarks/cpu_nodes.py`` times the convs of a whole model). With ``--convs`` past the last level cache
(say 40 convs of 3x3 512 -> 512), the weights come from memory, as a batch-1 model's do.

    python benchmarks/cpu_conv_chain.py 1024 256 14 --convs 4        # 1x1 256 -> 1024 -> 256 at 14x14
    python benchmarks/cpu_conv_chain.py 512 512 7 --convs 2 --kernel 3
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

MAIN = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
int main(int argc, char** argv) {
  const int64_t C0 = atol(argv[1]), C1 = atol(argv[2]), HW = atol(argv[3]), KS = atol(argv[6]);
  const int n = atoi(argv[4]), reps = atoi(argv[5]);
  const int64_t P = HW * HW, cmax = C0 > C1 ? C0 : C1;
  std::vector<std::vector<float>> w(n), act(n + 1);
  std::vector<float> b(cmax, 0.01f);
  srand(1);
  for (auto& a : act) { a.resize(cmax * P + 64); for (auto& v : a) v = (rand() % 100) * 0.01f; }
  for (int i = 0; i < n; ++i) {
    const int64_t c = i % 2 ? C1 : C0, oc = i % 2 ? C0 : C1;
    w[i].resize(((oc + 15) / 16) * 16 * c * KS * KS + 64);
    for (auto& v : w[i]) v = (rand() % 100 - 50) * 0.0002f;
  }
  const SfClamp relu{true, 0.0f, 1e30f};
  std::vector<double> ms(n, 0.0);
  for (int r = 0; r < reps + 10; ++r)
    for (int i = 0; i < n; ++i) {
      const int64_t c = i % 2 ? C1 : C0, oc = i % 2 ? C0 : C1;
      const SfConvGeom g{c, HW, HW, KS, KS, 1, 1, 1, 1, KS / 2, KS / 2, HW, HW};
      const auto t0 = std::chrono::steady_clock::now();
      sf_conv2d_packed_direct(act[i].data(), w[i].data(), b.data(), act[i + 1].data(), g, 1, oc, KS == 1,
                              SF_BLK_IN | SF_BLK_OUT, nullptr, nullptr, nullptr, relu);
      if (r >= 10) ms[i] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
  for (int i = 0; i < n; ++i) {
    const int64_t c = i % 2 ? C1 : C0, oc = i % 2 ? C0 : C1;
    printf("conv %d  %ld -> %ld  %ldx%ld at %ldx%ld: %.4f ms  %.1f GFLOP/s\n", i, c, oc, KS, KS, HW, HW,
           ms[i] / reps, 2.0 * c * oc * KS * KS * P / (ms[i] / reps) / 1e6);
  }
}
"""


def main(argv=None) -> None:
    from shardflow.compiler.codegen.cpp import _clones_macro
    from shardflow.compiler.codegen.prelude_cpu import PRELUDE
    from shardflow.compiler.codegen.templates_cpu import TEMPLATE_PRELUDE
    from shardflow.compiler.codegen.toolchain import compile_flags, cxx_compiler

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("c0", type=int)
    ap.add_argument("c1", type=int)
    ap.add_argument("hw", type=int, help="image height and width (stride 1, 'same' padding)")
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--kernel", type=int, default=1, help="window size (1 or 3)")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="sf-chain-")
    src, exe = os.path.join(work, "chain.cpp"), os.path.join(work, "chain")
    with open(src, "w") as f:
        f.write(_clones_macro() + PRELUDE + TEMPLATE_PRELUDE + MAIN)
    flags = [fl for fl in compile_flags(2) if fl not in ("-shared", "-fPIC")]
    subprocess.run(cxx_compiler().split() + flags + [src, "-o", exe], check=True)
    out = subprocess.run([exe, str(args.c0), str(args.c1), str(args.hw), str(args.convs), str(args.reps),
                          str(args.kernel)], check=True, capture_output=True, text=True).stdout
    print(f"threads: {os.environ.get('OMP_NUM_THREADS', 'all')}")
    print(out, end="")


if __name__ == "__main__":
    main()
