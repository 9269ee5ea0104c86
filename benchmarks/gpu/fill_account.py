"""Measured GEMM times next to what feeding the multiprocessors would take (rfcs/0005 decision 31).

The account: a block's bulk copies bring its multiprocessor about ``--gbps`` GB/s (80 by default,
what session 33's 64 x 128 tiles moved on every shape they were bound by), so a product takes at
least the busiest block's K steps times the stage's bytes (A and B tiles of one K step) over that
rate. The script reads tile sweeps (``gemm.py --config C`` output: ``== C`` then that tile's case
lines, as ``device_session.sh sweep`` and ``cluster`` write them) and prints, per case and tile,
the blocks, the measured time, the account's ("fill"), their ratio and cuBLAS's time from the same
line. A ratio near 1 says the tile was bound by what its multiprocessors take in; well above 1,
by something else (fixed costs, the tensor cores, an unhidden epilogue); below 1, the rate was
higher than the account's. B multicast (``mc``) tiles are counted like their ``tma`` twins: the
bytes reaching each multiprocessor are the same (what L2 sends for a pair is less: 32 KB a K step
instead of 48 for 64 x 128 tiles). No GPU needed::

    python benchmarks/gpu/fill_account.py benchmarks/results/h200-2026-11-28-95d3e9b-tile-sweep.txt \\
        [--cases gpt2_fc2_M1024] [--tiles tma64x128,ck128x128] [--gbps 80]
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_shardflow, table  # noqa: E402
from gemm import PROJECTIONS  # noqa: E402


def fill_us(tile: str, M: int, N: int, K: int, gbps: float) -> tuple[float, int]:
    """(the account's time in microseconds, blocks) of an ``M x N x K`` half product on ``tile``."""
    from shardflow.compiler.codegen import cuda_wgmma as W

    wg, BN, _, mode = W.WGMMA_CONFIGS[tile]
    BM, KT = W.tile_rows(tile), -(-K // 64)
    tiles = -(-M // BM) * -(-N // BN)
    stage = (BM + BN) * 64 * 2  # bytes of one K step's A and B tiles
    if mode == "sk":  # stream-K: every block the same number of K steps
        blocks = W.stream_k_blocks(tiles, KT)
        return tiles * KT / blocks * stage / gbps / 1e3, blocks
    parts = W.split_count(tiles, K) if mode == "tma" else W.CLUSTER_SIZE[mode] if mode.startswith("ck") else 1
    units = tiles * parts
    blocks = units if mode == "cp" else min(units, 128 if W.CLUSTER_SIZE.get(mode) == 4 else 132)
    steps = -(-units // blocks) * -(-KT // parts)
    return steps * stage / gbps / 1e3, blocks


def read(paths: list[str]) -> list[tuple[str, int, str, str, float, float]]:
    """(case, M, dtype, tile, our TFLOP/s, cuBLAS TFLOP/s) of every case line under a ``== tile``."""
    out, tile = [], None
    for path in paths:
        with open(path) as f:
            for ln in f:
                m = re.match(r"== (\S+)", ln)
                if m:
                    tile = m.group(1)
                    continue
                m = re.match(r"\s+(\S+)_M(\d+)_(float16|bfloat16)\s+ours\s+([\d.]+) TFLOP/s\s+cuBLAS\s+([\d.]+)", ln)
                if m and tile:
                    out.append((m.group(1), int(m.group(2)), m.group(3), tile, float(m.group(4)), float(m.group(5))))
    return out


def main(argv: list[str] | None = None) -> list[list]:
    """Print the table; return its rows."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--gbps", type=float, default=80.0, help="what a multiprocessor takes in, GB/s")
    ap.add_argument("--cases", help="comma-separated prefixes of the case names to show (e.g. gpt2_fc2_M1024)")
    ap.add_argument("--tiles", help="comma-separated tiles to show")
    args = ap.parse_args(argv)
    ensure_shardflow()
    from shardflow.compiler.codegen.cuda_wgmma import WGMMA_CONFIGS

    shapes = {f"{model}_{proj.replace('|', '_')}": (n, k) for model, proj, n, k in PROJECTIONS}
    cases = args.cases.split(",") if args.cases else None
    tiles = set(args.tiles.split(",")) if args.tiles else None
    rows = []
    for name, M, dt, tile, ours, cublas in read(args.sweeps):
        base = tile.split("@")[0]  # (sweep sections such as sk64x128@4: a variant of the tile)
        if name not in shapes or base not in WGMMA_CONFIGS or (tiles and tile not in tiles):
            continue
        if cases and not any(f"{name}_M{M}".startswith(c) for c in cases):
            continue
        N, K = shapes[name]
        flops = 2 * M * N * K
        fill, blocks = fill_us(base, M, N, K, args.gbps)
        t = flops / ours / 1e6
        rows.append([f"{name}_M{M}_{dt}", tile, blocks, round(t, 1), round(fill, 1), round(t / fill, 2),
                     round(flops / cublas / 1e6, 1)])
    rows.sort(key=lambda r: (r[0], r[3]))
    print(table(["case", "tile", "blocks", "us", f"fill@{args.gbps:g}", "us/fill", "cuBLAS us"], rows,
                align="<<>>>>>"))
    return rows


if __name__ == "__main__":
    main()
