"""Makes the helper modules in tests/ (op_examples, parallel/models) importable from every test,
and restores the `shardflow` logger after each test."""
import logging
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.join(HERE, "parallel")):
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(autouse=True)
def _shardflow_logging_restored():
    """A CLI command run in-process (``cli.main([...])``) installs its own handler on the
    ``shardflow`` logger and stops propagation, which would hide later tests' records from
    ``caplog``; put the logger back as it was after every test."""
    root = logging.getLogger("shardflow")
    state = (list(root.handlers), root.level, root.propagate)
    yield
    root.handlers[:], root.level, root.propagate = state
