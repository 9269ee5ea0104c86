"""Imported at the start of every Python process that has this folder on ``PYTHONPATH`` (a test tool):
where ``SHARDFLOW_TEST_HOST_CUDA`` names a work folder, cupy is the host emulation's stand-in in that
process too (``tests/host_cupy.py``), so that ranks ``shardflow run`` starts in processes of their own
run their cuda programs on the host like the test that compiled them (``tests/host_gpu.py``)."""
import os
import sys

if os.environ.get("SHARDFLOW_TEST_HOST_CUDA"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _pytest.monkeypatch import MonkeyPatch
    from host_cupy import use_host_cuda

    use_host_cuda(MonkeyPatch(), os.environ["SHARDFLOW_TEST_HOST_CUDA"])
