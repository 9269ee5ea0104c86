"""The native part of the runtime: ``libshardflow_native.so``.

Sources: ``include/shardflow/runtime.h`` (the cpu kernel ABI, :data:`ABI_VERSION`, the exported
functions) and ``src/runner.cpp``, built by the top-level ``CMakeLists.txt``. ``pip install .``
and ``pip install -e .`` build it (``setup.py`` drives CMake) into ``shardflow/runtime/_native/``,
where :func:`load` finds it; ``$SHARDFLOW_NATIVE_LIB`` names another file.

Without a pip install (the repository on ``PYTHONPATH``), ``python -m shardflow.runtime.native``
builds it in place, and :func:`load` does the same on first use, with a warning, when the
library is missing and a C++ compiler is present.

The library exports (see the header):

``sf_native_abi_version()``
    the :data:`ABI_VERSION` it was built with; :func:`load` refuses any other.
``sf_run_steps(n, fns, ins, outs)``
    calls ``fns[i](ins[i], outs[i])`` for ``i < n``.
``sf_run_program(n, fns, ins, outs, collective, ctx)``
    runs a whole rank program: a kernel where ``fns[i]`` is set, else ``collective(ctx, i)``
    (a :data:`COLLECTIVE_FN`), stopping at the first collective that returns non-zero.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

from ..errors import ShardflowError
from ._build import INCLUDE_DIR, LIBRARY_NAME, BuildError, find_cmake, find_cxx
from ._build import build as _build

__all__ = ["ABI_VERSION", "COLLECTIVE_FN", "LIBRARY_ENV", "NativeLibraryError", "build", "default_library_path",
           "include_dir", "library_path", "load"]

log = logging.getLogger(__name__)

#: ``SHARDFLOW_NATIVE_ABI_VERSION`` of ``include/shardflow/runtime.h``: the library must match it.
ABI_VERSION = 1
#: Environment variable naming the library to load instead of the default one.
LIBRARY_ENV = "SHARDFLOW_NATIVE_LIB"
#: ``int (*)(void* ctx, int64_t step)``: the collective callback of ``sf_run_program``.
COLLECTIVE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)

_VP = ctypes.c_void_p
_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL] = {}


class NativeLibraryError(ShardflowError):
    """``libshardflow_native.so`` is missing, cannot be loaded, or was built for another ABI."""


def default_library_path() -> Path:
    """``shardflow/runtime/_native/libshardflow_native.so``, where the install puts the library."""
    return Path(__file__).resolve().parent.parent / "_native" / LIBRARY_NAME


def library_path() -> Path:
    """The library :func:`load` opens: ``$SHARDFLOW_NATIVE_LIB`` if set, else the default."""
    env = os.environ.get(LIBRARY_ENV)
    return Path(env) if env else default_library_path()


def include_dir() -> Path:
    """The directory to pass as ``-I`` for ``#include "shardflow/runtime.h"``."""
    return INCLUDE_DIR


def build(dest_dir: str | os.PathLike | None = None, *, use_cmake: bool | None = None) -> Path:
    """Build the library from the package's sources and return its path.

    Parameters
    ----------
    dest_dir
        Where to write ``libshardflow_native.so``; default: where :func:`default_library_path`
        expects it (inside the package).
    use_cmake
        True requires CMake, False compiles with the C++ compiler directly, None (default) uses
        CMake when it is installed.

    Raises
    ------
    NativeLibraryError
        No CMake and no C++ compiler, or the build failed (with the tool's output).
    """
    dest = Path(dest_dir) if dest_dir is not None else default_library_path().parent
    try:
        return _build(dest, use_cmake=use_cmake, log=lambda cmd: log.info("%s", cmd))
    except (BuildError, OSError) as exc:
        raise NativeLibraryError(f"cannot build {dest / LIBRARY_NAME}: {exc}") from None


def _missing(path: Path, why: str) -> NativeLibraryError:
    return NativeLibraryError(f"the native runtime library {str(path)!r} {why}; reinstall with `pip install -e .` "
                              "(or `pip install .`) in the shardflow checkout, or build it in place with "
                              "`python -m shardflow.runtime.native`")


def _build_on_first_use(path: Path) -> None:
    """Build the missing default library once, even when several processes start together."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():  # another process built it meanwhile
            return
        log.warning("the native runtime library %s is missing (not pip-installed?); building it now. "
                    "`pip install -e .` builds it at install time", path)
        build(path.parent)


def load(path: str | os.PathLike | None = None, *, build_if_missing: bool = True) -> ctypes.CDLL:
    """Open the native library (once per process and path) with its functions' ctypes signatures.

    Parameters
    ----------
    path
        The library file; default :func:`library_path`.
    build_if_missing
        When the default library is missing and a C++ compiler (or CMake) is installed, build it
        first (logs a warning). Never done for an explicit ``path`` or ``$SHARDFLOW_NATIVE_LIB``.

    Raises
    ------
    NativeLibraryError
        Naming the path: it is missing (and could not be built), cannot be opened, or reports
        another :data:`ABI_VERSION`.
    """
    explicit = path is not None or bool(os.environ.get(LIBRARY_ENV))
    p = Path(path) if path is not None else library_path()
    with _lock:
        lib = _loaded.get(p)
        if lib is not None:
            return lib
        if not p.is_file():
            if explicit or not build_if_missing or (find_cxx() is None and find_cmake() is None):
                raise _missing(p, "does not exist")
            try:
                _build_on_first_use(p)
            except (NativeLibraryError, OSError) as exc:
                raise _missing(p, f"does not exist and building it failed ({exc})") from None
        try:
            lib = ctypes.CDLL(str(p.resolve()), mode=getattr(os, "RTLD_LOCAL", 0))
            version = lib.sf_native_abi_version
        except (OSError, AttributeError) as exc:
            raise _missing(p, f"cannot be loaded ({exc})") from None
        version.argtypes, version.restype = (), ctypes.c_int
        if version() != ABI_VERSION:
            raise _missing(p, f"was built for native ABI {version()}, this runtime needs {ABI_VERSION}")
        lib.sf_run_steps.argtypes = (ctypes.c_int64, _VP, _VP, _VP)
        lib.sf_run_steps.restype = None
        lib.sf_run_program.argtypes = (ctypes.c_int64, _VP, _VP, _VP, COLLECTIVE_FN, _VP)
        lib.sf_run_program.restype = ctypes.c_int
        _loaded[p] = lib
        return lib
