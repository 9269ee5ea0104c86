"""Fit the tile efficiencies of ``choose_wgmma_config`` to measured tile sweeps, and show how the
shipped table chooses.

Input: files written by ``gemm.py --config C`` runs (one ``== C`` line, then that tile's case
lines, for each tile): ``--sweep`` files measured the tiles as they are now wherever a TMA tile
does not split K (benchmarks/results/h100-2026-11-22-wgmma-tiles.txt: the cp.async tiles;
h100-2026-11-22-tma-tiles.txt: the TMA tiles before split-K), ``--split-sweep`` files the TMA
tiles with split-K under the first rule (at least 4 K tiles per split,
h100-2026-11-22-tma-split4-tiles.txt): a split case counts where that rule split the same way
as :func:`cuda_wgmma.split_count` does now, and is left out otherwise. The model is the one of
``cuda_wgmma.choose_wgmma_config`` (waves of blocks x useful fraction x efficiency x the split
factor where K is split); the ``cp`` tiles keep their relative efficiencies times one factor,
the ``tma`` tiles get one each, all chosen by coordinate search to maximize the geometric mean of
the chosen tiles' measured ratios to cuBLAS (a choice without a measurement counts as 0.3); the
choice itself is ``choose_wgmma_config`` with the trial figures. No
GPU needed::

    python benchmarks/gpu/fit_tiles.py --sweep benchmarks/results/h100-2026-11-22-wgmma-tiles.txt \
        benchmarks/results/h100-2026-11-22-tma-tiles.txt \
        --split-sweep benchmarks/results/h100-2026-11-22-tma-split4-tiles.txt
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


def _split_rule4(tiles: int, K: int, sms: int = 132) -> int:
    """The split count of the first split-K rule (commit 7f9c1e7), to read its sweep."""
    kt = -(-K // 64)
    if 2 * tiles > sms or kt < 8:
        return 1
    want = max(1, min(sms // tiles, kt // 4, 16))
    return -(-kt // -(-kt // want))


def main(argv: list[str] | None = None) -> dict:
    """Fit, print the comparison, and return the fitted figures (``cp_factor``, ``split``, and
    one per ``tma`` tile)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", nargs="+", required=True)
    ap.add_argument("--split-sweep", nargs="*", default=[])
    args = ap.parse_args(argv)
    ensure_shardflow()
    from shardflow.compiler.codegen import cuda_wgmma as W

    shapes = {f"{model}_{proj.replace('|', '_')}": (n, k) for model, proj, n, k in PROJECTIONS}

    def tiles_of(name: str, M: int, N: int) -> int:
        wg, bn = W.WGMMA_CONFIGS[name][:2]
        return -(-M // (64 * wg)) * -(-N // bn)

    def splits(name: str, M: int, N: int, K: int) -> int:
        return W.split_count(tiles_of(name, M, N), K) if W.WGMMA_CONFIGS[name][3] == "tma" else 1

    plain, split = read_sweep(args.sweep), read_sweep(args.split_sweep)
    data: dict = {}
    for (c, M), v in plain.items():
        N, K = shapes[c]
        row = data.setdefault((c, M), {})
        for t, r in v.items():
            if t in W.WGMMA_CONFIGS and splits(t, M, N, K) == 1:  # (tiles no longer shipped are left out)
                row[t] = r
        for t, r in split.get((c, M), {}).items():
            s = splits(t, M, N, K)
            if s > 1 and s == _split_rule4(tiles_of(t, M, N), K):
                row[t] = r

    def pick(eff: dict, M: int, N: int, K: int) -> str:
        tiles = {n: e for n, e in eff.items() if n != "split"}
        return W.choose_wgmma_config(M, N, 1, K=K, efficiency=tiles, split_efficiency=eff["split"])

    def geomean(eff: dict) -> float:
        return math.exp(sum(math.log(v.get(pick(eff, M, *shapes[c]), 0.3)) for (c, M), v in data.items())
                        / len(data))

    tma = {t: 1.0 for t in W.WGMMA_CONFIGS if t.startswith("tma")}
    factor, split_factor = 0.8, 1.0

    def table(t, f, sf):
        return {**{c: r * f for c, r in CP_RELATIVE.items()}, **t, "split": sf}
    for _ in range(6):  # coordinate search
        for key in [*tma, "factor", "split"]:
            def trial(x):
                return geomean(table({**tma, key: x} if key in tma else tma, x if key == "factor" else factor,
                                     x if key == "split" else split_factor))
            values = {x: trial(x) for x in GRID}
            best = max(GRID, key=lambda x: (round(values[x], 12), -x))  # ties: the smallest
            if key == "factor":
                factor = best
            elif key == "split":
                split_factor = best
            else:
                tma[key] = best
    print(f"fitted: cp factor {factor}, split factor {split_factor}, tma {tma}; "
          f"geomean {geomean(table(tma, factor, split_factor)):.3f}")
    shipped = {**W._TILE_EFFICIENCY, "split": W._SPLIT_EFFICIENCY}
    best_all = math.exp(sum(math.log(max(v.values())) for v in data.values()) / len(data))
    print(f"shipped table: geomean {geomean(shipped):.3f} (fastest measured tile of every shape: {best_all:.3f})")
    print(f"{'case':<22} {'M':>5}  {'chosen':<14} {'ratio':>6}  {'fastest':<14} {'ratio':>6}")
    for (c, M), v in sorted(data.items()):
        ch, fast = pick(shipped, M, *shapes[c]), max(v, key=v.get)
        label = lambda t: f"{t}/{splits(t, M, *shapes[c])}"  # noqa: E731
        got = f"{v[ch]:>6.3f}" if ch in v else "     -"
        print(f"{c:<22} {M:>5}  {label(ch):<14} {got}  {label(fast):<14} {v[fast]:>6.3f}")
    return {"cp_factor": factor, "split": split_factor, **tma}


if __name__ == "__main__":
    main()
