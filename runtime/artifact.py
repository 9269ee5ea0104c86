"""The per-rank artifact format: write, read, verify.

An out_dir holds::

    out_dir/
      plan.json, plan.txt         the sharding plan (ShardingPlan.save)
      mesh.json                   the device mesh and its process groups per mesh-axis set
      rank{r}/
        manifest.json             versions, target, rank, world size, mesh coordinate, inputs and
                                  outputs (names, shapes, dtypes, placements), sha256 of every file
        program.json              buffers (arena offsets or weight offsets) and the ordered steps
        kernels.so                the compiled kernels (cpu)
        weights.bin               the rank's weight shard (each tensor 64-byte aligned)

The format is described in ``rfcs/0003-artifacts-and-runtime.md``. This module depends only on
the standard library and numpy; the compiler's driver uses its writers, the runtime its readers.
"""
from __future__ import annotations

import ctypes
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .errors import ShardflowError

__all__ = ["buffer_dtype", "ARTIFACT_FORMAT", "ALIGNMENT", "ArtifactError", "ChecksumError", "VersionError",
           "sha256_file", "write_json", "read_json", "finalize_rank_dir", "read_manifest", "verify_files",
           "read_weights", "atomic_output_dir", "rank_dir", "read_mesh", "aligned_empty", "BlockPool", "address_of",
           "list_ranks", "buffer_nbytes", "uncovered"]

log = logging.getLogger(__name__)

#: Version of the on-disk layout; bumped on any incompatible change.
ARTIFACT_FORMAT = 1
#: Byte alignment of every weight and of every activation buffer in the arena.
ALIGNMENT = 64

_HASH_CHUNK = 1 << 24


class ArtifactError(ShardflowError):
    """An out_dir or rank directory is missing, malformed, or does not fit this runtime."""


class ChecksumError(ArtifactError):
    """A file's sha256 does not match its manifest; ``path`` names the file."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


class VersionError(ArtifactError):
    """The artifact was written in a format this runtime does not read."""


def rank_dir(out_dir: str | os.PathLike, rank: int) -> Path:
    """``out_dir/rank{rank}``."""
    return Path(out_dir) / f"rank{rank}"


def list_ranks(out_dir: str | os.PathLike) -> list[int]:
    """The ranks that have a directory in ``out_dir``, sorted."""
    res = []
    for p in Path(out_dir).iterdir():
        if p.is_dir() and p.name.startswith("rank") and p.name[4:].isdigit():
            res.append(int(p.name[4:]))
    return sorted(res)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_HASH_CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON, under a temporary name renamed at the end (a reader never
    sees half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str | os.PathLike, what: str | None = None) -> Any:
    """Read a JSON file, raising :class:`ArtifactError` naming it when missing or malformed."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ArtifactError(f"{what or 'file'} {str(path)!r} is missing; is this a shardflow out_dir (made by "
                            "`shardflow compile`)?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{str(path)!r} is not valid JSON ({exc}); the out_dir is damaged, compile again") \
            from None


def read_versioned(path: str | os.PathLike, what: str, fmt: str, version: int) -> dict | None:
    """The JSON object at ``path`` (an out_dir's description of its parts: ``variants.json``,
    ``pipeline.json``) with its ``format`` and ``version`` checked, or ``None`` when there is no such
    file."""
    path = Path(path)
    if not path.exists():
        return None
    spec = read_json(path, what)
    if not isinstance(spec, dict) or spec.get("format") != fmt:
        raise ArtifactError(f"{str(path)!r} is not a {what} (format {fmt!r})")
    if spec.get("version") != version:
        raise ArtifactError(f"{str(path)!r} has version {spec.get('version')!r}; this runtime reads version "
                            f"{version}: compile again with this version of Shardflow")
    return spec


def finalize_rank_dir(directory: str | os.PathLike, manifest: dict, known: dict[str, str] | None = None) -> dict:
    """Add the sha256 of every file in ``directory`` to ``manifest`` and write ``manifest.json``.

    ``known`` maps file names to sha256 digests the writer computed while writing them.
    """
    directory = Path(directory)
    files = {}
    known = known or {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != "manifest.json":
            files[p.name] = {"sha256": known.get(p.name) or sha256_file(p), "bytes": p.stat().st_size}
    manifest = dict(manifest)
    manifest["artifact_format"] = ARTIFACT_FORMAT
    manifest["files"] = files
    write_json(directory / "manifest.json", manifest)
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict:
    """Read ``manifest.json`` of a rank directory and check its format version."""
    path = Path(directory) / "manifest.json"
    m = read_json(path, "manifest")
    if not isinstance(m, dict) or "artifact_format" not in m:
        raise ArtifactError(f"{str(path)!r} has no artifact_format; it is not a shardflow manifest")
    if m["artifact_format"] != ARTIFACT_FORMAT:
        raise VersionError(f"{str(path)!r} has artifact format {m['artifact_format']!r}; this runtime reads format "
                           f"{ARTIFACT_FORMAT}. Compile the model again with this shardflow version")
    for key in ("rank", "world_size", "target", "files", "inputs", "outputs"):
        if key not in m:
            raise ArtifactError(f"{str(path)!r} lacks {key!r}; the out_dir is damaged, compile again")
    return m


def verify_files(directory: str | os.PathLike, manifest: dict, skip: tuple[str, ...] = ()) -> None:
    """Check every file the manifest lists (except ``skip``) against its sha256.

    Raises
    ------
    ChecksumError
        Naming the first file whose bytes differ or that is missing.
    """
    directory = Path(directory)
    for name, info in manifest["files"].items():
        if name in skip:
            continue
        path = directory / name
        if not path.is_file():
            raise ChecksumError(f"{str(path)!r} is listed in the manifest but missing", str(path))
        got = sha256_file(path)
        if got != info["sha256"]:
            raise ChecksumError(f"checksum mismatch in {str(path)!r}: sha256 {got[:16]}… but the manifest says "
                                f"{info['sha256'][:16]}…; the file is corrupted, copy or compile it again", str(path))


#: buffer dtypes numpy has no type of: the unsigned integer of their bytes
_ML_FLOAT_BYTES = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e4m3fnuz": np.uint8,
                   "float8_e5m2": np.uint8, "float8_e5m2fnuz": np.uint8}


def buffer_dtype(name: str, device: bool = False) -> np.dtype:
    """The numpy dtype of a program buffer's dtype name. ``bfloat16`` and the float8 types (no
    numpy type) are ml_dtypes' on the host when that package is installed, else their bit pattern
    (``uint16``, ``uint8``); on the device (``device=True``, cupy has no such types) always the bit
    pattern: kernels only need the bytes."""
    if name in _ML_FLOAT_BYTES:
        if not device:
            try:
                import ml_dtypes

                return np.dtype(getattr(ml_dtypes, name))
            except ImportError:
                pass
        return np.dtype(_ML_FLOAT_BYTES[name])
    try:
        return np.dtype(name)
    except TypeError:
        raise ArtifactError(f"unknown buffer dtype {name!r} in program.json") from None


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """A ``uint8`` array of ``nbytes`` whose data pointer is ``alignment``-aligned."""
    raw = np.empty(nbytes + alignment, np.uint8)
    shift = (-address_of(raw)) % alignment
    return raw[shift:shift + nbytes]


class BlockPool:
    """Aligned blocks for a program's fresh outputs, taken back when the caller drops them.

    A fresh output of a megabyte or more is new memory to the kernel that writes it: a page fault
    on every 4 KiB page (a decoding step of the committed benchmark's Llama, its cache fed and
    returned, spent 19 of its 41 ms there). :meth:`take` hands out a block as an array that every
    array made from it keeps alive; when the last of them is freed, the block returns to the pool,
    which keeps as many of each size as ``sizes`` says a run takes (a decoding loop holds the last
    step's presents, fed back, while a step writes new ones: the step before's are free again).
    Smaller blocks are plain :func:`aligned_empty` (a pool's bookkeeping, about 2 us, costs more
    than their faults)."""

    def __init__(self, sizes: Iterable[int] = (), least: int = 1 << 20) -> None:
        self.least = least
        self._keep: dict[int, int] = {}
        for n in sizes:
            self._keep[n] = self._keep.get(n, 0) + 1
        self._free: dict[int, list[np.ndarray]] = {}

    def take(self, nbytes: int) -> np.ndarray:
        """A writable, ``ALIGNMENT``-aligned ``uint8`` array of ``nbytes``, not shared with any array
        the caller still holds."""
        if nbytes < self.least:
            return aligned_empty(nbytes)
        free = self._free.setdefault(nbytes, [])
        block = free.pop() if free else aligned_empty(nbytes)
        # an array whose base is no ndarray: every view of it then has it as base (numpy gathers a
        # view's base to the first array up its chain that owns its data or sits on a foreign buffer),
        # so it lives exactly as long as some array on the block does
        held = np.frombuffer(memoryview(block), np.uint8)
        weakref.finalize(held, self._give_back, free, block).atexit = False
        return held

    def _give_back(self, free: list, block: np.ndarray) -> None:
        if len(free) < self._keep.get(block.nbytes, 1):
            free.append(block)


def address_of(a: np.ndarray) -> int:
    """The data pointer of a writable, non-empty numpy array: ``a.ctypes.data`` without building
    numpy's ctypes helper object (about 1 us, several per run on the decoding hot path)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(a))


def read_weights(path: str | os.PathLike, nbytes: int, sha256: str | None, *, mapped: bool = False,
                 skip: Sequence[tuple[int, int, str]] = ()) -> np.ndarray:
    """Read ``weights.bin`` into an aligned buffer, hashing it in the same pass.

    ``skip``: ``(offset, nbytes, sha256)`` regions not copied into the buffer (the caller reads bytes
    alike from elsewhere: a shape variant's weights another variant holds, runtime/variants.py; or
    nobody reads them); the buffer's pages there are never written, so they take no memory. When
    verifying (``sha256``), each region's own checksum, unless None, is checked too: the caller's copy
    must hold the bytes the file holds.

    With ``mapped``, the file is mapped instead (copy-on-write: a write to the array, such as a
    load step's, stays private to this process and never reaches the file), so that its pages are
    the page cache's: nothing is copied into this process's own memory, the kernel may drop the
    pages again, and processes mapping the same file (ranks whose weights files are hard links to
    one, rfcs/0003) share them. The mapping is page-aligned. A file changed in place while mapped
    (``cp`` over it; a compile never does, it writes a new directory) would change what the program
    reads, or, cut short, kill it with SIGBUS: compile into a new ``out_dir`` while programs run
    from the old one.

    Raises
    ------
    ChecksumError
        When the size or the sha256 differs from the manifest.
    """
    path = Path(path)
    h = hashlib.sha256()
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ChecksumError(f"{str(path)!r} is missing", str(path)) from None
    if size != nbytes:
        raise ChecksumError(f"{str(path)!r} has {size} bytes, the program expects {nbytes}; the file is truncated "
                            "or corrupted", str(path))
    buf = None
    if mapped and nbytes:
        try:
            buf = np.memmap(path, dtype=np.uint8, mode="c", shape=(nbytes,))
        except (OSError, ValueError) as exc:  # (a file system that cannot map it)
            log.warning("cannot map %s (%s); reading it instead", path, exc)
    if buf is not None:
        if sha256 is not None:
            for pos in range(0, nbytes, _HASH_CHUNK):
                h.update(buf[pos:pos + _HASH_CHUNK])
            for off, n, want in skip:  # (mapped: the regions read elsewhere are checked through the mapping)
                if want is not None:
                    _check_region(path, off, n, hashlib.sha256(buf[off:off + n]).hexdigest(), want)
    elif skip:
        buf = aligned_empty(nbytes)
        _read_around(path, buf, sorted(skip), h if sha256 is not None else None)
    else:
        buf = aligned_empty(nbytes)
        with open(path, "rb") as f:
            view = memoryview(buf)
            pos = 0
            while pos < nbytes:
                n = f.readinto(view[pos:pos + _HASH_CHUNK])
                if not n:
                    break
                if sha256 is not None:  # (verify=False: no hashing, as load's docstring says)
                    h.update(view[pos:pos + n])
                pos += n
    if sha256 is not None and h.hexdigest() != sha256:
        raise ChecksumError(f"checksum mismatch in {str(path)!r}: sha256 {h.hexdigest()[:16]}… but the manifest says "
                            f"{sha256[:16]}…; the weight shard is corrupted, copy or compile it again", str(path))
    return buf


def buffer_nbytes(entry: dict) -> int:
    """The bytes of a buffer entry of program.json (its shape times its element's size)."""
    return int(np.prod(entry["shape"], dtype=np.int64)) * buffer_dtype(entry["dtype"]).itemsize


def uncovered(ranges: Iterable[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` spans of ``[0, total)`` that none of the sorted ``(offset, nbytes)`` ranges covers."""
    res, pos = [], 0
    for off, n in ranges:
        if off > pos:
            res.append((pos, off))
        pos = max(pos, off + n)
    if pos < total:
        res.append((pos, total))
    return res


def _read_around(path: Path, buf: np.ndarray, skip: list[tuple[int, int, str]], h) -> None:
    """:func:`read_weights`' copy of ``path`` into ``buf`` but for the ``skip`` regions (sorted), through a
    chunk buffer, hashing every byte into ``h`` and each region into its own checksum, which must be the
    region's (unless ``h`` is None: then the skipped regions are not read)."""
    keep = uncovered(((off, n) for off, n, _ in skip), buf.nbytes)  # (start, end) ranges copied into buf
    with open(path, "rb") as f:
        if h is None:
            for a, b in keep:
                f.seek(a)
                f.readinto(memoryview(buf)[a:b])
            return
        regions = [(off, off + n, hashlib.sha256() if want is not None else None) for off, n, want in skip]
        chunk = bytearray(_HASH_CHUNK)
        pos = 0
        while pos < buf.nbytes:
            n = f.readinto(chunk)
            if not n:
                break
            view = memoryview(chunk)
            h.update(view[:n])
            for a, b in keep:
                lo, hi = max(a, pos), min(b, pos + n)
                if lo < hi:
                    buf[lo:hi] = np.frombuffer(chunk, np.uint8, hi - lo, lo - pos)
            for a, b, rh in regions:
                lo, hi = max(a, pos), min(b, pos + n)
                if lo < hi and rh is not None:
                    rh.update(view[lo - pos:hi - pos])
            pos += n
    for (a, b, rh), (_, _, want) in zip(regions, skip):
        if want is not None:
            _check_region(path, a, b - a, rh.hexdigest(), want)


def _check_region(path: Path, off: int, n: int, got: str, want: str) -> None:
    if got != want:
        raise ChecksumError(f"{str(path)!r}: bytes {off}..{off + n} have sha256 {got[:16]}…, but the shape variants' "
                            f"list says {want[:16]}… (read from another variant's copy); the out_dir's variants.json "
                            "does not fit its files: compile it again", str(path))


def read_mesh(out_dir: str | os.PathLike) -> dict:
    """``out_dir/mesh.json``."""
    return read_json(Path(out_dir) / "mesh.json", "mesh description")


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory next to ``out_dir``; on success it replaces ``out_dir``.

    On any exception (including ``KeyboardInterrupt``) the temporary directory is removed and
    ``out_dir`` is left as it was: an interrupted compile never leaves a half-written out_dir.
    """
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            if not out.is_dir():
                raise ArtifactError(f"{str(out)!r} exists and is not a directory; choose another out_dir")
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "d")
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
