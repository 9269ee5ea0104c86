"""Shardflow runtime: loads per-rank artifacts and runs them.

The runtime never imports the compiler; it owns the base of the error hierarchy so that
both halves raise the same :class:`ShardflowError`. Cpu programs run through the native library
of :mod:`shardflow.runtime.native` (``libshardflow_native.so``, built when the package is
installed).
"""
from .errors import MemoryLimitError, ShardflowError

__version__ = "0.1.0"

from .artifact import ArtifactError, ChecksumError, VersionError  # noqa: E402
from .executor import (IndexRangeError, InputDtypeError, InputError, InputIndexError, InputNameError,  # noqa: E402
                       InputShapeError, RankProgram, WorldSizeError, load)
from .native import NativeLibraryError  # noqa: E402
from .variants import VariantProgram  # noqa: E402

__all__ = ["ShardflowError", "__version__", "load", "RankProgram", "VariantProgram", "ArtifactError",
           "ChecksumError", "VersionError", "InputError", "InputNameError", "InputShapeError", "InputDtypeError",
           "InputIndexError", "IndexRangeError", "WorldSizeError", "NativeLibraryError", "MemoryLimitError"]
