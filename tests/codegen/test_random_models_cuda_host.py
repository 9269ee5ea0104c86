"""Random models (tests/random_models.py) compiled for the cuda target and run end to end without a GPU:
each program through the runtime's cuda engine, its kernels on the host emulation of CUDA
(tests/host_cupy.py), against onnxruntime; on one rank at every precision (float32, bfloat16,
float16), and under a random sharding plan on two ranks and on a 2x2 mesh (threads with in-process
communicators, each capturing its own graphs). As test_random_models_cpu.py does for the cpu target
(whose comparison and plans these reuse): ``-m slow``, ``SHARDFLOW_RANDOM_SEEDS=A:B`` for other seeds."""
from __future__ import annotations

import shutil

import pytest
from host_cupy import use_host_cuda
from random_models import GENERATORS
from test_random_models_cpu import SEEDS, run_random_model, run_random_plan

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")]


@pytest.fixture
def host(monkeypatch, tmp_path_factory):
    use_host_cuda(monkeypatch, str(tmp_path_factory.getbasetemp() / "cuda-host-kernels"))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_model_on_the_cuda_target(tmp_path, host, kind, seed):
    run_random_model(tmp_path, kind, seed, "cuda", runs=2)  # (eager, then from the captured graph)


@pytest.mark.parametrize("mesh", [[2], [2, 2]], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_plan_on_cuda_ranks(tmp_path, host, kind, seed, mesh):
    run_random_plan(tmp_path, kind, seed, mesh, {"target": "cuda"})
