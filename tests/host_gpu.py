"""A pytest plugin that runs the cuda runtime's GPU tests on the host emulation, to check their logic
where no GPU is lent (a test tool): every test gets :func:`host_cupy.use_host_cuda` (the compile keeps
each library's CUDA source, cupy is the numpy stand-in running it on ``cuda_host.py``'s emulation).

    PYTHONPATH=tests python -m pytest -p host_gpu -m gpu tests/runtime/test_gpu_runtime.py -n 2

Ranks that ``shardflow run`` starts in processes of their own get the stand-in through
``host_site/sitecustomize.py`` (on their ``PYTHONPATH``); programmatic dependent launches are plain
ones there (the driver's ``cuLaunchKernelEx`` is not emulated, the kernels' waits are). The kernel tests of
``tests/codegen`` build and load cubins themselves; their kernels run on the emulation in
``tests/codegen/test_cuda_host.py`` instead. Passing here says a GPU test's own logic holds, not
that the GPU computes what the emulation does: that takes ``pytest -m gpu`` on a GPU.
"""
from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _host_cuda(monkeypatch, tmp_path_factory):
    from host_cupy import use_host_cuda

    work = str(tmp_path_factory.getbasetemp() / "cuda-host-kernels")
    use_host_cuda(monkeypatch, work)
    # (processes the test starts, the ranks of `shardflow run`, too: host_site/sitecustomize.py)
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SHARDFLOW_TEST_HOST_CUDA", work)
