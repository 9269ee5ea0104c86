"""A pytest plugin that runs the GPU tests on the host emulation, to check their logic where no GPU is
lent (a test tool): for the whole session :func:`host_cupy.use_host_cuda` is in force (the cuda compile
keeps each library's CUDA source; cupy is the numpy stand-in running it on ``cuda_host.py``'s emulation;
tensor maps are the emulation's).

    PYTHONPATH=tests python -m pytest -p host_gpu -m gpu tests/runtime/test_gpu_runtime.py -n 2
    PYTHONPATH=tests python -m pytest -p host_gpu -m gpu tests/codegen/test_cuda_kernels.py \\
        tests/codegen/test_attention.py tests/codegen/test_channels_last.py tests/codegen/test_tune.py

Ranks that ``shardflow run`` starts in processes of their own get the stand-in through
``host_site/sitecustomize.py`` (on their ``PYTHONPATH``); programmatic dependent launches are plain
ones (the driver's ``cuLaunchKernelEx`` is not emulated, the kernels' waits are). The wgmma tests of
``tests/codegen/test_wgmma.py`` run too but take long (GEMMs of 1024 rows and more, thread by thread).
Passing here says a GPU test's own logic holds and the emulation computes what it expects, not that
the GPU does: that takes ``pytest -m gpu`` on a GPU.
"""
from __future__ import annotations

import os

import pytest

_PATCH = pytest.MonkeyPatch()


def pytest_configure(config):
    """For the whole session (module-scoped fixtures build kernel libraries before any test runs)."""
    import tempfile

    from host_cupy import use_host_cuda

    work = tempfile.mkdtemp(prefix="sf-cuda-host-gpu-tests-")
    use_host_cuda(_PATCH, work)
    # (processes the tests start, the ranks of `shardflow run`, too: host_site/sitecustomize.py)
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_site")
    _PATCH.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    _PATCH.setenv("SHARDFLOW_TEST_HOST_CUDA", work)


def pytest_unconfigure(config):
    _PATCH.undo()
