"""A pytest plugin that runs the cuda runtime's GPU tests on the host emulation, to check their logic
where no GPU is lent (a test tool): every test gets :func:`host_cupy.use_host_cuda` (the compile keeps
each library's CUDA source, cupy is the numpy stand-in running it on ``cuda_host.py``'s emulation).

    PYTHONPATH=tests python -m pytest -p host_gpu -m gpu tests/runtime/test_gpu_runtime.py \\
        -k "not programmatic_dependent and not sharing_one_gpu"

Left out there: PDL launches (the driver's ``cuLaunchKernelEx``) and ranks in processes of their
own (``shardflow run`` under MPI or TCP, which do not load this plugin). The kernel tests of
``tests/codegen`` build and load cubins themselves; their kernels run on the emulation in
``tests/codegen/test_cuda_host.py`` instead. Passing here says a GPU test's own logic holds, not
that the GPU computes what the emulation does: that takes ``pytest -m gpu`` on a GPU.
"""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _host_cuda(monkeypatch, tmp_path_factory):
    from host_cupy import use_host_cuda

    use_host_cuda(monkeypatch, str(tmp_path_factory.getbasetemp() / "cuda-host-kernels"))
