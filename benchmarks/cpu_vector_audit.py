"""Which inner loops of a model's cpu kernels the C++ compiler leaves scalar, and why.

Compiles the model for one cpu rank the way ``compile`` does (fusion included), then compiles the
generated kernel source once more with ``-fopt-info-vec-all`` for one ISA (default x86-64-v3, AVX2)
and lists every innermost loop that GCC did not vectorize: the kernel, the ops it runs, the loop's
line and the compiler's reasons (the ``missed:`` lines inside the loop). A kernel whose element-wise
loop is scalar typically runs 4-16x slower than its vectorized form; two such regressions (a QDQ
GELU, a QDQ RMSNorm) went unseen by the tests until a whole-model benchmark showed them, and this
finds them in a minute. Loops that cannot vectorize by nature (a sequential scan, a pooling
window's few taps) are listed too: read the reasons. The convolution templates' epilogue
functions draw no compiler message at all (GCC reports nothing for them in the whole library;
compiled alone they vectorize) and show as scalar without a reason.

    python benchmarks/cpu_vector_audit.py MODEL.onnx [--march x86-64-v3] [--source out.cpp] [--all]

``--all`` lists every innermost loop with its status, not only the scalar ones; ``--source`` keeps
the generated source. Needs g++ (``$CXX``).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def kernel_source(model: str) -> tuple[str, dict]:
    """The cpu kernel library source ``compile`` generates for ``model`` on one rank, and its line map
    ``{symbol: (first line, last line, op names)}``."""
    import shardflow.compiler.codegen as cg
    from shardflow.compiler import compile

    captured = []
    orig = cg.generate_cpu_source

    def capture(groups):
        src = orig(groups)
        captured.append(src)
        return src

    cg.generate_cpu_source = capture
    try:
        with tempfile.TemporaryDirectory() as d:
            compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                    out_dir=os.path.join(d, "out"))
    finally:
        cg.generate_cpu_source = orig
    if not captured:
        raise SystemExit(f"{model}: no cpu kernels were generated")
    whole, lines = captured[-1].units(1)[0]
    return whole, lines


def innermost_loops(text_lines: list[str], first: int, last: int) -> list[tuple[int, int, int]]:
    """``(for line, closing line, enclosing loop's for line or 0)`` of the loops between ``first``
    and ``last`` (1-based) with no loop inside them (brace counting on the generated code's layout:
    one statement per line)."""
    loops, stack = [], []  # stack: [for line, has an inner loop, brace depth inside it]
    depth = 0
    for no in range(first, last + 1):
        line = text_lines[no - 1].split("//", 1)[0]
        is_for = re.match(r"\s*for \(", line) is not None
        if is_for:
            for s in stack:
                s[1] = True
            parent = stack[-1][0] if stack else 0
            if "{" in line and line.count("{") == line.count("}"):  # the whole loop on one line
                loops.append((no, no, parent))
                continue
            if not line.rstrip().endswith("{"):  # a one-statement body on the next line
                if no + 1 <= last and not re.match(r"\s*for \(", text_lines[no]):
                    loops.append((no, no + 1, parent))
                continue
        depth += line.count("{") - line.count("}")
        if is_for:
            stack.append([no, False, depth])
        while stack and depth < stack[-1][2]:
            no_for, has_inner, _ = stack.pop()
            if not has_inner:
                loops.append((no_for, no, stack[-1][0] if stack else 0))
    return loops


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--march", default="x86-64-v3")
    ap.add_argument("--source", help="write the generated kernel source here")
    ap.add_argument("--all", action="store_true", help="list vectorized innermost loops too")
    args = ap.parse_args(argv)
    from shardflow.compiler.codegen import toolchain

    whole, lmap = kernel_source(args.model)
    with tempfile.TemporaryDirectory() as d:
        path = args.source or os.path.join(d, "kernels.cpp")
        with open(path, "w") as f:
            f.write(whole)
        flags = [x for x in toolchain.compile_flags(2) if x not in ("-shared", "-w") and not x.startswith("-m")]
        cxx = os.environ.get("CXX", "g++").split()
        res = subprocess.run(cxx + flags + [f"-march={args.march}", "-c", path, "-o", os.path.join(d, "k.o"),
                                            "-fopt-info-vec-all",  # one ISA: no target_clones copies, one message per loop
                                            "-DSF_NO_CLONES"], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"the compiler failed:\n{res.stderr[-3000:]}")
    base = re.escape(os.path.basename(path))
    vectorized, missed = set(), {}
    for m in re.finditer(rf"{base}:(\d+):\d+: (optimized|missed): (.*)", res.stderr):
        no, kind, msg = int(m.group(1)), m.group(2), m.group(3).strip()
        if kind == "optimized" and msg.startswith("loop vectorized"):
            vectorized.add(no)
        elif kind == "missed" and "statement clobbers memory" not in msg:
            missed.setdefault(no, []).append(msg)
    text_lines = whole.splitlines()
    n_loops = n_scalar = 0
    for sym, (first, last, ops) in sorted(lmap.items(), key=lambda kv: kv[1][0]):
        for start, end, parent in innermost_loops(text_lines, first, last):
            body = [text_lines[start - 1].split("{", 1)[-1]] if start == end else text_lines[start:end]
            if not any("=" in b for b in body):
                continue  # a loop of calls (a template's batch loop): nothing to vectorize here
            n_loops += 1
            # (an `omp simd` loop is reported at its pragma's line; a few taps' loop inside one the
            # compiler vectorizes, as a pool's, is unrolled into it)
            ok = any(no in vectorized or (no - 1 in vectorized and "#pragma omp simd" in text_lines[no - 2])
                     for no in (start, parent) if no)
            n_scalar += not ok
            if ok and not args.all:
                continue
            why = sorted({msg for no in range(start - 1, end + 1) for msg in missed.get(no, [])
                          if "couldn't vectorize loop" not in msg})
            name = (ops[0] if ops else sym) + (f" (+{len(ops) - 1})" if len(ops) > 1 else "")
            print(f"{'vectorized' if ok else 'SCALAR    '}  {name}\n    line {start}: {text_lines[start - 1].strip()}")
            for msg in ([] if ok else why[:4]):
                print(f"      {msg}")
    print(f"{n_scalar} of {n_loops} innermost loops not vectorized for {args.march} "
          f"({len(lmap)} kernels)", file=sys.stderr)


if __name__ == "__main__":
    main()
