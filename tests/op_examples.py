"""The op library's examples: every ``examples(rng)`` of every module of ``shardflow.compiler.ops``."""
import importlib
import pkgutil

import numpy as np

import shardflow.compiler.ops as ops_pkg


def op_examples():
    """``(module name, index, op class, input arrays, attrs)`` for every example, in a fixed order."""
    for m in pkgutil.iter_modules(ops_pkg.__path__):
        mod = importlib.import_module(f"{ops_pkg.__name__}.{m.name}")
        if hasattr(mod, "examples"):
            for k, (cls, arrays, attrs) in enumerate(mod.examples(np.random.default_rng(0))):
                yield m.name, k, cls, arrays, attrs
