"""Shardflow runtime: loads per-rank artifacts and runs them.

The runtime never imports the compiler; it owns the base of the error hierarchy so that
both halves raise the same :class:`ShardflowError`.
"""
from .errors import ShardflowError

__version__ = "0.1.0"

__all__ = ["ShardflowError", "__version__"]
