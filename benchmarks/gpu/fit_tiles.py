"""Fit the tile efficiencies of ``choose_wgmma_config`` to measured tile sweeps, and show how the
shipped table chooses.

Input: files written by ``gemm.py --config C`` runs (one ``== C`` line, then that tile's case
lines, for each tile): ``--sweep`` files measured the tiles as they are now wherever a TMA tile
does not split K (benchmarks/results/h100-2026-11-22-wgmma-tiles.txt: the cp.async tiles;
h100-2026-11-22-tma-tiles.txt: the TMA tiles before split-K); ``--spread-sweep`` files
(``gemm.py --config C --split-min-kt S`` runs, ``== C split-min-kt S`` sections:
h100-2026-11-23-tma-spread-split-tiles.txt, M = 128 and 1024, the only sizes that split) measured
the TMA tiles with split-K as it is now; their sections with ``S`` = ``cuda_wgmma.SPLIT_MIN_KT``
replace the older figures of the same cases and tiles. (The sweep of the first split-K, with
its serial reduction, h100-2026-11-22-tma-split4-tiles.txt, is superseded.) The model is the one of
``cuda_wgmma.choose_wgmma_config`` (waves of blocks x useful fraction x efficiency x the split
factor where K is split); the ``cp`` tiles keep their relative efficiencies times one factor,
the ``tma`` tiles get one each and a split factor each (the ``pp`` and ``sk`` ones, where a
sweep has them, one each), all chosen by coordinate search to
maximize the geometric mean of
the chosen tiles' measured ratios to cuBLAS (a choice without a measurement counts as 0.3); the
choice itself is ``choose_wgmma_config`` with the trial figures. No
GPU needed::

    python benchmarks/gpu/fit_tiles.py --sweep benchmarks/results/h100-2026-11-22-wgmma-tiles.txt \
        benchmarks/results/h100-2026-11-22-tma-tiles.txt \
        --spread-sweep benchmarks/results/h100-2026-11-23-tma-spread-split-tiles.txt
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
GRID_SPLIT = [x / 100 for x in range(10, 131, 2)]


def read_sweep(paths: list[str], dtype: str = "float16",
               split_min_kt: int | None = None) -> dict[tuple[str, int], dict[str, float]]:
    """(case name, M) -> {tile: ratio to cuBLAS}; with ``split_min_kt``, only the sections
    measured with that ``--split-min-kt``, else only those measured without one."""
    data: dict = {}
    for path in paths:
        tile = None
        with open(path) as f:
            for ln in f:
                m = re.match(r"== (\S+)(?: split-min-kt (\d+))?", ln)
                if m:
                    tile = m.group(1) if m.group(2) == (None if split_min_kt is None else str(split_min_kt)) else None
                    continue
                m = re.match(rf"\s+(\S+)_M(\d+)_{dtype}\s+ours .*ratio ([\d.]+)", ln)
                if m and tile:
                    data.setdefault((m.group(1), int(m.group(2))), {})[tile] = float(m.group(3))
    return data


def main(argv: list[str] | None = None) -> dict:
    """Fit, print the comparison, and return the fitted figures (``cp_factor``, ``split``, and
    one per ``tma`` tile, and per ``pp`` or ``sk`` tile that a sweep measured)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", nargs="+", required=True)
    ap.add_argument("--spread-sweep", nargs="*", default=[])
    args = ap.parse_args(argv)
    ensure_shardflow()
    from shardflow.compiler.codegen import cuda_wgmma as W

    shapes = {f"{model}_{proj.replace('|', '_')}": (n, k) for model, proj, n, k in PROJECTIONS}

    def tiles_of(name: str, M: int, N: int) -> int:
        return -(-M // W.tile_rows(name)) * -(-N // W.WGMMA_CONFIGS[name][1])

    def splits(name: str, M: int, N: int, K: int) -> int:
        return W.split_count(tiles_of(name, M, N), K) if W.WGMMA_CONFIGS[name][3] == "tma" else 1

    plain = read_sweep(args.sweep)
    data: dict = {}
    for (c, M), v in plain.items():
        N, K = shapes[c]
        row = data.setdefault((c, M), {})
        for t, r in v.items():
            if t in W.WGMMA_CONFIGS and splits(t, M, N, K) == 1:  # (tiles no longer shipped are left out)
                row[t] = r
    for (c, M), v in read_sweep(args.spread_sweep, split_min_kt=W.SPLIT_MIN_KT).items():
        data.setdefault((c, M), {}).update({t: r for t, r in v.items() if t in W.WGMMA_CONFIGS})

    def pick(eff: dict, M: int, N: int, K: int) -> str:
        tiles = {n: e for n, e in eff.items() if n != "split"}
        return W.choose_wgmma_config(M, N, 1, K=K, efficiency=tiles, split_efficiency=eff["split"])

    def geomean(eff: dict) -> float:
        return math.exp(sum(math.log(v.get(pick(eff, M, *shapes[c]), 0.3)) for (c, M), v in data.items())
                        / len(data))

    # (the tiles of a column count that is not a multiple of 64 take a K-major B only, which the
    # sweeps, with B [K, N], do not have)
    tma = {t: 1.0 for t, v in W.WGMMA_CONFIGS.items() if t.startswith("tma") and v[1] % 64 == 0}
    split_factor = {t: 1.0 for t in tma}
    # the ping-pong and stream-K tiles where a sweep measured them (an efficiency each, no split)
    tma.update({t: 1.0 for row in data.values() for t in row if W.WGMMA_CONFIGS[t][3] in ("pp", "sk")})
    factor = 0.8

    def table(t, f, sf):
        return {**{c: r * f for c, r in CP_RELATIVE.items()}, **t, "split": sf}
    for _ in range(6):  # coordinate search
        for key in [*tma, "factor", *(f"split:{t}" for t in split_factor)]:
            sk = key.partition("split:")[2]

            def trial(x):
                return geomean(table({**tma, key: x} if key in tma else tma, x if key == "factor" else factor,
                                     {**split_factor, sk: x} if sk else split_factor))
            grid = GRID_SPLIT if sk else GRID
            values = {x: trial(x) for x in grid}
            best = max(grid, key=lambda x: (round(values[x], 12), -x))  # ties: the smallest
            if key == "factor":
                factor = best
            elif sk:
                split_factor[sk] = best
            else:
                tma[key] = best
    print(f"fitted: cp factor {factor}, split factors {split_factor}, tma {tma}; "
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
