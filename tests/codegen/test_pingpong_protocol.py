"""The ping-pong GEMM's hand-over between its two consumer warpgroups (RFC 0005 decision 20),
checked without a GPU on a model of its synchronization.

The model has the kernel's actors (the producer thread, two consumer warpgroups, the copy engine
completing loads in any order) and its primitives: mbarriers whose waits only see a phase's
parity (``mbarrier.try_wait.parity``), and named barriers (``bar.arrive``/``bar.sync``). Random
interleavings over random sizes must neither deadlock nor let a warpgroup read a stage before its
load landed; without the hand-over they do (a warpgroup waits on a stage barrier two phases
ahead and the parity wait passes early), which shows the model can fail. A first test pins the
model to the generated kernel: the statements it models are in the ping-pong source.
"""
from __future__ import annotations

import random

from shardflow.compiler.codegen.cuda import generate_cuda_source
from shardflow.compiler.ir import Tensor
from shardflow.compiler.ops.linalg import Gemm


def test_the_model_is_the_kernel():
    g = Gemm([Tensor("a", (4200, 328), "float16"), Tensor("b", (328, 1160), "float16")], name="g")
    src = generate_cuda_source([g], arch="sm_90", gemm_configs={"g": "pp64x256"}).text
    body = src[src.index('extern "C" __global__'):]
    for line in ("sf_mbar_init(sf_bars + (5 + (sf_s)) * 8, 128);",  # a stage is freed by one warpgroup
                 "for (int sf_u = blockIdx.x + sf_cw * gridDim.x; sf_u < 330; sf_u += 2 * gridDim.x, sf_pi += 2)",
                 "sf_g = sf_pi * 6;",  # its K tiles' place in the producer's sequence
                 "if (sf_pi > 0) sf_bar_sync(4 + ((sf_pi - 1) & 1), 256);",
                 "sf_mbar_wait(sf_bars + (sf_s) * 8, (sf_g / 5) & 1);",
                 "if (sf_kt > sf_kb) sf_mbar_arrive(sf_bars + (5 + ((sf_g - 1) % 5)) * 8);",
                 "if (sf_u + (int)gridDim.x < 330)",
                 "sf_bar_arrive(4 + (sf_pi & 1), 256);",
                 "sf_mbar_wait(sf_bars + (5 + (sf_s)) * 8, ((sf_g / 5) & 1) ^ 1);"):  # the producer
        assert line in body, line


def _run(units: int, grid: int, block: int, kt: int, stages: int, seed: int, hand_over: bool = True):
    """One random interleaving; returns (finished, errors)."""
    rng = random.Random(seed)
    mine = list(range(block, units, grid))  # the block's tiles, in the producer's order
    full = [0] * stages  # completed phases per stage barrier
    empty = [0] * stages
    tag = [None] * stages  # which K tile a stage holds
    inflight: list[tuple[int, int]] = []
    named = {4: [0, 0], 5: [0, 0]}  # barrier id -> [arrivals, syncs] (generations)
    errors: list[str] = []

    def passes(count: int, phase: int) -> bool:  # try_wait.parity(phase & 1) on `count` completed phases
        return (count & 1) != (phase & 1)

    def producer():
        for g in range(len(mine) * kt):
            s, k = g % stages, g // stages
            while k > 0 and not passes(empty[s], k - 1):  # (a fresh barrier passes the first wait)
                yield
            inflight.append((s, g))
            yield

    def consumer(w):
        for i in range(w, len(mine), 2):
            g = i * kt
            if hand_over and i > 0:
                gen = named[4 + ((i - 1) & 1)]
                gen[1] += 1
                while gen[0] < gen[1]:
                    yield
            for k_tile in range(kt):
                s, k = g % stages, g // stages
                while not passes(full[s], k):
                    yield
                if full[s] != k + 1 or tag[s] != g:
                    errors.append(f"warpgroup {w} used stage {s} for K tile {g}: it holds {tag[s]}")
                    return
                yield
                if k_tile > 0:
                    empty[(g - 1) % stages] += 1
                g += 1
            if hand_over and i + 1 < len(mine):
                named[4 + (i & 1)][0] += 1
            yield
            empty[(g - 1) % stages] += 1

    actors = [producer(), consumer(0), consumer(1)]
    alive = [True, True, True]
    for _ in range(200_000):
        if not (any(alive) or inflight):
            return True, errors
        pick = rng.choice([a for a in range(3) if alive[a]] + (["copy"] if inflight else []))
        if pick == "copy":  # loads complete in any order
            s, g = inflight.pop(rng.randrange(len(inflight)))
            tag[s] = g
            full[s] += 1
            continue
        try:
            next(actors[pick])
        except StopIteration:
            alive[pick] = False
        if errors:
            return True, errors
    return False, errors  # deadlock


def _random_runs(hand_over: bool, n: int = 600) -> list:
    bad = []
    for seed in range(n):
        r = random.Random(seed)
        grid = r.randint(1, 4)
        case = dict(units=r.randint(1, 12), grid=grid, block=r.randrange(grid), kt=r.randint(1, 14),
                    stages=r.randint(2, 8))
        finished, errors = _run(**case, seed=seed, hand_over=hand_over)
        if not finished or errors:
            bad.append((case, errors[:1] or ["deadlock"]))
    return bad


def test_the_hand_over_keeps_every_stage_read_in_order():
    assert _random_runs(hand_over=True) == []


def test_without_the_hand_over_a_stage_is_read_early():
    assert len(_random_runs(hand_over=False)) > 100
