"""Fixtures of the codegen tests."""
import pytest


@pytest.fixture(scope="session")
def kernel_cache() -> str:
    """The kernel cache of the tests that build cpu libraries without testing the cache itself: the
    default one (``$SHARDFLOW_CACHE_DIR`` or ``~/.cache/shardflow/kernels``), as ``compile`` uses, so
    that its precompiled library header and prebuilt objects (the micro-kernel tables, the drivers:
    a conv's tables take about a minute at ``-O1``) are built once for the test processes and the
    runs, not once per process (the build locks make the second process wait for the first)."""
    from shardflow.compiler.codegen.toolchain import default_cache_dir

    return default_cache_dir()
