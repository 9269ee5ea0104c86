"""Build ``libshardflow_native.so`` from the sources next to this file.

Standard library only: ``setup.py`` loads this file by path (before numpy or the package are
importable), and :func:`shardflow.runtime.native.build` wraps it. CMake is used when it is on
``PATH`` (or importable as the ``cmake`` wheel); otherwise the C++ compiler (``$CXX``, ``g++``,
``c++`` or ``clang++``) compiles the same sources with the same flags.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

LIBRARY_NAME = "libshardflow_native.so"
#: runtime/native/ (shardflow/runtime/native/ once installed): sources, header, CMakeLists.txt
NATIVE_DIR = Path(__file__).resolve().parent
SOURCES = ("src/runner.cpp",)
INCLUDE_DIR = NATIVE_DIR / "include"
CXX_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "-fPIC", "-shared", "-fvisibility=hidden",
             "-fvisibility-inlines-hidden")


class BuildError(RuntimeError):
    """The native library could not be built (no tool, or the tool failed)."""


def find_cmake() -> str | None:
    """``cmake`` on ``PATH``, else the one of the ``cmake`` wheel, else None."""
    found = shutil.which("cmake")
    if found:
        return found
    try:
        import cmake  # the PyPI wheel (a build requirement in pyproject.toml)
    except ImportError:
        return None
    path = Path(cmake.CMAKE_BIN_DIR) / "cmake"
    return str(path) if path.is_file() else None


def find_cxx() -> str | None:
    """``$CXX``, else the first of ``g++``, ``c++``, ``clang++`` on ``PATH``, else None."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(cmd: Sequence[str], log: Callable[[str], None] | None) -> None:
    if log:
        log(" ".join(cmd))
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).strip()
        raise BuildError(f"`{' '.join(cmd)}` failed with status {proc.returncode}:\n{out[-3000:]}")


def build(dest_dir: str | os.PathLike, *, source_dir: str | os.PathLike | None = None,
          work_dir: str | os.PathLike | None = None, use_cmake: bool | None = None,
          log: Callable[[str], None] | None = None) -> Path:
    """Build the library into ``dest_dir/libshardflow_native.so`` and return that path.

    The file is written under a temporary name and renamed, so a process that loads it never
    sees half a library. ``source_dir`` is the CMake source directory (default: this one; the
    repository root also works); ``work_dir`` keeps the CMake build tree (default: a temporary
    one). ``use_cmake``: True requires CMake, False skips it, None uses it when found. ``log``
    receives each command. Raises :class:`BuildError`.
    """
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    cmake = find_cmake() if use_cmake is not False else None
    if use_cmake and cmake is None:
        raise BuildError("cmake is not installed: install it (or `pip install cmake`), or build without it")
    cxx = find_cxx()
    if cmake is None and cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++ or clang++) and no cmake")
    with tempfile.TemporaryDirectory(prefix=".sf-native-", dir=dest) as tmp:
        built = None
        if cmake is not None:
            try:
                built = _cmake_build(cmake, Path(source_dir or NATIVE_DIR).resolve(),
                                     Path(work_dir) if work_dir is not None else Path(tmp) / "build",
                                     Path(tmp) / "out", log)
            except BuildError as exc:
                if use_cmake or cxx is None:
                    raise
                if log:
                    log(f"cmake failed; compiling with {cxx} directly ({str(exc).splitlines()[0]})")
        if built is None:
            built = Path(tmp) / LIBRARY_NAME
            _run([*cxx.split(), *CXX_FLAGS, "-I", str(INCLUDE_DIR), *(str(NATIVE_DIR / s) for s in SOURCES),
                  "-o", str(built)], log)
        staged = Path(tmp) / (LIBRARY_NAME + ".staged")
        shutil.copyfile(built, staged)
        os.replace(staged, dest / LIBRARY_NAME)
    return dest / LIBRARY_NAME


def _cmake_build(cmake: str, source: Path, build_dir: Path, out_dir: Path,
                 log: Callable[[str], None] | None) -> Path:
    cache = build_dir / "CMakeCache.txt"
    if cache.is_file() and f"CMAKE_HOME_DIRECTORY:INTERNAL={source}\n" not in cache.read_text():
        cache.unlink()  # a build tree of another source directory: configure afresh
    _run([cmake, "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
          f"-DSHARDFLOW_NATIVE_OUTPUT_DIR={out_dir}"], log)
    _run([cmake, "--build", str(build_dir), "--parallel"], log)
    built = out_dir / LIBRARY_NAME
    if not built.is_file():
        raise BuildError(f"cmake finished but wrote no {built}")
    return built
