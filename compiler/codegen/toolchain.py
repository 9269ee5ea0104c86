"""Toolchain driver for the cpu target: the system C++ compiler and the kernel cache.

The compiler is ``$CXX`` when set, else ``g++``. Libraries are built with::

    g++ -std=c++17 -O3 -fopenmp -fPIC -shared -march=x86-64-v2 -mtune=generic -mno-mmx
        -fno-math-errno -fno-trapping-math -fwrapv -fvisibility=hidden

``-march=x86-64-v2`` (SSE4.2, any x86-64 CPU since about 2009) keeps a library runnable on another
machine of the same architecture; kernels that do real work are additionally compiled for
x86-64-v3 (AVX2+FMA) and x86-64-v4 (AVX-512) with ``target_clones`` and the best version is picked
when the library is loaded. ``-fno-math-errno``/``-fno-trapping-math`` only drop errno and FP
exception flags (values stay IEEE exact, no ``-ffast-math``) so that loops with ``sqrt`` and selects
vectorize; ``-fwrapv`` gives integer overflow numpy's wrap-around.

The cache (``$SHARDFLOW_CACHE_DIR`` or ``~/.cache/shardflow/kernels``) keys a library by the sha256
of the source, the command line and ``<compiler> --version``; entries are written to a temporary
name and renamed, so a reader never sees half a file.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

from .cache import touch
from .lower import CodegenError

__all__ = ["CompileError", "ToolchainError", "cxx_compiler", "compiler_version", "compile_flags", "default_cache_dir",
           "default_jobs", "build_shared_library"]

log = logging.getLogger(__name__)


class ToolchainError(CodegenError):
    """No usable C++ compiler."""


class CompileError(CodegenError):
    """The C++ compiler rejected generated code; ``ops`` names the ops whose kernels failed."""

    def __init__(self, message: str, ops: Sequence[str] = ()):
        super().__init__(message)
        self.ops = list(ops)


def cxx_compiler() -> str:
    """The C++ compiler: ``$CXX`` or ``g++`` (must be on ``PATH``)."""
    cxx = os.environ.get("CXX") or "g++"
    exe = shutil.which(cxx.split()[0])
    if exe is None:
        raise ToolchainError(f"no C++ compiler: {cxx!r} is not on PATH; install g++ (>= 10) or set CXX")
    return cxx


@functools.lru_cache(maxsize=8)
def compiler_version(cxx: str) -> str:
    """``<cxx> --version`` output (part of the cache key)."""
    try:
        res = subprocess.run(cxx.split() + ["--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise ToolchainError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    return res.stdout.strip()


def compile_flags(opt_level: int = 2) -> list[str]:
    """Flags for a shared kernel library. ``opt_level``: 0 → ``-O0``, 1 → ``-O1`` (quick builds),
    2 or more → ``-O3``."""
    if opt_level not in (0, 1, 2, 3):
        raise CodegenError(f"opt_level must be 0, 1, 2 or 3, got {opt_level!r}")
    flags = ["-std=c++17", f"-O{3 if opt_level >= 2 else opt_level}", "-fopenmp", "-fPIC", "-shared"]
    if platform.machine() in ("x86_64", "AMD64"):
        # no MMX registers: GCC 12 spills 64-bit values through them in some unrolled reduction tails
        # (a max over 17 or 67 values) and emits no emms, which leaves the thread's x87 stack full: every
        # later x87 computation in the process is NaN (numpy's FFT, glibc's fmod); rfcs/0002 "No MMX"
        flags += ["-march=x86-64-v2", "-mtune=generic", "-mno-mmx"]
    flags += ["-fno-math-errno", "-fno-trapping-math", "-fwrapv", "-fvisibility=hidden", "-w"]
    return flags


def default_cache_dir() -> str:
    """``$SHARDFLOW_CACHE_DIR`` or ``~/.cache/shardflow/kernels``."""
    env = os.environ.get("SHARDFLOW_CACHE_DIR")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "shardflow", "kernels")


def _atomic_copy(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` through a temporary name in ``dst``'s folder and a rename (a library or
    an object, into the cache or out of it: no reader sees half a file)."""
    d = os.path.dirname(os.path.abspath(dst)) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(dst)[1], dir=d)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _blame(stderr: str, src_name: str, line_map: dict | None) -> list[str]:
    """Op names whose kernels contain the lines the compiler complains about."""
    if not line_map:
        return []
    ops: list[str] = []
    for m in re.finditer(re.escape(src_name) + r":(\d+):\d+: (?:fatal )?error", stderr):
        ln = int(m.group(1))
        for first, last, names in line_map.values():
            if first <= ln <= last:
                for n in names:
                    if n not in ops:
                        ops.append(n)
    return ops


def default_jobs() -> int:
    """Parallel compiler processes: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def _run_compilers(cmds: list[list[str]], jobs: int) -> list[subprocess.CompletedProcess]:
    """Run compiler commands, at most ``jobs`` at a time; results in order."""
    results: list = [None] * len(cmds)
    running: list[tuple[int, subprocess.Popen]] = []
    pending = list(range(len(cmds)))
    try:
        while pending or running:
            while pending and len(running) < jobs:
                i = pending.pop(0)
                running.append((i, subprocess.Popen(cmds[i], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                    text=True)))
            i, p = running.pop(0)
            out, err = p.communicate()
            results[i] = subprocess.CompletedProcess(cmds[i], p.returncode, out, err)
    except OSError as e:
        raise ToolchainError(f"cannot run the C++ compiler {cmds[0][0]!r}: {e}") from e
    finally:
        for _, p in running:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _compile_error(failures: list[tuple[str, str, dict]]) -> CompileError:
    ops: list[str] = []
    heads = []
    for err, name, lmap in failures:
        for o in _blame(err, name, lmap):
            if o not in ops:
                ops.append(o)
        heads.append("\n".join(err.strip().splitlines()[:25]))
    who = (f" for op(s) {', '.join(ops[:10])}" + (f" (+{len(ops) - 10} more)" if len(ops) > 10 else "")) if ops else ""
    return CompileError(f"the C++ compiler failed{who}; generated code that does not compile is a Shardflow bug, "
                        f"please report it with this message:\n" + "\n".join(heads), ops)


def build_shared_library(source: str, path: str, *, cache_dir: str | None = None, opt_level: int = 2,
                         line_map: dict | None = None, units: Sequence[tuple[str, dict]] | None = None,
                         jobs: int | None = None, extra_flags: Sequence[str] = (),
                         prebuilt: Mapping[str, str] | None = None, header: str | None = None,
                         prebuilt_needs: Mapping[str, Sequence[str]] | None = None) -> bool:
    """Compile ``source`` into the shared library ``path``, through the cache.

    A build holds a lock on its entry (``<cache>/locks/<key>``; the header's and the prebuilt objects'
    too) while it compiles: another process building the same entry waits and takes it from the cache.

    Parameters
    ----------
    source
        The complete C++ translation unit (and the cache key's text).
    path
        Where the library is written (atomically: temporary file + rename).
    cache_dir
        The kernel cache (default :func:`default_cache_dir`).
    opt_level
        See :func:`compile_flags`.
    line_map
        ``{symbol: (first_line, last_line, op_names)}`` of ``source``, to name the ops in errors.
    units
        The same code cut into several translation units ``[(text, line_map), ...]``; they are
        compiled in parallel (``jobs`` processes, default: the usable CPUs) and linked. The cache
        key stays the one of ``source``.
    extra_flags
        Appended to the command line (and the cache key).
    prebuilt
        ``{symbol: translation unit}``: code that many libraries share, each unit compiled once into
        an object of its own (cached beside the libraries, keyed like them) and linked into the
        libraries whose units, or whose other prebuilt objects, refer to its symbol; the units are
        compiled with ``-DSF_PREBUILT_TABLES``. The cpu kernel library puts there what every library
        would otherwise compile again: its micro-kernel tables, the drivers its kernels call (GEMMs,
        convs, attention) and its scratch memory (``templates_cpu.prebuilt_tables``). They are
        compiled at ``-O3`` whatever ``opt_level`` is (one object for every library of the cache).
    prebuilt_needs
        ``{symbol: [symbols]}``: prebuilt units known to refer to others (a conv driver to its tables),
        which are then compiled with them, side by side, instead of after them (found in their objects;
        one not named here is still found there).
    header
        A prefix of ``source`` and of every unit (the cpu library's helpers and templates: most of
        the text, and of a small library's compile time, is parsing it). It is compiled once per
        cache into a precompiled header (``<key>.h.gch`` beside the libraries, keyed like them) that
        every unit includes in its place (``-include``; a ``#line`` keeps the units' line numbers).
        If the compiler cannot build it, the units are compiled whole.

    Returns
    -------
    bool
        True when the library came from the cache.

    Raises
    ------
    CompileError
        the compiler failed; the message names the ops and shows the head of its output.
    ToolchainError
        no compiler.
    """
    cxx = cxx_compiler()
    flags = compile_flags(opt_level) + list(extra_flags)
    version = compiler_version(cxx)
    prebuilt = dict(prebuilt or {})
    object_command, pkeys = _prebuilt_keys(prebuilt, cxx, opt_level, extra_flags, version)
    if prebuilt:
        flags.append("-DSF_PREBUILT_TABLES")
    key = hashlib.sha256("\0".join([source, " ".join([cxx] + flags), version] + sorted(pkeys.values())).encode()
                         ).hexdigest()
    cache_dir = cache_dir or default_cache_dir()
    os.makedirs(cache_dir, exist_ok=True)
    cached = os.path.join(cache_dir, f"{key}.so")
    jobs = jobs or default_jobs()

    def make() -> bool:  # (a miss: compile, link and cache; False)
        all_units = list(units) if units and len(units) > 1 else [(source, line_map or {})]
        unit_flags = [f for f in flags if f != "-shared"]
        with tempfile.TemporaryDirectory(prefix="sf-build-") as tmp:
            out = os.path.join(tmp, "lib.so")
            t0 = time.perf_counter()
            include = None
            if header and all(text.startswith(header) for text, _ in all_units):
                include = _precompiled_header(header, cxx.split() + unit_flags, version, cache_dir, tmp)
            first_line = "#line %d\n" % (header.count("\n") + 1) if include else ""
            names, cmds = [], []
            for i, (text, _) in enumerate(all_units):
                src = os.path.join(tmp, f"kernels_{key[:12]}_{i}.cpp")
                with open(src, "w") as f:
                    f.write(first_line + text[len(header):] if include else text)
                names.append(os.path.basename(src))
                cmds.append(cxx.split() + unit_flags + (["-include", include] if include else [])
                            + ["-c", src, "-o", src[:-4] + ".o"])
            log.info("compiling %d lines of C++ in %d unit(s): %s", source.count("\n"), len(all_units),
                     " ".join(cmds[0]))
            results = _run_compilers(cmds, jobs)
            failures = [(r.stderr or r.stdout, n, lm) for r, n, (_, lm) in zip(results, names, all_units)
                        if r.returncode != 0]
            if failures:
                raise _compile_error(failures)
            objects = [c[-1] for c in cmds]
            objects += _prebuilt_objects(prebuilt, pkeys, objects, object_command, cache_dir, tmp, jobs,
                                         prebuilt_needs or {})
            # (a symbol no object defines fails here, not when a rank loads the library: GNU ld's -z defs)
            no_undefined = ["-Wl,--no-undefined"] if sys.platform.startswith("linux") else []
            link = _run_compilers([cxx.split() + ["-shared", "-fopenmp"] + no_undefined + objects + ["-o", out]],
                                  1)[0]
            if link.returncode != 0:
                raise _compile_error([(link.stderr or link.stdout, "", {})])
            log.info("compiled in %.1f s", time.perf_counter() - t0)
            _atomic_copy(out, cached)
            _atomic_copy(out, path)
        return False
    return _once(cache_dir, key, lambda: _from_cache(cached, path), make)


def _prebuilt_keys(prebuilt: Mapping[str, str], cxx: str, opt_level: int, extra_flags: Sequence[str],
                   version: str) -> tuple[list[str], dict[str, str]]:
    """The compiler command of the ``prebuilt`` units (without the unit and its output) and their objects'
    cache keys. The objects are -O3 whatever the library's level: shared by every library of the cache,
    they are compiled once for all (an -O0 or -O1 library, the tests' quick builds, links the optimized
    drivers)."""
    flags = [f for f in compile_flags(max(opt_level, 2)) + list(extra_flags) if f != "-shared"] + ["-c"]
    command = " ".join([cxx] + flags)
    return cxx.split() + flags, {sym: _object_key(text, command, version) for sym, text in prebuilt.items()}


@functools.lru_cache(maxsize=256)
def _object_key(text: str, command: str, version: str) -> str:
    """The cache key of a prebuilt object (memoized: its units are the same strings for every library, about
    10 MB in all, whose hashing took 10 ms of each build)."""
    return hashlib.sha256("\0".join([text, command, version]).encode()).hexdigest()


def _once(cache_dir: str, key: str, look, make):
    """``look()`` if it finds the cache entry ``key``, else ``make()`` under the entry's build lock
    (:func:`_building`), unless ``look()`` finds it once the lock is held (made by another process
    while this one waited)."""
    found = look()
    if found:
        return found
    with _building(cache_dir, key):
        return look() or make()


def _from_cache(cached: str, path: str) -> bool:
    """Copy the library ``cached`` (in the cache) to ``path`` if it is there; whether it was."""
    if not os.path.exists(cached):
        return False
    try:
        _atomic_copy(cached, path)
    except FileNotFoundError:  # (taken out of the cache meanwhile: `shardflow cache prune`)
        log.info("kernel cache entry %s went away while read; compiling it again", cached)
        return False
    log.info("kernel cache hit %s", cached)
    touch(cached)
    return True


@contextlib.contextmanager
def _building(cache_dir: str, key: str):
    """Hold the build lock of the cache entry ``key`` (``<cache>/locks/<key>``): processes building the
    same entry (ranks compiled side by side, test workers) wait for the first and
    then take its result from the cache instead of compiling it again. A process that dies releases its
    locks. Where there are none (no ``fcntl``, a read-only cache) it builds without. The files are removed
    as the locks are released (a process already waiting on one then holds the removed file's lock, and
    one arriving later a new file's: at worst both compile, each writing the entry by a rename), so
    ``locks/`` holds the builds in progress only."""
    f = None
    try:
        import fcntl

        os.makedirs(os.path.join(cache_dir, "locks"), exist_ok=True)
        f = open(os.path.join(cache_dir, "locks", key), "a")
        fcntl.flock(f, fcntl.LOCK_EX)
    except (ImportError, OSError) as e:
        log.debug("building without the cache's locks: %s", e)
        if f is not None:
            f.close()
            f = None
    try:
        yield
    finally:
        if f is not None:  # (closing releases the lock)
            with contextlib.suppress(OSError):
                os.unlink(f.name)
            f.close()


def _precompiled_header(header: str, command: list[str], version: str, cache_dir: str, tmp: str) -> str | None:
    """The path to ``-include`` for ``header``: ``<key>.h`` in the cache with its precompiled
    ``<key>.h.gch`` beside it (built with ``command``, the units' compiler and flags, if not cached
    yet). None when the compiler fails to build it (the units then compile the header's text)."""
    hkey = hashlib.sha256("\0".join([header, " ".join(command), version]).encode()).hexdigest()
    path = os.path.join(cache_dir, f"{hkey}.h")

    def look() -> str | None:
        if os.path.exists(path + ".gch") and os.path.exists(path):
            touch(path)
            touch(path + ".gch")
            return path
        return None

    def make() -> str | None:
        src = os.path.join(tmp, "header.h")
        with open(src, "w") as f:
            f.write(header)
        t0 = time.perf_counter()
        res = _run_compilers([command + ["-x", "c++-header", src, "-o", src + ".gch"]], 1)[0]
        if res.returncode != 0:
            log.warning("could not precompile the kernel library's header (compiling it in every unit): %s",
                        "\n".join((res.stderr or res.stdout).strip().splitlines()[:10]))
            return None
        _atomic_copy(src, path)
        _atomic_copy(src + ".gch", path + ".gch")
        log.info("precompiled the kernel library's header in %.1f s (cached for the next libraries)",
                 time.perf_counter() - t0)
        return path
    return _once(cache_dir, hkey, look, make)


def _referenced_symbols(objects: Sequence[str], symbols) -> list[str]:
    """Those of ``symbols`` whose names the object files ``objects`` hold (as names of symbols they
    define or refer to)."""
    data = b"".join(open(o, "rb").read() for o in objects)
    return [sym for sym in symbols if sym.encode() + b"\0" in data]  # (name strings)


def _prebuilt_objects(prebuilt: Mapping[str, str], pkeys: Mapping[str, str], objects: Sequence[str],
                      command: list[str], cache_dir: str, tmp: str, jobs: int,
                      needs: Mapping[str, Sequence[str]]) -> list[str]:
    """The objects of the ``prebuilt`` units (``{symbol: text}``) whose symbol the compiled
    ``objects`` refer to, or the objects so taken refer to (a driver's unit takes the micro-kernel
    tables from theirs; those named in ``needs`` are taken with it): from the cache, or compiled (in
    parallel) and cached."""
    found: dict[str, str] = {}
    scan = list(objects)
    while scan:
        wanted = _referenced_symbols(scan, [sym for sym in prebuilt if sym not in found])
        for sym in wanted:  # (the needs of the needs too: appended as the loop goes)
            wanted += [n for n in needs.get(sym, ()) if n not in found and n not in wanted]
        # (the units others need first: the micro-kernel tables and their parts, 4-9 s of g++ each, before the
        # drivers, 1-3 s, so that no long unit starts last while the other processes idle)
        needed = {n for sym in wanted for n in needs.get(sym, ())}
        wanted.sort(key=lambda sym: sym not in needed)
        new = _cached_or_compiled(wanted, prebuilt, pkeys, command, cache_dir, tmp, jobs)
        found.update(new)
        scan = list(new.values())
    return list(found.values())


def _cached_or_compiled(wanted: Sequence[str], prebuilt: Mapping[str, str], pkeys: Mapping[str, str],
                        command: list[str], cache_dir: str, tmp: str, jobs: int) -> dict[str, str]:
    """``{symbol: object}`` of the prebuilt units ``wanted``: from the cache, or compiled (``jobs`` at
    a time) and cached, each under its own build lock, held while that unit compiles only (a unit that
    takes a second does not wait for the packed conv's table, 40 s, of another process)."""
    compiled: list[str] = []
    failures: list[tuple] = []  # (the compiler's output, the unit's name, {})

    def look(sym) -> str | None:
        path = os.path.join(cache_dir, f"{pkeys[sym]}.o")
        if not os.path.exists(path):
            return None
        touch(path)
        return path

    def make(sym) -> str | None:
        src = os.path.join(tmp, f"prebuilt_{sym}.cpp")
        with open(src, "w") as f:
            f.write(prebuilt[sym])
        res = _run_compilers([command + [src, "-o", src[:-4] + ".o"]], 1)[0]
        if res.returncode != 0:
            failures.append((res.stderr or res.stdout, f"the prebuilt {sym}", {}))
            return None
        _atomic_copy(src[:-4] + ".o", os.path.join(cache_dir, f"{pkeys[sym]}.o"))
        compiled.append(sym)
        return src[:-4] + ".o"
    found = {sym: path for sym, path in ((sym, look(sym)) for sym in wanted) if path}
    missing = [sym for sym in wanted if sym not in found]
    if not missing:
        return found
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(jobs, len(missing)))) as pool:
        found.update(zip(missing, pool.map(lambda s: _once(cache_dir, pkeys[s], lambda: look(s), lambda: make(s)),
                                           missing)))
    if failures:
        raise _compile_error(failures)
    if compiled:
        log.info("compiled the shared object(s) of %s in %.1f s (cached for the next libraries)", ", ".join(compiled),
                 time.perf_counter() - t0)
    return found
