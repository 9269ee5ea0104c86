"""Makes the runtime test helpers (callback_kernels, handmade) importable from the driver tests."""
import os
import sys

RUNTIME_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime")
if RUNTIME_TESTS not in sys.path:
    sys.path.insert(0, RUNTIME_TESTS)
