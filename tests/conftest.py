"""Makes the helper modules in tests/ (op_examples, parallel/models) importable from every test."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.join(HERE, "parallel")):
    if path not in sys.path:
        sys.path.insert(0, path)
