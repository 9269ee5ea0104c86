"""The operator library: one compute definition (and numpy implementation) per op.

``all_ops()`` lists every Operator subclass defined here (used by the op-agreement tests).
"""
import importlib
import pkgutil

from ..ir.graph import Operator

# Every module of this package defines ops (registered by subclassing Operator).
for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")


def all_ops() -> dict[str, type[Operator]]:
    """Every concrete operator class in the library, by op type."""
    res: dict[str, type[Operator]] = {}
    stack = list(Operator.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if not cls.__module__.startswith(__name__ + "."):
            continue  # ops defined elsewhere (the parallel package's communication ops, tests)
        if "compute" in {k for c in cls.__mro__ if c is not Operator for k in c.__dict__}:
            res[cls.op_type] = cls
    return dict(sorted(res.items()))
