"""Run one rank's program: :func:`load` and :class:`RankProgram`.

Loading verifies the manifest's format version and the sha256 of every file, reads the weight
shard into one aligned buffer, allocates the activation arena once, opens ``kernels.so`` and
precomputes, for every step, the kernel's function and its two pointer arrays, laid out as the
flat arrays of ``sf_run_program`` in the native runtime library (:mod:`shardflow.runtime.native`).
The program's first ``load_steps`` steps (kernels computed from constants alone, e.g. large fills
constant folding left in the graph) run once, here; their results keep their memory in the arena.
A run then copies the inputs into the arena, makes one native call that walks the steps
(``fn(inputs, outputs)`` for a kernel; a callback into the communicator for a collective) and
copies the outputs out.

State (``compile(state=...)``, ``program.json``'s ``state``): an output the program keeps as the
next run's value of one of its inputs, e.g. a KV cache. The input's buffer lives through the whole
run, is zeroed at load and set only when ``run`` is given the input; the output is written over it
by its kernel (``in_place``) or copied into it after the steps, and is not returned.

Kernel ABI (cpu): ``extern "C" void sym(const void* const* inputs, void* const* outputs)`` on
contiguous row-major arrays of the op's static shapes and dtypes (``sf_kernel_fn`` in
``runtime/native/include/shardflow/runtime.h``).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Container, Mapping

import numpy as np

from . import native
from .artifact import (ALIGNMENT, ArtifactError, BlockPool, address_of, aligned_empty, buffer_dtype, buffer_nbytes,
                       read_json, read_manifest, read_weights, rank_dir, uncovered, verify_files)
from .comm.base import CommError, Communicator, SelfCommunicator
from .comm.prepared import prepare
from .errors import MemoryLimitError, ShardflowError, format_bytes

if TYPE_CHECKING:
    from .variants import VariantProgram

__all__ = ["load", "RankProgram", "InputError", "InputNameError", "InputShapeError", "InputDtypeError",
           "InputIndexError", "IndexRangeError", "WorldSizeError"]

log = logging.getLogger(__name__)

#: the least bytes of an input that a run reads in the caller's array (:meth:`RankProgram._lent`)
_LEND_LEAST = 1 << 16
#: the least bytes of an output that a run writes into fresh memory (smaller ones are copied out of the
#: arena: cheaper than a block and its pointers, 10 us a run of the tiny genai Llama's five outputs)
_FRESH_LEAST = 1 << 14

_VP = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)


class InputError(ShardflowError):
    """An input given to :meth:`RankProgram.run` is missing, unknown, or has the wrong shape or
    dtype; ``input_name`` names it."""

    def __init__(self, message: str, input_name: str | None = None):
        super().__init__(message)
        self.input_name = input_name


class InputNameError(InputError):
    """An input is missing or not an input of the model."""


class InputShapeError(InputError):
    """An input has another shape than the one compiled."""


class InputDtypeError(InputError):
    """An input has another dtype than the one compiled."""


class InputIndexError(InputError):
    """An input read as indices holds a value outside the axis it indexes (the compiled kernels would
    clamp it into the axis)."""


def refuse_indices(name: str, low: int, high: int, ranges, carried: bool = False) -> None:
    """Raise :class:`InputIndexError` when the input ``name``'s values (from ``low`` to ``high``) leave
    one of ``ranges`` (``(lo, hi, node)``: the range a node reads it as an index in)."""
    for lo, hi, op in ranges:
        if low < lo or high > hi:
            bad = low if low < lo else high
            what = f"state input {name!r} (carried over from the last run)" if carried else f"input {name!r}"
            raise InputIndexError(f"{what} holds the index {bad}, outside [{lo}, {hi}], the range node "
                                  f"{op!r} reads it as an index in (token ids past an embedding's rows?); the "
                                  "compiled kernels would clamp it into the axis, so the run is refused", name)


class IndexRangeError(ShardflowError):
    """An index computed in the graph (from the inputs' values: positions from an attention mask)
    left the axis an op reads with it; the compiled kernels clamped it into the axis, so the run's
    outputs (and any state it wrote) are wrong. ``nodes`` names the ops reading it."""

    def __init__(self, message: str, nodes: tuple[str, ...] = ()):
        super().__init__(message)
        self.nodes = tuple(nodes)


class WorldSizeError(ShardflowError):
    """The number of ranks running does not match the artifacts' world size."""


def _as_communicator(comm: Any) -> Communicator | None:
    if comm is None or isinstance(comm, Communicator):
        return comm
    if type(comm).__module__.startswith("mpi4py"):
        from .comm.mpi import MPICommunicator

        return MPICommunicator(comm)
    raise ShardflowError(f"comm must be a shardflow.runtime.comm.Communicator or an mpi4py communicator, got "
                         f"{type(comm).__name__}")


def load(out_dir: str | os.PathLike, rank: int | None = None, comm: Any = None, *,
         verify: bool = True, map_weights: bool | None = None) -> "RankProgram | VariantProgram":
    """Load rank ``rank``'s program from ``out_dir``.

    Parameters
    ----------
    out_dir
        A directory written by ``shardflow.compiler.compile`` (or ``shardflow compile``).
    rank
        The global rank to load; default ``comm.rank``, or 0 without a communicator.
    comm
        The world communicator (a :class:`~shardflow.runtime.comm.Communicator`, or an
        ``mpi4py`` communicator). Required when the artifacts have more than one rank; loading
        then builds one sub-communicator per mesh-axis group, which is collective: every rank
        calls :func:`load` at the same point.
    verify
        Check the sha256 of every file (default). Turning it off only saves the hashing time.
    map_weights
        Map ``weights.bin`` (copy-on-write) instead of reading it into this process's memory
        (:func:`~shardflow.runtime.artifact.read_weights`). Default: mapped for the ``cuda``
        target, whose kernels read the device's copy (the host's pages stay the page cache's, which
        may drop them: a 7B model's 13.5 GB are not the rank's own memory beside the GPU's copy),
        read for ``cpu``, whose kernels read the host's copy on every run (mapped, a decoding step of
        GPT-2 small, which reads all its 0.5 GB, took 1-23% longer on a 2-core Xeon: rfcs/0003).
        Mapped, ranks on one machine whose weights files are one file (replicated weights, rfcs/0003)
        share its pages.

    Returns
    -------
    RankProgram
        Ready to :meth:`~RankProgram.run`; for an out_dir of pipeline stages (``pipeline_stages``),
        a :class:`~shardflow.runtime.pipeline.PipelineProgram`, which runs the rank's stage between
        the tensors it receives and sends; for an out_dir of shape variants
        (:func:`~shardflow.compiler.compile_variants`), a
        :class:`~shardflow.runtime.variants.VariantProgram`, which runs the variant compiled for the
        inputs' shapes.

    Raises
    ------
    ArtifactError
        Missing or malformed files; :class:`~shardflow.runtime.artifact.VersionError` for another
        artifact format; :class:`~shardflow.runtime.artifact.ChecksumError` naming a corrupted file.
    WorldSizeError
        The communicator's size or rank does not fit the artifacts.
    """
    from .pipeline import PipelineProgram, read_pipeline
    from .variants import VariantProgram, read_variants

    comm = _as_communicator(comm)
    if rank is None:
        rank = comm.rank if comm is not None else 0
    stages = read_pipeline(out_dir)
    if stages is not None:
        return PipelineProgram(out_dir, int(rank), comm, stages, verify=verify, map_weights=map_weights)
    spec = read_variants(out_dir)
    if spec is not None:
        return VariantProgram(out_dir, int(rank), comm, spec, verify=verify, map_weights=map_weights)
    return RankProgram(out_dir, int(rank), comm, verify=verify, map_weights=map_weights)


#: Per path this process has loaded a kernels library from: the file it was then (device, inode, mtime).
_LOADED_LIBRARIES: dict[str, tuple[int, int, int]] = {}


def _load_library(path: Path) -> ctypes.CDLL:
    """``path``'s shared library. The dynamic loader hands back the library it loaded before under the
    same name, so an out_dir compiled again into the same place, in a process that loaded its earlier
    library, would run (or miss the symbols of) the old kernels: the new file is then loaded through a
    name of its own (a hard link, or a copy, in a temporary folder, removed once it is loaded)."""
    real = str(path.resolve())
    st = os.stat(real)
    ident = (st.st_dev, st.st_ino, st.st_mtime_ns)
    mode = getattr(os, "RTLD_LOCAL", 0)
    if _LOADED_LIBRARIES.setdefault(real, ident) == ident:
        return ctypes.CDLL(real, mode=mode)
    folder = tempfile.mkdtemp(prefix="shardflow-lib-")
    alias = os.path.join(folder, f"{st.st_ino}-{st.st_mtime_ns}-{path.name}")
    try:
        try:
            os.link(real, alias)
        except OSError:
            shutil.copyfile(real, alias)
        return ctypes.CDLL(alias, mode=mode)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Buffer:
    __slots__ = ("name", "shape", "dtype", "array", "ptr")


class RankProgram:
    """One rank's compiled program, loaded and ready to run (see :func:`load`).

    A program owns one activation arena: calls to :meth:`run` must not overlap (use one
    ``RankProgram`` per thread).
    """

    def __init__(self, out_dir: str | os.PathLike, rank: int, comm: Communicator | None, verify: bool = True,
                 map_weights: bool | None = None,
                 borrowed_weights: Mapping[int, tuple[np.ndarray, str]] | None = None,
                 external_weights: Mapping[int, np.ndarray] | None = None,
                 device_weights: Mapping[tuple[str, int], Any] | None = None,
                 shared_weights: np.ndarray | None = None):
        # borrowed_weights: {offset in weights.bin: (bytes alike held by another program, their sha256)}, read
        # from there instead of the file (a shape variant's weights another variant loaded: runtime/variants.py);
        # external_weights: {offset in program.json's external_weights file: those bytes, held already};
        # device_weights (cuda): {("weights" | "external", offset): a device array of those bytes, held already}
        # shared_weights: the whole weights.bin of this program, held by another instance of it (twin)
        self.device_weights = dict(device_weights or {})
        self._shared_weights = shared_weights
        self._borrowed_weights = {off: a for off, (a, _) in (borrowed_weights or {}).items()}
        self._borrowed_sha = {off: sha for off, (_, sha) in (borrowed_weights or {}).items()}
        self._external_given = dict(external_weights or {})
        #: {offset in the external weights file: its bytes as this program reads them} (shape variants)
        self.external_regions: dict[int, np.ndarray] = {}
        self.out_dir = Path(out_dir)
        if not self.out_dir.is_dir():
            raise ArtifactError(f"out_dir {str(out_dir)!r} does not exist or is not a directory")
        self.directory = rank_dir(out_dir, rank)
        if not self.directory.is_dir():
            raise WorldSizeError(f"{str(out_dir)!r} has no rank{rank}/ directory: rank {rank} is outside its world")
        self.manifest = read_manifest(self.directory)
        m = self.manifest
        self.rank = int(m["rank"])
        self.world_size = int(m["world_size"])
        self.target = m["target"]
        if self.rank != rank:
            raise ArtifactError(f"{str(self.directory)!r} holds the program of rank {self.rank}, not {rank}")
        if self.target not in ("cpu", "cuda"):
            raise ShardflowError(f"{str(out_dir)!r} was compiled for target {self.target!r}; this runtime runs "
                                 "'cpu' and 'cuda' artifacts")
        if comm is None:
            if self.world_size > 1:
                raise WorldSizeError(f"{str(out_dir)!r} has {self.world_size} ranks; pass the world communicator "
                                     f"(shardflow.runtime.comm) or run it with `shardflow run {out_dir} "
                                     f"--nproc {self.world_size}`")
            comm = SelfCommunicator()
        if comm.size != self.world_size:
            raise WorldSizeError(f"{str(out_dir)!r} was compiled for {self.world_size} ranks but the communicator has "
                                 f"{comm.size}; run exactly {self.world_size} ranks")
        if comm.rank != rank:
            raise WorldSizeError(f"loading rank {rank} on the communicator's rank {comm.rank}; pass rank=comm.rank")
        self.comm = comm
        if verify:
            verify_files(self.directory, m, skip=("weights.bin",))
        self.program = read_json(self.directory / "program.json", "program")
        self._map_weights = self.target == "cuda" if map_weights is None else bool(map_weights)
        self._build(verify, self._map_weights)
        log.debug("rank %d: loaded %d steps (%d kernels, %d collectives), arena %d B, weights %d B", self.rank,
                  len(self.program["steps"]), self._n_kernels, self._n_collectives, self.arena.nbytes,
                  self.weights.nbytes)

    # ------------------------------------------------------------------- loading -----------
    def _build(self, verify: bool, map_weights: bool) -> None:
        p = self.program
        wfile = p.get("weights_file", "weights.bin")
        winfo = self.manifest["files"].get(wfile)
        if p["weights_bytes"] and winfo is None:
            raise ArtifactError(f"the manifest of {str(self.directory)!r} does not list {wfile}")
        borrowed = self._borrowed_weights
        if self.target == "cuda":  # (the engine uploads what the device was not given: those bytes are read)
            borrowed = {off: a for off, a in borrowed.items() if ("weights", off) in self.device_weights}
        if self._shared_weights is not None:
            if self._shared_weights.nbytes != int(p["weights_bytes"]):
                raise ArtifactError(f"rank {self.rank}: weights of {self._shared_weights.nbytes} bytes shared with "
                                    f"{str(self.directory)!r}, whose program has {p['weights_bytes']}")
            self.weights = self._shared_weights
        else:
            skip = [(off, a.nbytes, self._borrowed_sha[off]) for off, a in borrowed.items()]
            self.weights = read_weights(self.directory / wfile, int(p["weights_bytes"]),
                                        winfo["sha256"] if (verify and winfo) else None, mapped=map_weights,
                                        skip=skip) if p["weights_bytes"] else aligned_empty(0)
        try:
            self.arena = aligned_empty(int(p["arena_bytes"]))
        except MemoryError:
            raise MemoryLimitError(
                f"rank {self.rank}: the program in {str(self.directory)!r} needs {format_bytes(int(p['arena_bytes']))} "
                "of working memory (its arena: program.json's arena_bytes) and this process could not allocate it; "
                "run it where there is more memory, split the model over more ranks, or compile it for smaller "
                "input shapes") from None
        self.external_regions = self._external_regions(p, verify, map_weights)
        self.buffers: list[_Buffer] = []
        for k, b in enumerate(p["buffers"]):
            buf = _Buffer()
            buf.name, buf.shape, buf.dtype = b["name"], tuple(b["shape"]), buffer_dtype(b["dtype"])
            nbytes = int(np.prod(buf.shape, dtype=np.int64)) * buf.dtype.itemsize
            if b["storage"] == "external":  # (in another shape variant's weights file: _external_regions)
                region = self.external_regions[int(b["offset"])]
                if region.nbytes != nbytes:
                    raise ArtifactError(f"program.json of rank {self.rank}: buffer {k} ({buf.name}) of {nbytes} bytes "
                                        f"and another of {region.nbytes} at offset {b['offset']} of its external "
                                        "weights file")
                buf.array, buf.ptr = region.view(buf.dtype).reshape(buf.shape), region.ctypes.data
                self.buffers.append(buf)
                continue
            if b["storage"] not in ("weights", "arena"):
                raise ArtifactError(f"program.json of rank {self.rank}: buffer {k} ({buf.name}) has storage "
                                    f"{b['storage']!r}; this runtime knows weights, arena and external")
            store = self.weights if b["storage"] == "weights" else self.arena
            off = int(b["offset"])
            if off < 0 or off + nbytes > store.nbytes or off % ALIGNMENT and nbytes:
                raise ArtifactError(f"program.json of rank {self.rank}: buffer {k} ({buf.name}) at offset {off} with "
                                    f"{nbytes} bytes does not fit its {b['storage']} of {store.nbytes} bytes")
            if b["storage"] == "weights" and off in borrowed and borrowed[off].nbytes == nbytes:
                buf.array = borrowed[off].view(buf.dtype).reshape(buf.shape)
                buf.ptr = borrowed[off].ctypes.data
            else:
                if b["storage"] == "weights" and any(o < off + nbytes and off < o + a.nbytes
                                                     for o, a in borrowed.items()):
                    raise ArtifactError(f"rank {self.rank}: buffer {k} ({buf.name}) of {str(self.directory)!r} "
                                        "overlaps weights borrowed from another shape variant without being one of "
                                        "them; the out_dir's variants.json does not fit its programs")
                buf.array = store[off:off + nbytes].view(buf.dtype).reshape(buf.shape)
                buf.ptr = store.ctypes.data + off
            self.buffers.append(buf)
        self.input_specs = [(name, self.buffers[i]) for name, i in p["inputs"]]
        # indices computed in the graph: outputs counting their values outside the readers' range
        # (compile's passes/index_checks.py), read by _checked, not returned
        self._computed_checks = {str(c["output"]): c for c in self.manifest.get("index_checks", ())}
        outputs = {name: self.buffers[i] for name, i in p["outputs"]}
        missing = sorted(set(self._computed_checks) - set(outputs))
        if missing:
            raise ArtifactError(f"program.json of rank {self.rank}: the index check output(s) {missing} of the "
                                "manifest are no outputs of the program")
        self.output_specs = [(name, buf) for name, buf in outputs.items() if name not in self._computed_checks]
        self._check_counts = [outputs[name].array for name in self._computed_checks]
        self.state_specs = self._state_specs(p)
        self._state_inputs = frozenset(name for name, _, _, _ in self.state_specs)
        # inputs of which this rank holds a part (a sharded state): the whole's shape and the part's bounds
        self._parts = {e["name"]: (tuple(e["global_shape"]), tuple(slice(a, b) for a, b in e["bounds"]))
                       for e in self.manifest.get("inputs", ())
                       if "global_shape" in e and "bounds" in e and list(e["global_shape"]) != list(e["shape"])}
        # inputs read as indices: the ranges their values must lie in, and the op (compile's passes/index_checks.py)
        self._index_checks = {e["name"]: [(int(lo), int(hi), str(op)) for lo, hi, op in e["index_checks"]]
                              for e in self.manifest.get("inputs", ()) if e.get("index_checks")}
        # of those, a state kept on padded (or replicated) heads: the padded whole is the model's whole
        # taken at these indices along this axis (compile's passes/heads.py keep_state_padded)
        self._padded = {e["name"]: (int(e["padded_heads"]["axis"]), np.asarray(e["padded_heads"]["index"], np.int64))
                        for e in self.manifest.get("inputs", ()) if "padded_heads" in e}
        self._lib = None
        self._native = None
        self._engine = None
        self._fresh: list[tuple[str, int, list]] = []
        self._borrowed: dict[str, list] = {}
        self._blocks = BlockPool()
        steps = p["steps"]
        self.load_steps = int(p.get("load_steps", 0))
        if not 0 <= self.load_steps <= len(steps):
            raise ArtifactError(f"program.json of rank {self.rank}: load_steps = {self.load_steps} is outside "
                                f"[0, {len(steps)}] (the number of steps)")
        for s in steps[:self.load_steps]:
            if s["kind"] != "kernel":
                raise ArtifactError(f"program.json of rank {self.rank}: step {s['node']} is a {s['kind']}, but "
                                    f"the first {self.load_steps} steps (load_steps) must be kernels")
        if self.target == "cuda":
            from .cuda_exec import CudaEngine

            self.groups = self._make_groups()
            self._engine = CudaEngine(self, use_graph=bool(self.manifest.get("cuda_graph", True)),
                                      pdl=bool(self.manifest.get("pdl", False)))
            self._segments = []
            self._state_copies = []
            self._n_kernels = sum(1 for s in steps if s["kind"] == "kernel")
            self._n_collectives = len(steps) - self._n_kernels
            return
        if any(s["kind"] == "kernel" for s in steps):
            lib_path = self.directory / p.get("kernels_file", "kernels.so")
            try:
                self._lib = _load_library(lib_path)
            except OSError as exc:
                raise ArtifactError(f"cannot load {str(lib_path)!r}: {exc}") from None
        self.groups = self._make_groups()
        # the leading steps computed from constants alone run once, now (compile's "precompute")
        self._n_kernels = self._n_collectives = 0
        for s in steps[:self.load_steps]:
            fn, a, b, _, _ = self._kernel_call(s)
            fn(a, b)
            self._n_kernels += 1
        # segments: runs of kernel calls, each followed by at most one collective
        segments: list[tuple[list, Any]] = []
        calls: list = []
        for s in steps[self.load_steps:]:
            if s["kind"] == "kernel":
                calls.append(self._kernel_call(s))
                self._n_kernels += 1
            elif s["kind"] == "collective":
                segments.append((calls, self._collective_call(s)))
                calls = []
                self._n_collectives += 1
            else:
                raise ArtifactError(f"program.json of rank {self.rank}: unknown step kind {s['kind']!r}")
        if calls:
            segments.append((calls, None))
        self._segments = segments
        # the state outputs not written in place, copied into their inputs after the steps
        self._state_copies = [(self.buffers[i].array, self.buffers[o].array) for _, i, _, o in self.state_specs
                              if self.buffers[i].ptr != self.buffers[o].ptr]
        self._fresh = self._fresh_outputs(p, steps[self.load_steps:])
        self._blocks = BlockPool(nbytes for _, nbytes, _ in self._fresh)
        # (those of 64 KiB or more: a smaller one is copied, see _lent)
        self._borrowed = {name: sites for name, nbytes, sites in self._redirected(p, "borrowed_inputs",
                                                                                    steps[self.load_steps:])
                          if nbytes >= _LEND_LEAST}
        self._arena_span = (self.arena.ctypes.data, self.arena.ctypes.data + self.arena.nbytes)
        self.reset_state()
        # artifacts of older versions may list a runner.so: the native library replaces it
        self._native = self._native_program() if segments else None

    def _state_specs(self, p: dict) -> list[tuple[str, int, str, int]]:
        """``(input name, input buffer, output name, output buffer)`` per state entry, checked."""
        res = []
        inputs = {name: i for name, i in p["inputs"]}
        for e in p.get("state", []):
            try:
                name, i, out, o = e["input"], int(e["input_buffer"]), e["output"], int(e["output_buffer"])
            except (KeyError, TypeError, ValueError):
                raise ArtifactError(f"program.json of rank {self.rank}: malformed state entry {e!r}") from None
            if inputs.get(name) != i or not 0 <= o < len(self.buffers) or (
                    self.buffers[i].shape, self.buffers[i].dtype) != (self.buffers[o].shape, self.buffers[o].dtype):
                raise ArtifactError(f"program.json of rank {self.rank}: state {out} -> {name} does not pair an "
                                    "input with an output buffer of its shape and type")
            res.append((name, i, out, o))
        return res

    def _fresh_outputs(self, p: dict, run_steps: list) -> list[tuple[str, int, list]]:
        """Per entry of ``program.json``'s ``fresh_outputs`` (rfcs/0003): ``(output name, bytes,
        sites)``, a site ``(pointer array, slot, offset in the output's block, arena pointer)`` for
        each place a kernel call passes the output's storage. :meth:`run` points the sites at a
        fresh block of memory, which the output is then returned in (no copy), and back after."""
        # (of _FRESH_LEAST bytes or more; no index check's count: _checked reads it where it was written)
        return [e for e in self._redirected(p, "fresh_outputs", run_steps)
                if e[1] >= _FRESH_LEAST and e[0] not in self._computed_checks]

    def _redirected(self, p: dict, key: str, run_steps: list) -> list[tuple[str, int, list]]:
        """``(name, bytes, sites)`` per entry of ``program.json``'s ``fresh_outputs`` or
        ``borrowed_inputs`` (``key``), checked: the storage of one output (input) that a run may
        point elsewhere, as :meth:`_fresh_outputs` says; a borrowed input's buffers written by no
        kernel."""
        field = "output" if key == "fresh_outputs" else "input"  # (what an entry names)
        named = dict(p[field + "s"])
        what = "fresh output" if field == "output" else "borrowed input"
        calls = [c for kernels, _ in self._segments for c in kernels]
        kernel_steps = [s for s in run_steps if s["kind"] == "kernel"]
        res = []
        for e in p.get(key, ()):
            try:
                name, off, nbytes, listed = e[field], int(e["offset"]), int(e["bytes"]), set(e["buffers"])
            except (KeyError, TypeError, ValueError):
                raise ArtifactError(f"program.json of rank {self.rank}: malformed {key} entry {e!r}") from None
            bad = None
            if name not in named or named[name] not in listed:
                bad = f"does not list the {field}'s own buffer"
            for bi in listed:
                b = p["buffers"][bi] if isinstance(bi, int) and 0 <= bi < len(self.buffers) else None
                if b is None or b["storage"] != "arena" or not (
                        off <= int(b["offset"]) and int(b["offset"]) + self.buffers[bi].array.nbytes <= off + nbytes):
                    bad = f"lists buffer {bi!r}, which is no arena buffer inside its {nbytes} bytes at offset {off}"
            if bad is None and (int(p["buffers"][named[name]]["offset"]) != off
                                or self.buffers[named[name]].array.nbytes != nbytes):
                bad = f"is not the whole of the {field}'s buffer"
            if bad is None and field == "input" and any(bi in listed for s in run_steps for bi in s["outputs"] + (
                    s["inputs"] if s["kind"] == "collective" else [])):
                bad = "is written by a step or read by a collective"
            if bad is not None:
                raise ArtifactError(f"program.json of rank {self.rank}: {what} {name!r} {bad}")
            sites = []
            for s, (_, _, _, ins, outs) in zip(kernel_steps, calls):
                for arr, which in ((ins, s["inputs"]), (outs, s["outputs"])):
                    sites += [(arr, j, int(p["buffers"][bi]["offset"]) - off, self.buffers[bi].ptr)
                              for j, bi in enumerate(which) if bi in listed]
            res.append((name, nbytes, sites))
        return res

    def _native_program(self) -> tuple:
        """``(sf_run_program, args)`` over the steps after the load steps: a kernel's function and
        pointer arrays, or a null function for a collective, which the library hands back to
        :meth:`_collective_step`."""
        lib = native.load()
        entries: list = []  # per step: (kernel call or None, collective or None)
        for calls, coll in self._segments:
            entries += [(c, None) for c in calls]
            if coll is not None:
                entries.append((None, coll))
        n = len(entries)
        fns = (_VP * n)(*[ctypes.cast(c[0], _VP).value if c else None for c, _ in entries])
        ins = (_VP * n)(*[ctypes.addressof(c[3]) if c else None for c, _ in entries])
        outs = (_VP * n)(*[ctypes.addressof(c[4]) if c else None for c, _ in entries])
        self._step_collectives = [coll for _, coll in entries]
        self._native_arrays = (lib, fns, ins, outs)  # keep alive as long as the program
        self._collective_cb = native.COLLECTIVE_FN(self._collective_step)
        self._native_error: BaseException | None = None
        return lib.sf_run_program, (n, ctypes.addressof(fns), ctypes.addressof(ins), ctypes.addressof(outs),
                                    self._collective_cb, None)

    def _collective_step(self, _ctx: Any, step: int) -> int:
        try:
            self._step_collectives[step]()
        except BaseException as exc:  # noqa: BLE001 - a ctypes callback cannot raise: run() re-raises it
            self._native_error = exc
            return 1
        return 0

    def _kernel_call(self, s: dict) -> tuple:
        try:
            fn = getattr(self._lib, s["symbol"])
        except AttributeError:
            raise ArtifactError(f"kernels.so of rank {self.rank} has no symbol {s['symbol']!r} (node {s['node']})") \
                from None
        fn.argtypes = (_PP, _PP)
        fn.restype = None
        ins = (_VP * max(len(s["inputs"]), 1))(*[self.buffers[i].ptr for i in s["inputs"]])
        outs = (_VP * max(len(s["outputs"]), 1))(*[self.buffers[i].ptr for i in s["outputs"]])
        return fn, ctypes.cast(ins, _PP), ctypes.cast(outs, _PP), ins, outs

    def _make_groups(self) -> dict[str, Communicator]:
        groups = self.manifest.get("mesh", {}).get("groups", {})
        res = {}
        for key in sorted(groups):
            res[key] = self.comm.split(groups[key]) if self.world_size > 1 else self.comm
        return res

    def _collective_call(self, s: dict):
        kind, attrs = s["collective"], s.get("attrs", {})
        group = self.groups.get(s["group"])
        if group is None:
            raise ArtifactError(f"program.json of rank {self.rank}: collective {s['node']} uses mesh axes "
                                f"{s['group']!r}, which mesh groups do not list")
        n = attrs.get("group_size", group.size)
        if n != group.size or attrs.get("group_index", group.rank) != group.rank:
            raise ArtifactError(f"rank {self.rank}: collective {s['node']} expects member {attrs.get('group_index')} "
                                f"of a group of {n}, but the communicator of mesh axes {s['group']} makes it member "
                                f"{group.rank} of {group.size}")
        x = self.buffers[s["inputs"][0]].array
        y = self.buffers[s["outputs"][0]].array
        if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            raise ArtifactError(f"program.json of rank {self.rank}: unknown collective {kind!r} ({s['node']})")
        try:
            # staging buffers allocated once; chunks laid end to end go straight between x and y
            return prepare(group, kind, x, y, attrs)
        except CommError as exc:
            raise ArtifactError(f"program.json of rank {self.rank}: collective {s['node']}: {exc}") from None

    # ------------------------------------------------------------------- running -----------
    @property
    def input_names(self) -> list[str]:
        """The model's input names, in order."""
        return [n for n, _ in self.input_specs]

    @property
    def output_names(self) -> list[str]:
        """The names of the outputs :meth:`run` returns, in order (state outputs excluded)."""
        return [n for n, _ in self.output_specs]

    @property
    def state_names(self) -> dict[str, str]:
        """``{input name: output name}`` of the state the program keeps between runs
        (``compile(state=...)``); empty for a program without state."""
        return {name: out for name, _, out, _ in self.state_specs}

    def read_state(self) -> dict[str, np.ndarray]:
        """The state's current values, keyed by input name: what the next run reads (after a run,
        the outputs it carried over; zeros after :meth:`reset_state`). Fresh numpy arrays (on a
        cuda target copied from the device). On several ranks a state the plan splits (a KV cache
        by heads) is this rank's part: the ``bounds`` of its ``inputs`` entry in the manifest. A
        cache whose heads compile padded or replicated for the ranks (``padded_heads`` in that
        entry) is kept on those heads: the bounds are in the padded whole, which is the model's
        whole taken at ``padded_heads["index"]`` along ``padded_heads["axis"]`` (what :meth:`run`
        does with a whole state it is given)."""
        if self._engine is not None:
            return self._engine.read_state()
        return {name: self.buffers[i].array.copy() for name, i, _, _ in self.state_specs}

    def reset_state(self) -> None:
        """Set every state input to zeros (as at load)."""
        if self._engine is not None:
            self._engine.reset_state()
            return
        for _, i, _, _ in self.state_specs:
            self.buffers[i].array[...] = 0

    def run(self, inputs: Mapping[str, np.ndarray], *, copy_outputs: bool = True) -> dict[str, np.ndarray]:
        """Run the program once.

        Parameters
        ----------
        inputs
            One array per model input, keyed by name, with exactly the compiled shape and dtype
            (every rank receives the full inputs). On a cpu target a C-contiguous numpy input of
            64 KiB or more that no kernel writes is read where it lies, not copied: do not write it
            from another thread during the run. A state input (:attr:`state_names`) may be left
            out: the run then reads the value the previous run left (zeros at first); given, it
            sets that value (whole, or this rank's part of a split state). On a cuda target an input
            may be a cupy array (a bfloat16 or float8 one as its bit pattern, ``uint16`` or ``uint8``:
            cupy has no such types).
        copy_outputs
            ``True`` (default): the outputs are fresh arrays (cpu: arrays of 1 MiB or more reuse
            the memory of outputs of earlier runs that the caller has dropped, never of one it
            still holds, whole or through a view). ``False``: they are views of the
            program's own output buffers (read-only numpy views; cupy arrays cannot be marked so,
            do not write them), valid until the next ``run`` overwrites them (no
            copy: what ``torch.compile(mode="reduce-overhead")`` returns too). On a cuda target
            with numpy inputs the outputs are copied to the host either way.

        Returns
        -------
        dict
            This rank's outputs keyed by the model's output names, those kept as state excepted
            (:meth:`read_state` reads them). On a cuda target the outputs
            are cupy arrays when any input was a cupy array, else numpy.

        Raises
        ------
        InputError
            Naming the input that is missing, unknown, or of the wrong shape or dtype.
        """
        arrays = self._check_inputs(inputs)
        if self._engine is not None:
            return self._checked(self._engine.run(arrays, copy_outputs=copy_outputs))
        # the inputs the kernels read where the caller's arrays lie (no copy before the run)
        lent = self._lent(arrays) if self._borrowed else {}
        self._copy_inputs(arrays, skip=lent)
        # the outputs the kernels can write into fresh memory (no copy after the run)
        fresh = {}
        try:
            for name, base in lent.items():
                for arr, j, delta, _ in self._borrowed[name]:
                    arr[j] = base + delta
            for name, nbytes, sites in self._fresh if copy_outputs else ():
                fresh[name] = block = self._blocks.take(nbytes)
                base = address_of(block)
                for arr, j, delta, _ in sites:
                    arr[j] = base + delta
            self._run_steps()
        finally:
            for sites in [self._borrowed[name] for name in lent] + [sites for _, _, sites in self._fresh if fresh]:
                for arr, j, _, ptr in sites:
                    arr[j] = ptr
        self._copy_state()
        if copy_outputs:
            return self._checked({name: fresh[name].view(buf.dtype).reshape(buf.shape) if name in fresh
                                  else buf.array.copy() for name, buf in self.output_specs})
        views = {name: buf.array.view() for name, buf in self.output_specs}
        for v in views.values():
            v.flags.writeable = False
        return self._checked(views)

    def _checked(self, outputs: dict) -> dict:
        """``outputs`` without the index checks' counts (:attr:`_computed_checks`), after raising
        :class:`IndexRangeError` if one is not zero."""
        if not self._computed_checks:
            return outputs
        if self._engine is None:
            counts = self._check_counts  # (cpu: read in the arena, never copied out)
        else:
            counts = [outputs.pop(name) for name in self._computed_checks]
            if type(counts[0]).__module__.startswith("cupy"):  # (device outputs: one copy back for all of them)
                import cupy

                counts = cupy.stack(counts).get()
        for c, bad in zip(self._computed_checks.values(), (int(n) for n in counts)):
            if bad:
                nodes = tuple(c["nodes"])
                where = "" if c.get("column") is None else f" (column {c['column']} of its last dim)"
                raise IndexRangeError(
                    f"rank {self.rank}: {bad} value(s) of the index tensor that node {nodes[0]!r}"
                    + (f" (and {list(nodes[1:])})" if len(nodes) > 1 else "") + f" reads{where} lay outside "
                    f"[{c['lo']}, {c['hi']}], computed in the graph from this run's inputs (positions past a "
                    "position table?); the compiled kernels clamped them into the axis, so this run's outputs are "
                    "wrong and not returned (a state it wrote is too: reset_state)", nodes)
        return outputs

    def _run_steps(self) -> None:
        """The steps of one run (cpu), on the native runner when there is one."""
        if self._native is not None:
            run, args = self._native
            if run(*args):
                exc, self._native_error = self._native_error, None
                if exc is None:
                    raise ShardflowError(f"rank {self.rank}: the native runner stopped without an error")
                raise exc
        else:
            for calls, coll in self._segments:
                for fn, a, b, _, _ in calls:
                    fn(a, b)
                if coll is not None:
                    coll()

    def _external_regions(self, p: dict, verify: bool, map_weights: bool) -> dict[int, np.ndarray]:
        """The regions of program.json's ``external_weights`` file (an earlier shape variant's weights,
        which this variant's compile did not store again) its buffers read: those held already (given by
        :class:`~shardflow.runtime.variants.VariantProgram`), the others read from the file (its other
        bytes hashed when verifying, not kept)."""
        sizes: dict[int, int] = {}
        for b in p["buffers"]:
            if b["storage"] == "external":
                sizes[int(b["offset"])] = max(sizes.get(int(b["offset"]), 0), buffer_nbytes(b))
        if not sizes:
            return {}
        ext = p.get("external_weights")
        if not isinstance(ext, dict) or not {"file", "bytes", "sha256"} <= set(ext):
            raise ArtifactError(f"program.json of rank {self.rank} in {str(self.directory)!r} has buffers in external "
                                "weights but no valid external_weights entry (file, bytes, sha256)")
        res = {off: a for off, a in self._external_given.items() if off in sizes and a.nbytes == sizes[off]}
        need = sorted((off, n) for off, n in sizes.items() if off not in res)
        if need:
            total = int(ext["bytes"])
            if any(off < 0 or off + n > total for off, n in need):
                raise ArtifactError(f"program.json of rank {self.rank}: an external weights buffer lies outside "
                                    f"{ext['file']!r}'s {total} bytes")
            gaps = [(a, b - a, None) for a, b in uncovered(need, total)]  # (the bytes no buffer here reads)
            data = read_weights((self.directory / ext["file"]), total, ext["sha256"] if verify else None,
                                mapped=map_weights, skip=gaps)
            res.update({off: data[off:off + n] for off, n in need})
        return res

    def device_region(self, storage: str, offset: int, nbytes: int):
        """A cuda program's device bytes ``[offset, offset + nbytes)`` of its ``storage`` (``weights``, or
        ``external``: an earlier shape variant's file), a view of the array holding them (what a variant
        loaded later reads instead of uploading them again); ``None`` for a cpu program."""
        return None if self._engine is None else self._engine.region(storage, offset, nbytes)

    @property
    def borrowed_weights_bytes(self) -> int:
        """Bytes of this program's weights read from another program's memory (a shape variant's weights
        alike in a variant loaded before it: runtime/variants.py; a twin's, all of them; a cuda program's,
        on the device); its own copy holds the rest."""
        if self._engine is not None:
            return self._engine.borrowed_bytes
        given = {off for off, a in self._external_given.items() if self.external_regions.get(off) is a}
        held = (self.weights.nbytes if self._shared_weights is not None  # (a twin: all of them)
                else sum(a.nbytes for a in self._borrowed_weights.values()))
        return held + sum(self.external_regions[off].nbytes for off in given)

    @property
    def scratch_bytes(self) -> int | None:
        """Bytes the cpu kernels' scratch buffers hold now, beside the arena and the weights: each thread
        keeps, per slot, the largest buffer its kernels asked for so far (a conv's padded image, GEMM
        packing, im2col), for the process's lifetime, so after a run this is what the program's runs hold.
        ``memory_budget_bytes`` does not count it. ``None`` for a cuda program, or a kernel library built
        before Shardflow counted it."""
        if self._lib is None:
            return None
        try:
            fn = self._lib.sf_rt_workspace_bytes
        except AttributeError:
            return None
        fn.argtypes, fn.restype = (), ctypes.c_size_t
        return int(fn())

    def profile(self, inputs: Mapping[str, np.ndarray], *, repeat: int = 10, warmup: int = 1) -> list[dict]:
        """Time every step of the program on ``inputs``: ``repeat`` runs, step by step, with a
        timer around each kernel call and each collective (after ``warmup`` untimed runs).

        The runs go through Python one step at a time instead of the native runner, so their sum is
        a little above :meth:`run`'s time (BERT-base on 2 cpu ranks, 221 steps: 149.0 ms against
        148.1 ms). A collective's
        time includes waiting for the slowest member of its group: compare ranks to tell the wait
        from the transfer. Collective: every rank of a multi-rank program calls it together. A
        program with state (``compile(state=...)``) advances it on every run, as :meth:`run` does
        (the copies of the states not written in place are not timed). A cuda program's steps are
        launched one by one (no CUDA graph) and timed on the GPU by CUDA events between them on the
        rank's stream (:meth:`CudaEngine.timed_run`): each kernel's device time, without its launch.

        Returns
        -------
        list of dict
            Per step, in program order: ``index``, ``kind`` (``kernel`` or ``collective``),
            ``node`` (the ONNX node; a fused kernel is named after its last node), ``what`` (the
            op type or the collective) and ``ms``, the median over the runs.
        """
        self._step_by_step("profile", "repeat", repeat, warmup, inputs)
        events: list[dict] = []
        for _ in range(repeat):
            self.traced_run(inputs, events)
        n0 = self.load_steps  # run once at load: not timed
        n = len(self.program["steps"]) - n0
        med = np.median(np.array([e["end_ns"] - e["start_ns"] for e in events], float).reshape(repeat, n), axis=0)
        return [{"index": n0 + k, "ms": float(med[k]) / 1e6, **self._step_record(k)} for k in range(n)]

    def _step_record(self, k: int) -> dict:
        """``kind``, ``node`` and ``what`` (op type or collective) of the ``k``-th step after the load."""
        s = self.program["steps"][self.load_steps + k]
        return {"kind": s["kind"], "node": s["node"],
                "what": s.get("op_type", "") if s["kind"] == "kernel" else s["collective"]}

    def _step_by_step(self, what: str, key: str, runs: int, warmup: int, inputs) -> None:
        """Before :meth:`profile` or :meth:`trace` (``what``) step through ``runs`` runs from Python: bad
        counts refused; the warmup runs."""
        if runs < 1 or warmup < 0:
            raise ValueError(f"{what}: {key} = {runs} must be at least 1 and warmup = {warmup} at least 0")
        for _ in range(warmup):
            self.run(inputs, copy_outputs=False)

    def _step_calls(self) -> list:
        """The steps' calls (cpu) in program order, one a step: the segments hold kernels, then the
        collective after them."""
        return [c for kernels, coll in self._segments
                for c in [functools.partial(fn, a, b) for fn, a, b, _, _ in kernels] + ([coll] if coll else [])]

    def trace(self, inputs: Mapping[str, np.ndarray], *, runs: int = 1, warmup: int = 1) -> list[dict]:
        """One event per step of ``runs`` runs of ``inputs`` (after ``warmup`` untimed ones), each with
        its start and end on this process's monotonic clock (``time.perf_counter_ns``): a timeline of
        where the time goes and where a rank waits (``shardflow run --trace`` merges the ranks' into one
        Chrome trace). The runs step from Python, as :meth:`profile`'s do (cuda: CUDA events between the
        steps, their times on the GPU's clock placed from the host's clock when the run was launched).
        Collective on several ranks.

        Returns
        -------
        list of dict
            Per step and run: ``kind`` (``kernel`` or ``collective``), ``node``, ``what`` (op type or
            collective), ``run``, ``start_ns``, ``end_ns``.
        """
        self._step_by_step("trace", "runs", runs, warmup, inputs)
        events: list[dict] = []
        for r in range(runs):
            self.traced_run(inputs, events, run=r)
        return events

    def traced_run(self, inputs: Mapping[str, np.ndarray], events: list, **tags) -> dict[str, np.ndarray]:
        """:meth:`run` (fresh outputs) stepping from Python, each step's start and end appended to
        ``events`` (as :meth:`trace` gives them, with ``tags`` added: a pipeline's microbatch)."""
        arrays = self._check_inputs(inputs)
        clock = time.perf_counter_ns
        if self._engine is not None:
            t0 = clock()
            spans, outs = self._engine.timed_run(arrays)
            events += [{**self._step_record(k), "start_ns": t0 + int(a * 1e6), "end_ns": t0 + int(b * 1e6), **tags}
                       for k, (a, b) in enumerate(spans)]
            return self._checked(outs)
        self._copy_inputs(arrays)
        for k, call in enumerate(self._step_calls()):
            t0 = clock()
            call()
            events.append({**self._step_record(k), "start_ns": t0, "end_ns": clock(), **tags})
        self._copy_state()
        return self._checked({name: buf.array.copy() for name, buf in self.output_specs})

    def _copy_state(self) -> None:
        """The state outputs not written in place into their inputs (cpu; after the steps)."""
        for x, y in self._state_copies:
            np.copyto(x, y)

    def _lent(self, arrays: Mapping[str, Any]) -> dict[str, int]:
        """``{input name: address}`` of the given inputs the kernels read in place
        (``program.json``'s ``borrowed_inputs``): numpy arrays of 64 KiB or more (a smaller copy
        costs less than pointing the kernels at it), C-contiguous, their elements aligned (no cpu
        kernel assumes more of a tensor: only their own scratch is 64-byte aligned), and outside
        the arena (an output view of the last run, ``copy_outputs=False``, is overwritten while
        the kernels run)."""
        lo, hi = self._arena_span
        res = {}
        for name in self._borrowed:
            a = arrays.get(name)
            if type(a) is np.ndarray and a.flags.c_contiguous and a.flags.aligned:
                addr = a.ctypes.data
                if addr >= hi or addr + a.nbytes <= lo:
                    res[name] = addr
        return res

    def _copy_inputs(self, arrays: Mapping[str, Any], skip: Container[str] = ()) -> None:
        for name, buf in self.input_specs:
            if name in arrays and name not in skip:  # (a state input left out keeps its value)
                a = arrays[name]
                np.copyto(buf.array, a.get() if type(a).__module__.startswith("cupy") else a)

    def _check_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(inputs, Mapping):
            raise InputNameError(f"run() takes a dict of input name -> array, got {type(inputs).__name__}")
        names = {n for n, _ in self.input_specs}
        unknown = sorted(set(inputs) - names)
        if unknown:
            raise InputNameError(f"unknown input(s) {unknown}; the model's inputs are {self.input_names}", unknown[0])
        res = {}
        for name, buf in self.input_specs:
            if name not in inputs and name in self._state_inputs:
                if name in self._index_checks:  # a state carried over from the last run
                    self._check_indices(name, self._state_value(name), carried=True, split=name in self._parts)
                continue
            if name not in inputs:
                raise InputNameError(f"missing input {name!r}; pass an array for each of {self.input_names}", name)
            a = inputs[name]
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                a = np.asarray(a)
            whole, part = self._parts.get(name, (buf.shape, None))
            given = a  # (index checks on the whole, as every rank has it: all refuse the run or none)
            if part is not None and tuple(a.shape) == whole:
                if name in self._padded:  # (the model's whole taken to the padded heads the program keeps)
                    axis, index = self._padded[name]
                    a = a[(slice(None),) * axis + (index[part[axis]].tolist(),)]
                    part = part[:axis] + (slice(None),) + part[axis + 1:]
                a = a[part]  # this rank's part of the whole
            if tuple(a.shape) != buf.shape:
                also = f" (or its part {buf.shape} on this rank)" if part is not None else ""
                raise InputShapeError(f"input {name!r} has shape {a.shape}, the program was compiled for "
                                      f"{whole}{also}; compile again with input_shapes to change it", name)
            if a.dtype != buf.dtype and buf.dtype.kind == "V" and a.dtype == np.dtype(f"V{buf.dtype.itemsize}"):
                a = a.view(buf.dtype)  # how np.save / np.savez store ml_dtypes' bfloat16 and float8 (np.load: V2, V1)
            device_bits = (self._engine is not None and buf.dtype.kind == "V" and type(a).__module__.startswith("cupy")
                           and a.dtype == np.dtype(f"u{buf.dtype.itemsize}"))  # (cupy has no such types: their bits)
            if a.dtype != buf.dtype and not device_bits:
                raise InputDtypeError(f"input {name!r} has dtype {a.dtype}, the program expects {buf.dtype}; "
                                      f"convert it with .astype('{buf.dtype}')", name)
            if name in self._index_checks:
                self._check_indices(name, given)
            res[name] = a
        return res

    def _state_value(self, name: str):
        """The current value of the state input ``name`` (a view of its buffer, on the device for cuda)."""
        if self._engine is not None:
            return next(view for n, view, _ in self._engine.inputs if n == name)
        return next(buf.array for n, buf in self.input_specs if n == name)

    def _check_indices(self, name: str, a, carried: bool = False, split: bool = False) -> None:
        """Raise :class:`InputIndexError` when a value of the input ``name`` (``a``, whole) lies outside
        a range an op reads it in; ``split``: ``a`` is this rank's part of a state, checked with every
        other rank's (one all-reduce of the extremes), so that all ranks refuse the run or none."""
        low, high = (int(a.min()), int(a.max())) if a.size else (None, None)  # (cupy: two scalars copied back)
        if split and self.world_size > 1:
            edge = np.iinfo(np.int64)
            both = np.array([edge.min, edge.min] if low is None else [min(-low, edge.max), min(high, edge.max)],
                            np.int64)
            if type(a).__module__.startswith("cupy"):  # (nccl takes device arrays)
                import cupy

                both = cupy.asarray(both)
            both = self.comm.all_reduce(both, "max")
            both = both.get() if type(both).__module__.startswith("cupy") else both
            if int(both[1]) != edge.min:
                low, high = -int(both[0]), int(both[1])
        if low is not None:
            refuse_indices(name, low, high, self._index_checks[name], carried)

    def twin(self) -> "RankProgram":
        """Another instance of this program on the same communicator, with an arena of its own (its
        activations and states) and this one's weights: read from this program's memory, on the device
        too for cuda, not loaded again (as a shape variant reads the weights another holds alike). A
        pipeline stage keeps one per microbatch when it holds states (runtime/pipeline.py). Collective
        where the program splits sub-communicators: every rank of the program calls it."""
        # (the files were checked when this program loaded them; a cuda program's device arrays of weights,
        # the whole file's or the regions a shape variant read from another, are handed on as they are)
        return RankProgram(self.out_dir, self.rank, self.comm, verify=False, map_weights=self._map_weights,
                           external_weights=self.external_regions, shared_weights=self.weights,
                           borrowed_weights={off: (a, self._borrowed_sha[off])
                                             for off, a in self._borrowed_weights.items()},
                           device_weights=dict(self._engine.regions) if self._engine is not None else None)

    def close(self) -> None:
        """Free the sub-communicators (the world communicator belongs to the caller)."""
        for g in getattr(self, "groups", {}).values():
            if g is not self.comm:
                g.close()
        self.groups = {}

    def __repr__(self) -> str:
        return (f"RankProgram(rank {self.rank} of {self.world_size}, {self._n_kernels} kernels, "
                f"{self._n_collectives} collectives, inputs {self.input_names}, outputs {self.output_names})")
