"""Large constants made by the compiler kept in files once they would crowd the memory.

A compile makes new constant arrays all along: a weight's shard sliced by columns
(``parallel/partition.py``), its copy cast to float16, stored ``[N, K]``, packed into the cpu GEMM's
panels (``passes/``), folded values. Each rank's set of them is as large as its weights, and the
compile holds them until the rank's ``weights.bin`` is written: a 7B model's packed weights for
one cpu rank are 28 GB, more than many machines that compile it have.

Under :func:`spilling` (``compile`` runs in one), :func:`~shardflow.compiler.ir.graph.const_tensor`
passes every new constant of :data:`SPILL_BYTES` or more that is not already backed by a file (the
model's own weights are mapped from it: ``frontend/external_data.py``) through :func:`spill`. While
the constants so kept in memory total at most the block's budget (``SHARDFLOW_SPILL_BUDGET`` bytes,
default half the memory available when the block starts), a constant stays in memory and is
counted until it is freed. Past the budget its bytes go to a file of their own in the spill folder,
unlinked at once, and the constant holds a copy-on-write map of that file: its pages are the
kernel's page cache, written out and dropped under memory pressure rather than held, and the file
is gone with the last array that maps it, so nothing is left on disk, even after a crash. Values,
types and shapes are the same either way (a spilled array is C-ordered; writing into it, which no
pass does, changes only the process's copy). Spilling costs time (the bytes are written out twice:
to the spill file and to ``weights.bin``), which is why it waits for the budget.

``compile`` spills into a folder beside its ``out_dir`` (the artifact's file system: the weights
are written there anyway; ``/tmp`` may be memory). Outside :func:`spilling` (``load_onnx``,
``search``, tests) nothing is spilled. rfcs/0000, "Constants spilled to files".
"""
from __future__ import annotations

import contextlib
import contextvars
import mmap
import os
import tempfile
import weakref
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import ConfigError, ShardflowError

__all__ = ["SPILL_BYTES", "BUDGET_ENV", "spill", "spilling", "file_backed", "zeros", "contiguous", "concatenate"]

#: Arrays this large or larger are counted and spilled: a file each (two system calls and a map) is
#: cheap next to a megabyte, and the many small constants (biases, shapes, scales) stay in memory.
SPILL_BYTES = 1 << 20

#: The environment variable that sets a compile's budget in bytes (``0``: spill every large constant).
BUDGET_ENV = "SHARDFLOW_SPILL_BUDGET"


def _default_budget() -> int:
    """Half the memory available now (Linux's ``MemAvailable``, else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # (nothing known: keep everything in memory, as without spilling)


def _budget() -> int:
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return _default_budget()
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{BUDGET_ENV}={text!r}: expected a whole number of bytes, 0 or more (0 spills every "
                          f"constant of {SPILL_BYTES} bytes or more to a file)")
    return value


class _Block:
    """One :func:`spilling` block: its budget, the bytes of counted constants alive, its folder
    (made when the first array is spilled)."""

    def __init__(self, near: Path, budget: int):
        self.near, self.budget, self.held, self.path = near, budget, 0, None

    def keeps(self, nbytes: int) -> bool:
        return self.held + nbytes <= self.budget

    def hold(self, a: np.ndarray) -> None:
        self.held += a.nbytes
        weakref.finalize(a, self._release, a.nbytes)

    def _release(self, nbytes: int) -> None:
        self.held -= nbytes

    @contextlib.contextmanager
    def new_file(self, prefix: str, nbytes: int) -> Iterator[tuple[int, str]]:
        """A new file in the folder, ``(fd, path)``, unlinked at the end (a map made inside keeps
        it); a failure of the file system (no space) as a :class:`ShardflowError` saying what to do."""
        path = None
        try:
            if self.path is None:
                parent = self.near.parent
                parent.mkdir(parents=True, exist_ok=True)
                self.path = Path(tempfile.mkdtemp(prefix=f".{self.near.name}.spill-", dir=parent))
            fd, path = tempfile.mkstemp(prefix=prefix, suffix=".bin", dir=self.path)
            yield fd, path
        except OSError as exc:
            raise ShardflowError(f"could not keep a constant of {nbytes:,} bytes in a file in "
                                 f"{self.path or self.near.parent} ({exc}); free space there, or raise "
                                 f"{BUDGET_ENV} (now {self.budget:,} bytes) to keep more in memory") from exc
        finally:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)


_BLOCK: contextvars.ContextVar[_Block | None] = contextvars.ContextVar("shardflow_spill", default=None)


def file_backed(a: np.ndarray) -> bool:
    """Whether ``a``'s memory is a map of a file (a ``numpy.memmap`` of one, or a view of it or of
    an ``mmap``), so holding it costs no memory of the process's own. (An array of the
    ``numpy.memmap`` class made by ``zeros_like`` maps nothing: its chain of bases ends elsewhere.)"""
    x = a
    while x is not None:
        if isinstance(x, mmap.mmap):
            return True
        x = getattr(x, "base", None)
    return False


def spill(a: np.ndarray) -> np.ndarray:
    """``a``; under :func:`spilling`, when it is large and not file-backed: ``a`` counted against
    the budget while that holds it, past the budget a copy-on-write map of a file of its bytes
    (equal values, type and shape; C order)."""
    block = _BLOCK.get()
    if (block is None or not isinstance(a, np.ndarray) or a.nbytes < SPILL_BYTES or a.dtype.hasobject
            or file_backed(a)):
        return a
    if block.keeps(a.nbytes):
        block.hold(a)
        return a
    with block.new_file("c", a.nbytes) as (fd, path):
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
        return np.memmap(path, dtype=a.dtype, mode="c", shape=a.shape)


def zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """``numpy.zeros(shape, dtype)``; under :func:`spilling`, when that is large and past the
    budget, a writable map of a new (unlinked) file of zeros: for an array a pass fills in place,
    such as packed panels, which is then never in the process's memory as a whole."""
    block = _BLOCK.get()
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if block is None or nbytes < SPILL_BYTES or dtype.hasobject or block.keeps(nbytes):
        return np.zeros(shape, dtype)
    with block.new_file("z", nbytes) as (fd, path):
        try:
            # its blocks allocated now: a full disk is an error here, not a SIGBUS when the pass
            # writes into the map of a sparse file
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        return np.memmap(path, dtype=dtype, mode="r+", shape=tuple(shape))


def contiguous(a: np.ndarray, dtype=None) -> np.ndarray:
    """``a`` C-ordered (and cast to ``dtype``), ``a`` itself when it is so already, else a copy
    made in :func:`zeros`' array by one assignment (no whole-size temporaries: a weight transposed
    and cast to float16 is never in memory twice). 0-d arrays stay 0-d."""
    a = np.asarray(a)
    dtype = a.dtype if dtype is None else np.dtype(dtype)
    if a.dtype == dtype and a.flags.c_contiguous:
        return a
    out = zeros(a.shape, dtype)
    out[...] = a
    return out


def concatenate(arrays: list[np.ndarray], axis: int = 0) -> np.ndarray:
    """``numpy.concatenate(arrays, axis)`` written into :func:`zeros`' array (the projections of
    one activation stored as one weight)."""
    arrays = [np.asarray(a) for a in arrays]
    shape = list(arrays[0].shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    return np.concatenate(arrays, axis=axis, out=zeros(tuple(shape), np.result_type(*arrays)))


@contextlib.contextmanager
def spilling(near: str | os.PathLike, budget: int | None = None) -> Iterator[None]:
    """Keep the large constants made inside this block in memory up to ``budget`` bytes (default:
    ``SHARDFLOW_SPILL_BUDGET``, else half the memory available now) and spill the rest
    (:func:`spill`) into a folder beside ``near``, made when the first one is spilled and removed at
    the end (its files are unlinked as they are mapped).

    Raises
    ------
    ConfigError
        ``SHARDFLOW_SPILL_BUDGET`` is not a whole number of bytes.
    """
    block = _Block(Path(near).resolve(), _budget() if budget is None else int(budget))
    token = _BLOCK.set(block)
    try:
        yield
    finally:
        _BLOCK.reset(token)
        if block.path is not None:
            with contextlib.suppress(OSError):
                os.rmdir(block.path)
