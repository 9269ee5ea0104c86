"""Shape variants: one out_dir holding a compiled program per set of sizes of the model's named dynamic
dims (``compile_variants``); ``shardflow.runtime.load`` of it runs the variant compiled for the inputs'
shapes (``runtime/variants.py``, rfcs/0003 "Shape variants")."""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from shardflow.runtime.artifact import (atomic_output_dir, buffer_nbytes, list_ranks, read_json, read_manifest,
                                        write_json)
from shardflow.runtime.pipeline import read_pipeline
from shardflow.runtime.variants import VARIANTS_FILE, VARIANTS_FORMAT, VARIANTS_VERSION

from .driver import CompileResult, _compile
from .errors import ConfigError
from .ir.graph import FlowGraph
from .ir.spill import spilling
from .parallel.config import DistributedConfig

__all__ = ["compile_variants", "VariantsResult"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class VariantsResult:
    """What :func:`compile_variants` produced.

    Attributes
    ----------
    out_dir
        The written out_dir (``variants.json`` and one folder per variant).
    variants
        Per variant, as ``variants.json`` lists it: its folder (``dir``), ``dim_sizes`` and the whole
        shape of each input (``inputs``).
    results
        Per variant, its :class:`~shardflow.compiler.CompileResult` (paths inside ``out_dir``).
    shared_weights
        How many ranks' ``weights.bin`` are a hard link to an earlier variant's identical file.
    external_bytes
        Bytes of weights a variant's program reads from an earlier variant's file instead of storing them.
    """

    out_dir: Path
    variants: list[dict]
    results: list[CompileResult]
    shared_weights: int = 0
    external_bytes: int = 0

    def summary(self) -> str:
        lines = [f"{len(self.variants)} shape variants in {self.out_dir}"
                 + (f" ({self.shared_weights} ranks' weights shared with an earlier variant)"
                    if self.shared_weights else "")
                 + (f" ({self.external_bytes:,} bytes of weights stored once, read from an earlier variant's file)"
                    if self.external_bytes else "")]
        for v, res in zip(self.variants, self.results):
            dims = ", ".join(f"{k}={s}" for k, s in v["dim_sizes"].items())
            lines.append(f"== {v['dir']} ({dims})")
            lines.append(res.summary())
        return "\n".join(lines)


def _checked(variants: Any) -> list[dict[str, int]]:
    if isinstance(variants, Mapping) or not isinstance(variants, Sequence) or not variants:
        raise ConfigError("variants must be a non-empty list of {dim name: size} dicts, e.g. "
                          "[{'sequence_length': 64}, {'sequence_length': 128}]")
    res: list[dict[str, int]] = []
    for k, v in enumerate(variants):
        if not isinstance(v, Mapping) or not v:
            raise ConfigError(f"variants[{k}] = {v!r}: give a non-empty {{dim name: size}} dict")
        for name, size in v.items():
            if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ConfigError(f"variants[{k}]: {name!r}: {size!r} is not a dim name with a non-negative int size")
        if dict(v) in res:
            raise ConfigError(f"variants[{k}] = {dict(v)} repeats variants[{res.index(dict(v))}]")
        res.append(dict(v))
    return res


def _run_inputs(listed: dict) -> dict:
    """The inputs a run of the listed variant must be given (its state inputs are optional)."""
    return {n: shape for n, shape in listed["inputs"].items() if n not in listed["state"]}


def _listing(folder: Path, name: str, dims: dict) -> dict:
    """``variants.json``'s entry for the variant compiled into ``folder``: the whole shape of each input
    and the output names (every rank's manifest has them; rank 0's is read), and per rank its large
    weights regions with their checksums (``weights``: a loaded variant reads a region another loaded
    variant holds from there, runtime/variants.py). A variant of pipeline stages (``staged``) is listed
    from its ``pipeline.json``, without weights regions (its stages' files are hard-linked to an earlier
    variant's where alike, :func:`_share_weights`, but not read from a loaded one's memory)."""
    stages = read_pipeline(folder)
    if stages is not None:
        return {"dir": name, "dim_sizes": dims, "staged": True,
                "inputs": {e["name"]: list(e["shape"]) for e in stages["inputs"]},
                "outputs": [e["name"] for e in stages["outputs"]], "world_size": int(stages["world_size"]),
                "state": {e["input"]: e["output"] for st in stages["stages"] for e in st.get("state", [])},
                "weights": {}}
    m = read_manifest(folder / "rank0")
    return {"dir": name, "dim_sizes": dims,
            "inputs": {i["name"]: list(i.get("global_shape", i["shape"])) for i in m["inputs"]},
            "outputs": [o["name"] for o in m["outputs"]], "world_size": int(m["world_size"]),
            "state": {e["input"]: e["output"] for e in m.get("state", [])},
            "weights": {str(r): _weight_regions(folder / f"rank{r}") for r in list_ranks(folder)}}


#: The smallest weights region whose twins in other variants a loaded variant reads from them (smaller
#: ones are not worth their entry: pages are 4 KiB, and masks and position tables are small).
SHARE_MIN_BYTES = 1 << 16


def _weight_sizes(prog: dict) -> dict[int, set[int]]:
    """The sizes of the buffers at each offset of the program's own weights file."""
    sizes: dict[int, set[int]] = {}
    for b in prog["buffers"]:
        if b["storage"] == "weights":
            sizes.setdefault(int(b["offset"]), set()).add(buffer_nbytes(b))
    return sizes


def _weight_regions(rank_dir: Path) -> list[list]:
    """``[offset, nbytes, sha256]`` of every weights region of at least :data:`SHARE_MIN_BYTES` of the
    rank's program (a region: the bytes of one or more buffers at one offset, all of one size)."""
    import hashlib

    prog = read_json(rank_dir / "program.json", "program")
    sizes = _weight_sizes(prog)
    path = rank_dir / prog.get("weights_file", "weights.bin")
    if not sizes or not path.is_file():
        return []
    data = np.memmap(path, np.uint8, mode="r")
    return [[off, n, hashlib.sha256(data[off:off + n]).hexdigest()] for off, ns in sorted(sizes.items())
            if len(ns) == 1 and (n := next(iter(ns))) >= SHARE_MIN_BYTES]


class _WeightsElsewhere:
    """The compile of a shape variant after the first (``driver._compile``'s ``weights_elsewhere``): its
    program's weights regions alike in an earlier variant's file are left there, not written again.
    Per rank, the earlier variant with the most bytes alike is the one read: the program's
    ``external_weights`` names its file (path from the rank folder, size, sha256) and the buffers there
    take storage ``external`` (their offset in that file); the other weights are laid out anew.
    ``moved[rank]``: ``[offset in that file, nbytes, sha256]`` of each region left there."""

    def __init__(self, out: Path, earlier: list[dict]):
        self.out, self.earlier = out, earlier
        self.moved: dict[str, list[list]] = {}

    def __call__(self, rank: int, program: dict, weights: list) -> tuple[dict, list, int]:
        import hashlib

        from shardflow.runtime.artifact import ALIGNMENT

        if not self.earlier:  # (the first variant: nothing to leave elsewhere, nothing to hash)
            return program, weights, int(program["weights_bytes"])
        sizes = _weight_sizes(program)
        mine = {}  # offset -> sha256 of the large regions of one size
        for off, a in weights:
            if a.nbytes >= SHARE_MIN_BYTES and sizes.get(off) == {a.nbytes}:
                mine[off] = hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()
        shas = set(mine.values())
        ref = max(self.earlier, key=lambda v: sum(n for _, n, sha in v["weights"].get(str(rank), [])
                                                   if sha in shas))
        there = {sha: off for off, _, sha in ref["weights"].get(str(rank), []) if sha in shas}
        moved = {off: (there[sha], sha) for off, sha in mine.items() if sha in there}
        if not moved:
            return program, weights, int(program["weights_bytes"])
        where, kept, pos = {}, [], 0
        for off, a in weights:
            if off not in moved:
                where[off] = pos
                kept.append((pos, a))
                pos = -(-(pos + a.nbytes) // ALIGNMENT) * ALIGNMENT
        for b in program["buffers"]:
            if b["storage"] == "weights":
                off = int(b["offset"])
                b["storage"], b["offset"] = ("external", moved[off][0]) if off in moved else ("weights", where[off])
        ref_dir = self.out / ref["dir"] / f"rank{rank}"
        ref_prog = read_json(ref_dir / "program.json", "program")
        ref_file = ref_prog.get("weights_file", "weights.bin")
        program["weights_bytes"] = pos
        program["external_weights"] = {"file": f"../../{ref['dir']}/rank{rank}/{ref_file}",
                                       "bytes": int(ref_prog["weights_bytes"]),
                                       "sha256": read_manifest(ref_dir)["files"][ref_file]["sha256"]}
        nbytes = dict(weights)
        self.moved[str(rank)] = sorted([o, int(nbytes[off].nbytes), sha] for off, (o, sha) in moved.items())
        log.info("rank %d: %d weights regions (%d bytes) left in %s's file", rank, len(moved),
                 sum(n for _, n, _ in self.moved[str(rank)]), ref["dir"])
        return program, kept, pos


def _rank_dirs(folder: Path) -> list[Path]:
    """The rank folders of the program in ``folder``: ``rank{r}``, or each pipeline stage's."""
    stages = read_pipeline(folder)
    parts = [folder / st["dir"] for st in stages["stages"]] if stages is not None else [folder]
    return [p / f"rank{r}" for p in parts for r in list_ranks(p)]


def _share_weights(out: Path, names: list[str]) -> int:
    """Hard-link every rank's ``weights.bin`` to an earlier one whose checksum (in the manifests) is the
    same, in any variant (of pipeline stages: any stage's rank): one file on disk, and pages shared by
    programs that map it. Returns how many links across variants it made."""
    shared = 0
    seen: dict[str, tuple[str, Path]] = {}
    for name in names:
        for d in _rank_dirs(out / name):
            entry = read_manifest(d)["files"].get("weights.bin")
            if entry is None:
                continue
            first_name, first = seen.setdefault(entry["sha256"], (name, d / "weights.bin"))
            if first != d / "weights.bin" and not os.path.samefile(first, d / "weights.bin"):
                tmp = d / ".weights.bin.link"
                os.link(first, tmp)
                os.replace(tmp, d / "weights.bin")
                shared += first_name != name
    return shared


def _moved(res, folder: Path):
    """A variant's compile result with its paths inside ``folder`` (where the out_dir now holds it)."""
    if hasattr(res, "pipeline"):  # (a StagesResult: each stage's own result under it)
        return dataclasses.replace(res, out_dir=folder, stages=[_moved(r, folder / r.out_dir.name)
                                                               for r in res.stages])
    return dataclasses.replace(res, out_dir=folder, rank_dirs=[folder / p.name for p in res.rank_dirs])


def compile_variants(model, *, variants: Sequence[Mapping[str, int]], distributed_config: Mapping[str, Any],
                     optimization_config: Mapping[str, Any] | None = None, out_dir: str | os.PathLike,
                     input_shapes: Mapping[str, Sequence[int]] | None = None,
                     input_values: Mapping[str, Any] | None = None, state: Mapping[str, str] | None = None,
                     dim_sizes: Mapping[str, int] | None = None) -> VariantsResult:
    """Compile ``model`` once per entry of ``variants`` into one out_dir, which
    :func:`shardflow.runtime.load` runs at any of those shapes.

    A compiled program is static; a model whose batch or sequence length is a dynamic dim is compiled
    for each size it will run at. Each entry of ``variants`` gives sizes of the model's named dynamic dims
    (ONNX's ``dim_param``), merged over ``dim_sizes``, and is compiled as :func:`compile` would (its own
    plan, kernels and weights) into ``out_dir/v<k>``; ``out_dir/variants.json`` lists the variants with
    their inputs' shapes. The loaded program (:class:`~shardflow.runtime.variants.VariantProgram`) runs
    the variant compiled for the inputs' shapes, loading it on first use; other shapes are refused, not
    padded. A rank's weights file that comes out byte for byte alike in two variants is one file,
    hard-linked; a variant's large weights regions alike in an earlier variant's file are read
    from that file instead of stored again, and a variant loaded after another reads the regions they
    have alike (listed with their checksums in ``variants.json``) from the loaded one's memory (cuda: its
    device arrays): the parameters are stored and held once however many variants there are.

    Parameters
    ----------
    model
        An ``.onnx`` path, its bytes or an ``onnx.ModelProto`` (not a :class:`FlowGraph`, whose shapes are
        fixed).
    variants
        ``[{"sequence_length": 64}, {"sequence_length": 128}, ...]``: at least one, no two alike, and
        no two giving the inputs the same shapes.
    distributed_config, optimization_config, input_shapes, input_values, dim_sizes
        As for :func:`compile`, the same for every variant. With ``pipeline_stages`` each variant is cut
        and staged for its own shapes (its folder a pipeline's, loaded as a
        :class:`~shardflow.runtime.pipeline.PipelineProgram`); a stage's weights file alike in an earlier
        variant is hard-linked to it, the finer sharing of weights regions is not done.
    state
        As for :func:`compile`: each variant keeps its own state, of its own shapes (a decoding step's
        KV cache per batch size); the variants must differ in the inputs a run is given, not only in the
        state inputs, which runs need not be given.

    Returns
    -------
    VariantsResult

    Raises
    ------
    ConfigError
        A malformed ``variants``, a :class:`FlowGraph` model, or two variants whose inputs have the same
        shapes (a variant's dims that no input has).
    ShardflowError
        Whatever :func:`compile` raises for a variant (logged with the variant's sizes, which Python 3.11+
        also adds to the traceback as a note); no out_dir is left behind.
    """
    checked = _checked(variants)
    if isinstance(model, FlowGraph):
        raise ConfigError("compile_variants takes an ONNX model (path, bytes or ModelProto): a FlowGraph's shapes "
                          "are already fixed; compile it with compile()")
    # (pipeline stages: each variant's own cut, its stages' weights files hard-linked where alike)
    staged = DistributedConfig.from_dict(distributed_config).pipeline_stages != 1
    with atomic_output_dir(out_dir) as tmp:
        results, listed = [], []
        external = 0
        for k, dims in enumerate(checked):
            name = f"v{k}"
            log.info("shape variant %d of %d: %s", k + 1, len(checked), dims)
            elsewhere = None if staged else _WeightsElsewhere(tmp, listed)
            try:
                with spilling(tmp / name):  # (as compile() does)
                    res = _compile(model, distributed_config=distributed_config,
                                   optimization_config=optimization_config, out_dir=tmp / name,
                                   input_shapes=input_shapes, input_values=input_values, state=state,
                                   dim_sizes={**(dim_sizes or {}), **dims}, weights_elsewhere=elsewhere)
            except Exception as exc:
                log.error("shape variant %d (%s) did not compile: %s", k, dims, exc)
                if hasattr(exc, "add_note"):  # (Python 3.11+: the traceback names the variant too)
                    exc.add_note(f"(compiling shape variant {k}, {dims})")
                raise
            results.append(res)
            listed.append(_listing(tmp / name, name, dims))
            if elsewhere is not None and elsewhere.moved:
                listed[-1]["external"] = elsewhere.moved
                external += sum(n for regions in elsewhere.moved.values() for _, n, _ in regions)
        for k, v in enumerate(listed):
            for j in range(k):
                if _run_inputs(listed[j]) == _run_inputs(v):
                    also = " (their state inputs, which a run need not be given, aside)" if v["state"] else ""
                    raise ConfigError(f"variants {j} {checked[j]} and {k} {checked[k]} give the inputs the same shapes "
                                      f"({_run_inputs(v)}){also}: a program cannot tell them apart; drop one")
        shared = _share_weights(tmp, [v["dir"] for v in listed])
        write_json(tmp / VARIANTS_FILE, {"format": VARIANTS_FORMAT, "version": VARIANTS_VERSION, "variants": listed})
    out = Path(out_dir).resolve()
    results = [_moved(res, out / v["dir"]) for res, v in zip(results, listed)]
    log.info("wrote %d shape variants to %s (%d ranks' weights files shared, %d bytes read from an earlier "
             "variant's file)", len(listed), out, shared, external)
    return VariantsResult(out, listed, results, shared, external)
