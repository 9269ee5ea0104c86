"""The kernel cache on disk: what it holds, and taking entries out of it (``shardflow cache``).

Every compile keeps what it built in the cache (``$SHARDFLOW_CACHE_DIR``, default
``~/.cache/shardflow/kernels``; :func:`.toolchain.default_cache_dir`), keyed by the sha256 of the
source, the compiler and its flags, and nothing ever takes an entry out: a test run of this
repository leaves about a gigabyte. An entry is one of

* ``<key>.so`` — a cpu kernel library (``toolchain.build_shared_library``);
* ``<key>.o`` — the object of code many cpu libraries share (the micro-kernel tables, the GEMM, conv and
  attention drivers, the scratch memory);
* ``<key>.h`` with ``<key>.h.gch`` — the cpu library's header, precompiled (one entry: both or none);
* ``<k2>/<key>.cubin`` — a cuda library (``cuda.compile_cuda_sources``; ``k2`` = the key's first two
  characters);
* ``tune/<k2>/<key>.json`` — a GEMM tile chosen by timing (``tune.tune_gemms``, ``search_space = 2``);
* ``.tmp-*`` — the temporary of a write that was interrupted (a write renames it when done);
* ``locks/<key>`` — an empty file a build holds locked while it makes ``<key>``'s entry (``toolchain``:
  another process building the same entry waits for it), removed when it is done; not an entry, and
  left alone.

A hit refreshes the entry's modification time (:func:`touch`), so that time says when an entry was
last used. :func:`prune_cache` removes the least recently used entries until the cache fits a size;
it never removes an entry used in the last ``keep_recent_s`` seconds (a compile running beside it may
be about to read it), nor a temporary younger than an hour (a write in progress). A compile whose hit
loses the race with a removal compiles the entry again (the libraries' and cubins' reads handle the
file vanishing); the precompiled header and the shared objects are read by the compiler, so clearing
the cache while a cpu compile runs can make that compile fail: clear it between compiles.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from .lower import CodegenError

__all__ = ["CacheEntry", "cache_entries", "cache_summary", "clear_cache", "prune_cache", "touch", "parse_size",
           "KINDS"]

#: entry kinds, in the order summaries print them
KINDS = ("cpu library", "cpu shared object", "cpu header", "cuda library", "tuning choice", "unfinished write")

_KEY = r"[0-9a-f]{64}"
_TMP_MIN_AGE_S = 3600.0


@dataclass
class CacheEntry:
    """One cache entry: its ``kind`` (one of :data:`KINDS`), its files (removed in this order), their
    bytes and the latest modification time among them (the last use)."""
    kind: str
    paths: list[str] = field(default_factory=list)
    size: int = 0
    last_used: float = 0.0


def touch(path: str) -> None:
    """Mark a cache entry's file used now (a cache hit); a read-only cache is left as it is."""
    try:
        os.utime(path, None)
    except OSError:
        pass


def _stat(paths: list[str]) -> tuple[int, float] | None:
    size, last = 0, 0.0
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return None
        size += st.st_size
        last = max(last, st.st_mtime)
    return size, last


def cache_entries(cache_dir: str) -> tuple[list[CacheEntry], list[str]]:
    """``(entries, others)``: the entries found in ``cache_dir`` and the paths of files there that are
    not cache entries (left alone by :func:`clear_cache` and :func:`prune_cache`). A missing folder
    is an empty cache."""
    entries: list[CacheEntry] = []
    others: list[str] = []
    if not os.path.isdir(cache_dir):
        return entries, others

    def add(kind: str, paths: list[str]):
        st = _stat(paths)
        if st is not None:  # (removed meanwhile)
            entries.append(CacheEntry(kind, paths, *st))

    for name in sorted(os.listdir(cache_dir)):
        path = os.path.join(cache_dir, name)
        if os.path.isdir(path):
            if re.fullmatch(r"[0-9a-f]{2}", name):
                for sub in sorted(os.listdir(path)):
                    p = os.path.join(path, sub)
                    if re.fullmatch(_KEY + r"\.cubin", sub) and sub.startswith(name):
                        add("cuda library", [p])
                    elif sub.startswith(".tmp-"):
                        add("unfinished write", [p])
                    else:
                        others.append(p)
            elif name == "locks":  # (the builds' lock files: toolchain._building)
                pass
            elif name == "tune":
                for root, _, files in os.walk(path):
                    for f in sorted(files):
                        p = os.path.join(root, f)
                        if re.fullmatch(_KEY + r"\.json", f):
                            add("tuning choice", [p])
                        elif f.startswith(".tmp-"):
                            add("unfinished write", [p])
                        else:
                            others.append(p)
            else:
                others.append(path)
            continue
        if re.fullmatch(_KEY + r"\.so", name):
            add("cpu library", [path])
        elif re.fullmatch(_KEY + r"\.o", name):
            add("cpu shared object", [path])
        elif re.fullmatch(_KEY + r"\.h", name):
            gch = path + ".gch"
            add("cpu header", [gch, path] if os.path.exists(gch) else [path])  # (the .gch first: a hit needs both)
        elif re.fullmatch(_KEY + r"\.h\.gch", name):
            if not os.path.exists(path[:-4]):  # (a header whose .h went: an entry of its own)
                add("cpu header", [path])
        elif name.startswith(".tmp-"):
            add("unfinished write", [path])
        else:
            others.append(path)
    return entries, others


def cache_summary(cache_dir: str) -> dict:
    """``{"dir", "bytes", "entries": {kind: {"count", "bytes"}}, "others"}`` of ``cache_dir``."""
    entries, others = cache_entries(cache_dir)
    kinds = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for e in entries:
        kinds[e.kind]["count"] += 1
        kinds[e.kind]["bytes"] += e.size
    return {"dir": os.path.abspath(cache_dir), "bytes": sum(e.size for e in entries), "entries": kinds,
            "others": others}


def _remove(entry: CacheEntry) -> int:
    """Remove ``entry``'s files; the bytes freed (a file already gone counts nothing)."""
    freed = 0
    for p in entry.paths:
        try:
            size = os.stat(p).st_size
            os.unlink(p)
            freed += size
        except FileNotFoundError:
            pass
    return freed


def _removable(entry: CacheEntry, now: float, keep_recent_s: float) -> bool:
    age = now - entry.last_used
    return age >= (_TMP_MIN_AGE_S if entry.kind == "unfinished write" else keep_recent_s)


def clear_cache(cache_dir: str, keep_recent_s: float = 0.0) -> tuple[int, int]:
    """Remove every entry of ``cache_dir`` not used in the last ``keep_recent_s`` seconds (temporaries
    of writes younger than an hour excepted); ``(entries, bytes)`` removed. Files that are not cache
    entries stay."""
    entries, _ = cache_entries(cache_dir)
    now = time.time()
    done = [e for e in entries if _removable(e, now, keep_recent_s)]
    return len(done), sum(_remove(e) for e in done)


def prune_cache(cache_dir: str, max_bytes: int, keep_recent_s: float = 60.0) -> tuple[int, int]:
    """Remove the least recently used entries of ``cache_dir`` until its entries take at most
    ``max_bytes``, never one used in the last ``keep_recent_s`` seconds (so the cache may stay above
    the size); temporaries of writes left unfinished for an hour go whatever the size. ``(entries,
    bytes)`` removed."""
    if max_bytes < 0:
        raise CodegenError(f"the cache's size limit must be at least 0 bytes, got {max_bytes}")
    entries, _ = cache_entries(cache_dir)
    now = time.time()
    total = sum(e.size for e in entries)
    order = sorted(entries, key=lambda e: (e.kind != "unfinished write", e.last_used))
    count = freed = 0
    for e in order:
        stale_tmp = e.kind == "unfinished write" and _removable(e, now, keep_recent_s)
        if total - freed <= max_bytes and not stale_tmp:
            continue
        if not _removable(e, now, keep_recent_s):
            continue
        freed += _remove(e)
        count += 1
    return count, freed


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"500M"``, ``"2G"``, ``"1.5GiB"``, ``"100000"`` as bytes (binary units: K = 1024)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise CodegenError(f"cannot read {text!r} as a size: write a number of bytes with an optional unit "
                           "K, M, G or T (500M, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
