"""Fit the tile efficiencies of ``choose_wgmma_config`` to a measured tile sweep, and show how the
shipped table chooses.

Input: files written by ``gemm.py --config C`` runs (one ``== C`` line, then that tile's case
lines, for each tile), e.g. benchmarks/results/h100-2026-11-22-wgmma-tiles.txt (the cp.async
tiles) and h100-2026-11-22-tma-tiles.txt (the persistent TMA tiles). The model is the one of
``cuda_wgmma.choose_wgmma_config`` (waves x useful fraction x efficiency); the ``cp`` tiles keep
their relative efficiencies times one factor, the ``tma`` tiles get one each, chosen by coordinate
search to maximize the geometric mean of the chosen tiles' measured ratios to cuBLAS. No GPU
needed::

    python benchmarks/gpu/fit_tiles.py benchmarks/results/h100-2026-11-22-wgmma-tiles.txt \\
        benchmarks/results/h100-2026-11-22-tma-tiles.txt
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_shardflow  # noqa: E402
from gemm import PROJECTIONS  # noqa: E402

CP_RELATIVE = {"128x256": 1.0, "128x128": 0.81, "64x128": 0.54, "64x64": 0.37}
GRID = [x / 100 for x in range(20, 131, 2)]


def read_sweep(paths: list[str], dtype: str = "float16") -> dict[tuple[str, int], dict[str, float]]:
    """(case name, M) -> {tile: ratio to cuBLAS}."""
    data: dict = {}
    for path in paths:
        tile = None
        with open(path) as f:
            for ln in f:
                m = re.match(r"== (\S+)", ln)
                if m:
                    tile = m.group(1)
                    continue
                m = re.match(rf"\s+(\S+)_M(\d+)_{dtype}\s+ours .*ratio ([\d.]+)", ln)
                if m and tile:
                    data.setdefault((m.group(1), int(m.group(2))), {})[tile] = float(m.group(3))
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+")
    args = ap.parse_args()
    ensure_shardflow()
    from shardflow.compiler.codegen import cuda_wgmma as W

    data = read_sweep(args.sweeps)
    n_of = {f"{model}_{proj.replace('|', '_')}": n for model, proj, n, _ in PROJECTIONS}

    def pick(eff: dict, M: int, N: int) -> str:
        def score(name):
            wg, bn, _, _ = W.WGMMA_CONFIGS[name]
            tiles = -(-M // (64 * wg)) * -(-N // bn)
            return tiles / (-(-tiles // 132) * 132) * M * N / (tiles * 64 * wg * bn) * eff[name]
        return max(eff, key=score)

    def geomean(eff: dict) -> float:
        return math.exp(sum(math.log(v[pick(eff, M, n_of[c])]) for (c, M), v in data.items()) / len(data))

    tma = {t: 1.0 for t in next(iter(data.values())) if t.startswith("tma")}
    factor = 0.8

    def table(t, f):
        return {**{c: r * f for c, r in CP_RELATIVE.items()}, **t}
    for _ in range(6):  # coordinate search
        for key in [*tma, "factor"]:
            trial = {x: geomean(table({**tma, key: x} if key != "factor" else tma, x if key == "factor" else factor))
                     for x in GRID}
            best = max(GRID, key=lambda x: (round(trial[x], 12), -x))  # ties: the smallest
            if key == "factor":
                factor = best
            else:
                tma[key] = best
    print(f"fitted: cp factor {factor}, tma {tma}; geomean {geomean(table(tma, factor)):.3f}")
    shipped = W._TILE_EFFICIENCY
    best_all = math.exp(sum(math.log(max(v.values())) for v in data.values()) / len(data))
    print(f"shipped table: geomean {geomean(shipped):.3f} (fastest tile of every shape: {best_all:.3f})")
    print(f"{'case':<22} {'M':>5}  {'chosen':<11} {'ratio':>6}  {'fastest':<11} {'ratio':>6}")
    for (c, M), v in sorted(data.items()):
        ch, fast = pick(shipped, M, n_of[c]), max(v, key=v.get)
        print(f"{c:<22} {M:>5}  {ch:<11} {v[ch]:>6.3f}  {fast:<11} {v[fast]:>6.3f}")


if __name__ == "__main__":
    main()
