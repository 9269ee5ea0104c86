"""Fixtures of the codegen tests."""
import pytest


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory) -> str:
    """One kernel cache directory for the tests that build cpu libraries without testing the cache
    itself: its precompiled library header and micro-kernel tables (about 4 s to make) are built
    once per test process instead of once per test."""
    return str(tmp_path_factory.mktemp("kernel-cache"))
