"""ONNX frontend: the importer and one handler per ONNX op type."""
import importlib
import pkgutil

# Every handlers_* module registers its handlers with @onnx_op on import.
for _m in pkgutil.iter_modules(__path__):
    if _m.name.startswith("handlers_"):
        importlib.import_module(f"{__name__}.{_m.name}")
from .onnx_importer import import_onnx, read_model
from .registry import NodeContext, onnx_op, supported_ops

__all__ = ["import_onnx", "read_model", "onnx_op", "NodeContext", "supported_ops"]
