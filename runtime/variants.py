"""Shape variants: one out_dir holding a program per set of input shapes.

An ONNX model usually leaves dims such as the batch or the sequence length dynamic, and a compiled
program is static. :func:`shardflow.compiler.compile_variants` compiles one program per entry of its
``variants`` (sizes of the model's named dynamic dims) into ``out_dir/v0``, ``out_dir/v1``, ... (each an
ordinary out_dir) and lists them in ``out_dir/variants.json``; :func:`~shardflow.runtime.load` of such an
out_dir returns a :class:`VariantProgram`, whose :meth:`~VariantProgram.run` runs the variant compiled
for the inputs' shapes. A variant is loaded the first time inputs of its shapes come (a multi-rank load
is collective: every rank of an SPMD program runs the same shapes in the same order, as its collectives
already require; every run checks that the ranks chose one variant), and stays loaded; it reads the
large weights regions a loaded variant holds alike from that variant's memory (cuda: its device
arrays). No padding to a larger variant: padding changes what a model computes unless its masks say
otherwise, so shapes no variant was compiled for are an
:class:`~shardflow.runtime.executor.InputShapeError` listing the variants.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .artifact import ArtifactError, ChecksumError, read_versioned

__all__ = ["VARIANTS_FILE", "VariantProgram", "read_variants", "first_variant_dir"]

#: The file naming an out_dir's variants (beside their folders).
VARIANTS_FILE = "variants.json"
#: ``format`` and ``version`` of that file.
VARIANTS_FORMAT, VARIANTS_VERSION = "shardflow-variants", 1


def read_variants(out_dir: str | os.PathLike) -> dict | None:
    """``out_dir/variants.json`` checked (``variants``: per variant its ``dir``, ``dim_sizes``, ``inputs``,
    the whole shape of each input, ``outputs`` and ``world_size``), or ``None`` for an out_dir of one
    program."""
    path = Path(out_dir) / VARIANTS_FILE
    spec = read_versioned(path, "list of shape variants", VARIANTS_FORMAT, VARIANTS_VERSION)
    if spec is None:
        return None
    variants = spec.get("variants")
    if not isinstance(variants, list) or not variants or not all(
            isinstance(v, dict) and isinstance(v.get("dir"), str) and isinstance(v.get("inputs"), dict)
            and isinstance(v.get("outputs"), list) and isinstance(v.get("world_size"), int) for v in variants):
        raise ArtifactError(f"{str(path)!r}: 'variants' must be a non-empty list of {{dir, dim_sizes, inputs, "
                            "outputs, world_size}}")
    for v in variants:
        for key in ("weights", "external"):
            regions = v.get(key, {})
            if not isinstance(regions, dict) or not all(isinstance(rs, list) and all(
                    isinstance(r, list) and len(r) == 3 for r in rs) for rs in regions.values()):
                raise ArtifactError(f"{str(path)!r}: variant {v['dir']!r}'s {key!r} must map ranks to lists of "
                                    "[offset, nbytes, sha256]")
        d = Path(out_dir) / v["dir"]
        if Path(v["dir"]).name != v["dir"] or not d.is_dir():
            raise ArtifactError(f"{str(path)!r} lists the variant folder {v['dir']!r}, which {str(out_dir)!r} does "
                                "not hold")
    return spec


def first_variant_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` itself for an out_dir of one program, else its first variant's folder (every variant
    has the same ranks, target and outputs: what a launcher reads before it loads)."""
    spec = read_variants(out_dir)
    return Path(out_dir) if spec is None else Path(out_dir) / spec["variants"][0]["dir"]


def _describe(inputs: Mapping[str, Any]) -> str:
    return ", ".join(f"{n} {list(s)}" for n, s in inputs.items())


class VariantProgram:
    """A rank's programs of an out_dir of shape variants (see the module docstring and :func:`load`).

    It runs like a :class:`~shardflow.runtime.executor.RankProgram`: :meth:`run` and :meth:`profile`
    take the inputs by name and use the variant compiled for their shapes, loading it on first use
    (nothing is loaded before); :attr:`last` is the program that ran last (its ``directory``,
    ``manifest``, ``arena`` and ``weights``).
    """

    def __init__(self, out_dir: str | os.PathLike, rank: int, comm: Any, spec: dict, **load_kwargs):
        from .executor import WorldSizeError

        self.out_dir = Path(out_dir)
        self.rank = rank
        self.comm = comm
        self.variants: list[dict] = spec["variants"]
        self.world_size = self.variants[0]["world_size"]
        size = comm.size if comm is not None else 1
        if size != self.world_size or not 0 <= rank < self.world_size:
            raise WorldSizeError(f"{str(out_dir)!r} was compiled for {self.world_size} ranks; loading rank {rank} "
                                 f"with a communicator of {size}: run exactly {self.world_size} ranks")
        self._load_kwargs = load_kwargs
        self._programs: dict[int, Any] = {}
        self._held: dict[str, np.ndarray] = {}  # sha256 -> a loaded variant's weights region with those bytes
        self._held_device: dict[str, Any] = {}  # (cuda) sha256 -> the device array of such a region
        self._checked: set[str] = set()  # of those, the ones whose bytes were checked against their sha256
        #: The program that ran last (None before the first run).
        self.last = None
        #: Bytes of weights the loaded variants read from another loaded variant's memory.
        self.borrowed_bytes = 0

    def program(self, k: int):
        """Variant ``k``'s :class:`~shardflow.runtime.executor.RankProgram` (of pipeline stages: its
        :class:`~shardflow.runtime.pipeline.PipelineProgram`), loaded on first use (collective on several
        ranks)."""
        if k not in self._programs and self.variants[k].get("staged"):
            from .pipeline import PipelineProgram, read_pipeline

            folder = self.out_dir / self.variants[k]["dir"]
            self._programs[k] = PipelineProgram(folder, self.rank, self.comm, read_pipeline(folder),
                                                **self._load_kwargs)
        if k not in self._programs:
            from .executor import RankProgram

            # its large weights regions that a loaded variant holds alike are read from there: those of its
            # own file, and those its compile left in an earlier variant's file (external)
            regions = self.variants[k].get("weights", {}).get(str(self.rank), [])
            external = self.variants[k].get("external", {}).get(str(self.rank), [])
            borrowed = {int(off): (self._held[sha], sha) for off, n, sha in regions
                        if sha in self._held and self._held[sha].nbytes == n}
            given = {int(off): self._held[sha] for off, n, sha in external
                     if sha in self._held and self._held[sha].nbytes == n}
            if self._load_kwargs.get("verify", True):
                for sha in {sha for _, sha in borrowed.values()} | {sha for off, _, sha in external
                                                                    if int(off) in given}:
                    self._check_held(sha)
            # (cuda: the device copies of those regions too, which the engine then does not upload again)
            device = {(kind, int(off)): self._held_device[sha] for kind, listed in (("weights", regions),
                                                                                     ("external", external))
                      for off, n, sha in listed if sha in self._held_device and self._held_device[sha].nbytes == n}
            prog = RankProgram(self.out_dir / self.variants[k]["dir"], self.rank, self.comm,
                               borrowed_weights=borrowed, external_weights=given, device_weights=device,
                               **self._load_kwargs)
            self.borrowed_bytes += prog.borrowed_weights_bytes
            for off, n, sha in regions:
                self._held.setdefault(sha, prog.weights[int(off):int(off) + int(n)] if int(off) not in borrowed
                                      else borrowed[int(off)][0])
            for off, n, sha in external:
                if int(off) in prog.external_regions:
                    self._held.setdefault(sha, prog.external_regions[int(off)])
            if prog.target == "cuda":
                for kind, listed in (("weights", regions), ("external", external)):
                    for off, n, sha in listed:
                        self._held_device.setdefault(sha, prog.device_region(kind, int(off), int(n)))
            self._programs[k] = prog
        return self._programs[k]

    def _check_held(self, sha: str) -> None:
        """A held region's bytes against the checksum ``variants.json`` gives them, once, before another
        variant reads them (the variant that holds them checked its whole file, not this list)."""
        if sha in self._checked:
            return
        got = hashlib.sha256(self._held[sha]).hexdigest()
        if got != sha:
            raise ChecksumError(f"{str(self.out_dir / VARIANTS_FILE)!r} lists a weights region with sha256 "
                                f"{sha[:16]}…, but the variant holding it has {got[:16]}… there; the list does not "
                                "fit the variants' files: compile the out_dir again", str(self.out_dir / VARIANTS_FILE))
        self._checked.add(sha)

    def preload(self) -> "VariantProgram":
        """Load every variant now rather than at the first run of its shapes (so that no run pays for a
        load; collective on several ranks: every rank calls it). Returns ``self``."""
        for k in range(len(self.variants)):
            self.program(k)
        return self

    @property
    def staged(self) -> bool:
        """Whether a variant is cut into pipeline stages (its program a
        :class:`~shardflow.runtime.pipeline.PipelineProgram`)."""
        return any(v.get("staged") for v in self.variants)

    @property
    def input_names(self) -> list[str]:
        return list(self.variants[0]["inputs"])

    @property
    def output_names(self) -> list[str]:
        return list(self.variants[0]["outputs"])

    @property
    def state_names(self) -> dict[str, str]:
        """``{input name: output name}`` of the state each variant keeps between its runs (its own, of its
        own shapes: ``compile_variants(state=...)``); empty without state."""
        return dict(self.variants[0].get("state", {}))

    def read_state(self) -> dict[str, np.ndarray]:
        """The state of the variant that ran last (:meth:`RankProgram.read_state`)."""
        if self.last is None:
            from .errors import ShardflowError

            raise ShardflowError("read_state: no variant has run yet (each variant keeps its own state, zeros until "
                                 "its first run)")
        return self.last.read_state()

    def reset_state(self) -> None:
        """Set every loaded variant's state to zeros (as at load)."""
        for p in self._programs.values():
            p.reset_state()

    @property
    def scratch_bytes(self) -> int | None:
        """The cpu kernels' scratch buffers of every variant loaded (each has its own library)."""
        held = [p.scratch_bytes for p in self._programs.values()]
        return None if any(h is None for h in held) else sum(held)

    def select(self, inputs: Mapping[str, Any]) -> int:
        """The index of the variant compiled for the shapes of ``inputs``.

        Raises
        ------
        InputShapeError
            No variant has these shapes (the message lists every variant's).
        """
        from .executor import InputNameError, InputShapeError

        if not isinstance(inputs, Mapping):
            raise InputNameError(f"run() takes a dict of input name -> array, got {type(inputs).__name__}")
        shapes = {n: tuple(np.shape(a) if not hasattr(a, "shape") else a.shape) for n, a in inputs.items()}
        for k, v in enumerate(self.variants):  # (a state input or a missing one does not choose: run() names it)
            if all(shapes.get(n, tuple(s)) == tuple(s) for n, s in v["inputs"].items()):
                return k
        names = [n for n in self.variants[0]["inputs"] if n in shapes]
        given = ", ".join(f"{n} {list(shapes[n])}" for n in names) or "none of the inputs"
        listed = "; ".join(f"{v['dir']}: {_describe(v['inputs'])}" for v in self.variants)
        raise InputShapeError(f"no variant of {str(self.out_dir)!r} was compiled for the inputs' shapes ({given}); "
                              f"its variants take {listed}. Compile one for these shapes (compile_variants' "
                              "variants), or pad the inputs to a variant's shapes where the model's masks allow it",
                              names[0] if names else None)

    def _chosen(self, inputs: Mapping[str, Any]):
        """The program of the variant compiled for the inputs' shapes, loaded. On several ranks, which
        variant every rank chose is gathered first (5.3 us a run on 2 MPI ranks of the 2-core VM): ranks
        given different shapes would run programs whose collectives do not match, which could hang or
        read a shorter message without an error, and a rank given shapes of no variant would leave the
        others waiting; they all raise instead."""
        from .executor import InputShapeError

        try:
            k, refused = self.select(inputs), None
        except InputShapeError as exc:
            k, refused = -1, exc
        if self.world_size > 1:
            from .comm import host_communicator

            chosen = [int(b) for b in host_communicator(self.comm).allgather_bytes(str(k).encode())]
            if refused is None and -1 in chosen:
                raise InputShapeError(f"rank {chosen.index(-1)} was given inputs whose shapes no variant of "
                                      f"{str(self.out_dir)!r} takes (its error says which); every rank refuses the run")
            if refused is None and len(set(chosen)) > 1:
                which = ", ".join(f"rank {r} {self.variants[c]['dir']}" for r, c in enumerate(chosen))
                raise InputShapeError(f"the ranks were given inputs of different shapes, which different variants "
                                      f"take ({which}); every rank of a program runs the same shapes")
        if refused is not None:
            raise refused
        return self.program(k)

    def run(self, inputs: Mapping[str, Any], **kwargs) -> dict[str, np.ndarray]:
        """Run the variant compiled for the inputs' shapes (:meth:`RankProgram.run`'s arguments)."""
        self.last = self._chosen(inputs)
        return self.last.run(inputs, **kwargs)

    def profile(self, inputs: Mapping[str, Any], **kwargs) -> list[dict]:
        """:meth:`RankProgram.profile` of the variant compiled for the inputs' shapes."""
        self.last = self._chosen(inputs)
        return self.last.profile(inputs, **kwargs)

    def trace(self, inputs: Mapping[str, Any], **kwargs) -> list[dict]:
        """:meth:`RankProgram.trace` (or a pipeline's) of the variant compiled for the inputs' shapes."""
        self.last = self._chosen(inputs)
        return self.last.trace(inputs, **kwargs)

    def close(self) -> None:
        for p in self._programs.values():
            p.close()

    def __repr__(self) -> str:
        return (f"VariantProgram(rank {self.rank} of {self.world_size}, {len(self.variants)} variants, "
                f"{len(self._programs)} loaded)")
