"""A hand-written out_dir with real C kernels (no compiler involved), for runtime tests.

Every rank computes ``y = sum over ranks (x * w_r) + 1`` where ``w_r`` is its weight shard
(``w_r = r + 1 + arange/100``): kernel ``mul`` → an all-reduce per mesh axis → kernel
``add1``; then an all-gather of a per-rank slice along mesh axis 0 checks uneven chunks
(output ``g``).
"""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np

from shardflow.runtime.artifact import atomic_output_dir, finalize_rank_dir, write_json
from shardflow.runtime.comm.base import chunk_bounds

SHAPE = (4, 6)
N = 24
GATHER = 5  # rows of the all-gathered output (uneven over 2 or 4 ranks)

KERNELS = r"""
extern "C" void mul(const void* const* in, void* const* out) {
    const float* a = (const float*)in[0]; const float* b = (const float*)in[1]; float* y = (float*)out[0];
    for (int i = 0; i < 24; ++i) y[i] = a[i] * b[i];
}
extern "C" void add1(const void* const* in, void* const* out) {
    const float* a = (const float*)in[0]; float* y = (float*)out[0];
    for (int i = 0; i < 24; ++i) y[i] = a[i] + 1.0f;
}
extern "C" void rows(const void* const* in, void* const* out) {
    /* copy the first rows of c (4x6) into this rank's chunk: rows [lo, hi) of a 5x6 gather */
    const float* a = (const float*)in[0]; const int* lohi = (const int*)in[1]; float* y = (float*)out[0];
    for (int i = 0; i < (lohi[1] - lohi[0]) * 6; ++i) y[i] = a[(lohi[0] * 6 + i) % 24] * 2.0f;
}
"""


def weight(rank: int) -> np.ndarray:
    return (rank + 1 + np.arange(N, dtype=np.float32) / 100).reshape(SHAPE)


def expected(x: np.ndarray, world: int) -> dict[str, np.ndarray]:
    y = sum(x * weight(r) for r in range(world)) + 1
    flat = y.reshape(-1)
    g = np.stack([flat[(i * 6 + np.arange(6)) % 24] * 2 for i in range(GATHER)]).astype(np.float32)
    return {"y": y.astype(np.float32), "g": g}


def make_artifact(out_dir: str | Path, mesh_shape=(2,), build_dir: str | Path | None = None) -> Path:
    """Write the out_dir for ``mesh_shape``; returns its path."""
    mesh_shape = tuple(mesh_shape)
    world = math.prod(mesh_shape)
    out_dir = Path(out_dir)
    build_dir = Path(build_dir or out_dir.parent)
    src = build_dir / "handmade_kernels.cpp"
    lib = build_dir / "handmade_kernels.so"
    if not lib.exists():
        src.write_text(KERNELS)
        subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    ranks = np.arange(world).reshape(mesh_shape)
    groups = {}
    for a in range(len(mesh_shape)):
        moved = np.moveaxis(ranks, a, -1).reshape(-1, mesh_shape[a])
        groups[str(a)] = moved.tolist()
    with atomic_output_dir(out_dir) as tmp:
        write_json(tmp / "mesh.json", {"format": 1, "world_size": world, "groups": groups,
                                       "mesh": {"shape": list(mesh_shape), "rank_map": list(range(world))}})
        for r in range(world):
            coord = [int(c) for c in np.argwhere(ranks == r)[0]]
            n0 = mesh_shape[0]
            lo, hi = chunk_bounds(GATHER, n0, coord[0])
            d = tmp / f"rank{r}"
            d.mkdir()
            (d / "kernels.so").write_bytes(lib.read_bytes())
            w = weight(r)
            lohi = np.array([lo, hi], np.int32)
            blob = np.zeros(192, np.uint8)
            blob[:96] = w.reshape(-1).view(np.uint8)
            blob[128:136] = lohi.view(np.uint8)
            blob.tofile(d / "weights.bin")
            buffers = [
                {"name": "x", "shape": list(SHAPE), "dtype": "float32", "storage": "arena", "offset": 0},
                {"name": "w", "shape": list(SHAPE), "dtype": "float32", "storage": "weights", "offset": 0},
                {"name": "a", "shape": list(SHAPE), "dtype": "float32", "storage": "arena", "offset": 128},
            ]
            steps = [{"kind": "kernel", "node": "mul", "op_type": "Mul", "symbol": "mul", "inputs": [0, 1],
                      "outputs": [2]}]
            cur = 2
            for a in range(len(mesh_shape)):
                buffers.append({"name": f"ar{a}", "shape": list(SHAPE), "dtype": "float32", "storage": "arena",
                                "offset": 256 if a % 2 == 0 else 128})
                steps.append({"kind": "collective", "node": f"allreduce{a}", "collective": "all_reduce",
                              "mesh_axis": [a], "group": str(a),
                              "attrs": {"op": "sum", "group_size": mesh_shape[a]},
                              "inputs": [cur], "outputs": [len(buffers) - 1]})
                cur = len(buffers) - 1
            buffers.append({"name": "y", "shape": list(SHAPE), "dtype": "float32", "storage": "arena",
                            "offset": 384})
            y = len(buffers) - 1
            steps.append({"kind": "kernel", "node": "add1", "op_type": "Add", "symbol": "add1", "inputs": [cur],
                          "outputs": [y]})
            buffers.append({"name": "lohi", "shape": [2], "dtype": "int32", "storage": "weights", "offset": 128})
            buffers.append({"name": "piece", "shape": [hi - lo, 6], "dtype": "float32", "storage": "arena",
                            "offset": 512})
            steps.append({"kind": "kernel", "node": "rows", "op_type": "Rows", "symbol": "rows",
                          "inputs": [y, len(buffers) - 2], "outputs": [len(buffers) - 1]})
            buffers.append({"name": "g", "shape": [GATHER, 6], "dtype": "float32", "storage": "arena",
                            "offset": 640})
            steps.append({"kind": "collective", "node": "gather", "collective": "all_gather", "mesh_axis": [0],
                          "group": "0", "attrs": {"dim": 0, "global_size": GATHER, "group_size": n0,
                                                  "group_index": coord[0]},
                          "inputs": [len(buffers) - 2], "outputs": [len(buffers) - 1]})
            program = {"format": 1, "alignment": 64, "arena_bytes": 768, "weights_bytes": 192,
                       "weights_file": "weights.bin", "kernels_file": "kernels.so", "buffers": buffers,
                       "inputs": [["x", 0]], "outputs": [["y", y], ["g", len(buffers) - 1]], "steps": steps}
            write_json(d / "program.json", program)
            finalize_rank_dir(d, {
                "shardflow_version": "test", "target": "cpu", "arch": "x86_64", "rank": r, "world_size": world,
                "mesh": {"shape": list(mesh_shape), "coord": coord, "groups": groups}, "comm_backend": "auto",
                "inputs": [{"name": "x", "shape": list(SHAPE), "dtype": "float32", "placement": "R"}],
                "outputs": [{"name": "y", "shape": list(SHAPE), "dtype": "float32", "global_shape": list(SHAPE),
                             "placement": "R", "bounds": [[0, 4], [0, 6]]},
                            {"name": "g", "shape": [GATHER, 6], "dtype": "float32", "global_shape": [GATHER, 6],
                             "placement": "R", "bounds": [[0, GATHER], [0, 6]]}],
                "kernels": 3, "collectives": len(mesh_shape) + 1})
    return out_dir
