"""Pipeline stages at run time: a rank of one stage, and the tensors that cross between stages.

:func:`shardflow.compiler.compile` with ``distributed_config["pipeline_stages"]`` writes one out_dir per
stage (``out_dir/stage{s}``) and ``out_dir/pipeline.json`` (compiler/stages.py). Global rank ``r`` runs
stage ``s = r // W`` as that stage's rank ``c = r % W`` (``W``: the ranks of a stage). Loading such an
out_dir (:func:`~shardflow.runtime.load`) returns a :class:`PipelineProgram`, which splits the world
communicator into the stage's ranks (its program's collectives) and the ranks of one ``c`` (one per
stage: the transfers), and on :meth:`~PipelineProgram.run` receives the tensors earlier stages make
for it, runs its stage and sends what later stages read, all in ``pipeline.json``'s one order of
transfers (a rank's own transfers come in that order, so the blocking sends and receives cannot
deadlock). The transfers move device arrays for cuda stages on a device communicator (NCCL), host
arrays otherwise. A run returns the model outputs the rank's stage makes (the last stage's ranks: the
logits); :meth:`~PipelineProgram.gather_outputs` brings every output to rank 0 (what ``shardflow
run --outputs`` writes), once, not in every run.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .artifact import ArtifactError, buffer_dtype, read_versioned

__all__ = ["PIPELINE_FILE", "PipelineProgram", "read_pipeline", "stage_of_rank"]

log = logging.getLogger(__name__)

#: The file naming an out_dir's stages (beside their folders); its ``format`` and ``version``.
PIPELINE_FILE = "pipeline.json"
PIPELINE_FORMAT, PIPELINE_VERSION = "shardflow-pipeline", 1


def read_pipeline(out_dir: str | os.PathLike) -> dict | None:
    """``out_dir/pipeline.json`` checked, or ``None`` for an out_dir without stages."""
    path = Path(out_dir) / PIPELINE_FILE
    spec = read_versioned(path, "pipeline description", PIPELINE_FORMAT, PIPELINE_VERSION)
    if spec is None:
        return None
    stages = spec.get("stages")
    ok = (isinstance(stages, list) and len(stages) > 1 and isinstance(spec.get("stage_world_size"), int)
          and spec["stage_world_size"] >= 1 and spec.get("world_size") == spec["stage_world_size"] * len(stages)
          and all(isinstance(st, dict) and isinstance(st.get("dir"), str) and isinstance(st.get("graph_inputs"), list)
                  for st in stages)
          and isinstance(spec.get("transfers"), list) and isinstance(spec.get("inputs"), list)
          and isinstance(spec.get("outputs"), list)
          and all(isinstance(e, dict) and e.get("kind") in ("cut", "output") for e in spec["transfers"]))
    ranks = spec.get("ranks")
    if ok and ranks is not None:  # (where a rank_map placed the stages: a partition of the world)
        ok = (isinstance(ranks, list) and len(ranks) == len(stages)
              and all(isinstance(r, list) and len(r) == spec["stage_world_size"] for r in ranks)
              and sorted(int(x) for r in ranks for x in r) == list(range(spec["world_size"])))
    if not ok:
        raise ArtifactError(f"{str(path)!r}: malformed pipeline description (stages, stage_world_size, world_size, "
                            "ranks, inputs, outputs, transfers); compile again")
    for st in stages:
        if Path(st["dir"]).name != st["dir"] or not (Path(out_dir) / st["dir"]).is_dir():
            raise ArtifactError(f"{str(path)!r} lists the stage folder {st['dir']!r}, which {str(out_dir)!r} does "
                                "not hold")
    return spec


def _host(a) -> np.ndarray:
    """``a`` as a C-contiguous numpy array (a cuda program's cupy output copied to the host: the
    transfers go through the host communicator)."""
    if not isinstance(a, np.ndarray) and hasattr(a, "get"):
        a = a.get()
    return np.ascontiguousarray(a)


def _device(a):
    """``a`` on the device: a cupy array as it is, a numpy one uploaded (ml_dtypes' bfloat16 and float8 as
    their bit patterns, the dtype a cuda program's device buffers have: :func:`~.artifact.buffer_dtype`)."""
    if type(a).__module__.startswith("cupy"):
        return a
    import cupy

    a = np.ascontiguousarray(a)
    return cupy.asarray(a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "V" else a)


def _rows(a, j: int, parts: int):
    """Microbatch ``j`` of ``parts``: rows ``j * n / parts`` to ``(j + 1) * n / parts`` of ``a``'s dim 0
    (a view; the compile checked that ``parts`` divides it)."""
    if parts == 1:
        return a
    n = a.shape[0] // parts
    return a[j * n:(j + 1) * n]


def _join(arrays: list):
    """The microbatches' outputs joined along dim 0 (numpy, or cupy for a cuda program's)."""
    if not any(type(a).__module__.startswith("cupy") for a in arrays):
        return np.concatenate(arrays, axis=0)
    import cupy

    return cupy.concatenate([cupy.asarray(a) for a in arrays], axis=0)


def stage_ranks(spec: dict) -> list[list[int]]:
    """The global ranks of each stage, in the stage's own rank order: ``pipeline.json``'s ``ranks`` (a
    ``rank_map`` places them), else stage ``s``'s rank ``c`` is global rank ``s * stage_world_size + c``."""
    width = int(spec["stage_world_size"])
    return spec.get("ranks") or [[s * width + c for c in range(width)] for s in range(len(spec["stages"]))]


def stage_of_rank(spec: dict, rank: int) -> tuple[int, int]:
    """``(stage, rank within the stage)`` of global ``rank``."""
    for s, ranks in enumerate(stage_ranks(spec)):
        if int(rank) in ranks:
            return s, ranks.index(int(rank))
    raise ArtifactError(f"pipeline.json places no stage on rank {rank} (its ranks: {stage_ranks(spec)})")


class PipelineProgram:
    """One rank of a program cut into pipeline stages (see the module docstring and :func:`load`).

    It runs like a :class:`~shardflow.runtime.executor.RankProgram`: :meth:`run` takes the model's
    inputs by name (every rank all of them, as for an unstaged program) and returns the outputs its
    stage makes (:attr:`output_names`; :attr:`model_output_names`: all of them);
    :attr:`last` is the stage's own program (its ``directory``, ``manifest``, ``arena``, ``weights``).
    """

    def __init__(self, out_dir: str | os.PathLike, rank: int, comm: Any, spec: dict, **load_kwargs):
        from .executor import RankProgram, WorldSizeError

        self.out_dir = Path(out_dir)
        self.rank = int(rank)
        self.spec = spec
        self.world_size = int(spec["world_size"])
        size = comm.size if comm is not None else 1
        if size != self.world_size or not 0 <= self.rank < self.world_size:
            raise WorldSizeError(f"{str(out_dir)!r} was compiled for {self.world_size} ranks ({len(spec['stages'])} "
                                 f"pipeline stages of {spec['stage_world_size']}); loading rank {rank} with a "
                                 f"communicator of {size}: run exactly {self.world_size} ranks")
        n_stages, width = len(spec["stages"]), int(spec["stage_world_size"])
        self.stage, member = stage_of_rank(spec, self.rank)
        self._ranks = ranks = stage_ranks(spec)
        # (collective on the world: every rank splits the same groups in the same order; a stage's ranks in its
        # own order, and each rank c of a stage with the rank c of every other, in stage order: the transfers)
        self._stage_comm = stage_comm = comm.split(ranks)
        from .comm import host_communicator

        self._world = host_communicator(comm)
        self._stage_spec = spec["stages"][self.stage]
        self.program = RankProgram(self.out_dir / self._stage_spec["dir"], member,
                                   stage_comm if width > 1 else None, **load_kwargs)
        # The cuts' tensors of cuda stages on a device communicator (NCCL) go from device to device, on a
        # communicator split off it; otherwise (cpu stages, or cuda ranks on MPI/TCP) through the host one.
        self._device = self.program.target == "cuda" and not comm.host_only
        self._pipe = (comm if self._device else self._world).split(
            [[ranks[s][c] for s in range(n_stages)] for c in range(width)])
        # A stage keeping states (a KV cache) with microbatches keeps an instance of its program per microbatch,
        # each with its rows of the states, the weights held once (RankProgram.twin; every rank of the stage
        # makes them alike: collective on the stage's communicator).
        self._programs = [self.program]
        if int(spec.get("microbatches", 1)) > 1 and self.program.state_names:
            self._programs += [self.program.twin() for _ in range(int(spec["microbatches"]) - 1)]
        self._inputs = {e["name"]: (tuple(e["shape"]), buffer_dtype(e["dtype"])) for e in spec["inputs"]}
        self._outputs = [e["name"] for e in spec["outputs"]]
        self._state_inputs = {e["name"] for e in spec["inputs"] if e.get("state")}
        self._ranges = {e["name"]: [(int(lo), int(hi), str(op)) for lo, hi, op in e["index_checks"]]
                        for e in spec["inputs"] if e.get("index_checks")}
        self._mine = [e["name"] for e in spec["outputs"] if e["stage"] == self.stage]
        # this rank's part of the cuts' transfers, in their one order: receives (from earlier stages) all
        # come before its sends there
        cuts = [e for e in spec["transfers"] if e["kind"] == "cut"]
        self._receives = [e for e in cuts if e["to"] == self.stage]
        self._sends = [e for e in cuts if e["from"] == self.stage]
        self._last_feeds: dict[str, Any] | None = None
        self._last_prog = 0
        log.debug("rank %d: pipeline stage %d of %d, member %d of %d", self.rank, self.stage, n_stages, member, width)

    # the RankProgram interface the launcher uses ------------------------------------------
    @property
    def last(self):
        """The stage's :class:`~shardflow.runtime.executor.RankProgram`."""
        return self.program

    @property
    def instances(self) -> list:
        """The stage's program instances on this rank: one, or one per microbatch for a stage keeping
        states (:meth:`RankProgram.twin`; the first is :attr:`last`)."""
        return list(self._programs)

    @property
    def input_names(self) -> list[str]:
        return list(self._inputs)

    @property
    def output_names(self) -> list[str]:
        """The model outputs this rank's stage makes (what :meth:`run` returns)."""
        return list(self._mine)

    @property
    def model_output_names(self) -> list[str]:
        """Every output of the model (what :meth:`gather_outputs` returns on rank 0)."""
        return list(self._outputs)

    @property
    def state_names(self) -> dict[str, str]:
        """``{input name: output name}`` of the states this rank's stage keeps (``compile(state=...)``:
        each state lives in the stage holding its ops)."""
        return self.program.state_names

    def read_state(self) -> dict[str, np.ndarray]:
        """The values of this rank's stage's states (:meth:`RankProgram.read_state`); with microbatches,
        the microbatches' values joined along dim 0 (each microbatch's rows of this rank's part)."""
        if len(self._programs) == 1:
            return self.program.read_state()
        parts = [p.read_state() for p in self._programs]
        return {name: np.concatenate([part[name] for part in parts], axis=0) for name in parts[0]}

    def reset_state(self) -> None:
        """Zero this rank's stage's states (every rank calls it to start a new sequence)."""
        for p in self._programs:
            p.reset_state()

    @property
    def scratch_bytes(self) -> int | None:
        """The cpu kernels' scratch buffers of the stage's program (its instances share its library)."""
        return self.program.scratch_bytes

    def _checked(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The inputs checked on every rank against the whole model's (so that all ranks refuse a bad
        call, before any transfer), whether or not this stage reads them."""
        from .executor import InputDtypeError, InputNameError, InputShapeError, refuse_indices

        if not isinstance(inputs, Mapping):
            raise InputNameError(f"run() takes a dict of input name -> array, got {type(inputs).__name__}")
        unknown = sorted(set(inputs) - set(self._inputs))
        if unknown:
            raise InputNameError(f"unknown input(s) {unknown}; the model's inputs are {self.input_names}", unknown[0])
        for name, (shape, dtype) in self._inputs.items():
            if name not in inputs:
                if name in self._state_inputs:  # (kept by its stage's program from the last run)
                    continue
                raise InputNameError(f"missing input {name!r}; pass an array for each of {self.input_names}", name)
            a = inputs[name]
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                a = np.asarray(a)  # (as a stage's program takes it: refused here on every rank if it would be there)
            if tuple(a.shape) != shape:
                raise InputShapeError(f"input {name!r} has shape {tuple(a.shape)}, the program was compiled for "
                                      f"{shape}; compile again with input_shapes to change it", name)
            got = a.dtype
            if got != dtype and not (dtype.kind == "V" and got == np.dtype(f"V{dtype.itemsize}")):
                raise InputDtypeError(f"input {name!r} has dtype {got}, the program expects {dtype}; convert it with "
                                      f".astype('{dtype}')", name)
            if name in self._ranges and np.size(a):
                refuse_indices(name, int(a.min()), int(a.max()), self._ranges[name])
        return {n: inputs[n] for n in self._stage_spec["graph_inputs"] if n in inputs}

    def run(self, inputs: Mapping[str, Any], *, copy_outputs: bool = True) -> dict[str, np.ndarray]:
        """Run this rank's stage on ``inputs`` (the model's, by name) between its receives and sends,
        once per microbatch (``pipeline.json``'s ``microbatches``: dim 0 of every input split into
        that many equal parts, one after another, so that while this stage runs one the next stage
        runs the one before); returns the model outputs the stage makes, the microbatches' rows
        joined along dim 0 (collective: every rank of every stage calls it)."""
        return self._run(inputs, copy_outputs)

    def _run(self, inputs: Mapping[str, Any], copy_outputs: bool, events: list | None = None,
             **tags) -> dict[str, np.ndarray]:
        """:meth:`run`; with ``events``, traced (:meth:`trace`): each transfer and each step of the stage's
        program appended with its start and end, ``tags`` and its ``microbatch``."""
        clock = time.perf_counter_ns
        whole = self._checked(inputs)
        micro = int(self.spec.get("microbatches", 1))
        parts: list[dict] = []
        # (device transfers: the stage runs on device arrays, its inputs uploaded once, so that what it sends
        # stays on the device; what it returns goes to the host when the caller gave host arrays)
        to_host = False
        if self._device:
            import cupy

            to_host = not any(type(a).__module__.startswith("cupy") for a in inputs.values())
            whole = {n: _device(a) for n, a in whole.items()}
            cupy.cuda.get_current_stream().synchronize()  # (uploaded before the program's stream reads them)
        wire = _device if self._device else _host

        def transfer(kind, e, peer, send, recv):
            t0 = clock()
            self._pipe.exchange(send, recv)
            self._pipe.wait()
            if events is not None:
                events.append({"kind": kind, "node": e["name"], "what": f"{kind} stage {peer}", "start_ns": t0,
                               "end_ns": clock(), "microbatch": j, **tags})
        for j in range(micro):
            feeds = {n: _rows(a, j, micro) for n, a in whole.items()}
            for e in self._receives:
                buf = self._buffer(e["shape"], e["dtype"])
                transfer("receive", e, e["from"], {}, {e["from"]: buf})
                feeds[e["name"]] = buf
            # (copied when more microbatches follow: the next run writes over the program's buffers; a stage
            # with states runs microbatch j on its own instance, which holds that microbatch's rows of them)
            self._last_feeds, self._last_prog = feeds, j % len(self._programs)
            prog = self._programs[self._last_prog]
            if events is None:
                got = prog.run(feeds, copy_outputs=copy_outputs or j + 1 < micro)
            else:
                got = prog.traced_run(feeds, events, microbatch=j, **tags)
            for e in self._sends:
                transfer("send", e, e["to"], {e["to"]: wire(got[e["name"]])}, {})
            parts.append({name: got[name] for name in self._mine})
        outs = parts[0] if micro == 1 else {name: _join([p[name] for p in parts]) for name in self._mine}
        return {name: _host(a) for name, a in outs.items()} if to_host else outs

    def _buffer(self, shape: list, dtype: str):
        """An empty receive buffer: on the device for device transfers (cupy, bit patterns for the types
        numpy lacks), else numpy."""
        if self._device:
            import cupy

            return cupy.empty(tuple(shape), buffer_dtype(dtype, device=True))
        return np.empty(shape, buffer_dtype(dtype))

    def gather_outputs(self, outputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Every model output on rank 0, from the first rank of the stage that makes it (``outputs``:
        what :meth:`run` returned on this rank). Collective: every rank calls it; ranks other than 0
        get back their own ``outputs``."""
        res = dict(outputs)
        for e in self.spec["outputs"]:
            source = self._ranks[e["stage"]][0]
            if source == 0:  # (rank 0 made it: it is in outputs already)
                continue
            if self.rank == 0:
                buf = np.empty(e["shape"], buffer_dtype(e["dtype"]))
                self._world.exchange({}, {source: buf})
                res[e["name"]] = buf
            elif self.rank == source:
                self._world.exchange({0: _host(outputs[e["name"]])}, {})
        if self.rank == 0:
            return {name: res[name] for name in self._outputs}
        return dict(outputs)

    def trace(self, inputs: Mapping[str, Any], *, runs: int = 1, warmup: int = 1) -> list[dict]:
        """:meth:`RankProgram.trace` of this rank's part of ``runs`` runs of the pipeline: per microbatch its
        receives (``kind`` ``receive``: the wait for the earlier stage and the copy), the stage program's
        steps and its sends, each with its ``microbatch`` and ``run`` (collective: every rank calls it)."""
        if runs < 1 or warmup < 0:
            raise ValueError(f"trace: runs = {runs} must be at least 1 and warmup = {warmup} at least 0")
        for _ in range(warmup):
            self.run(inputs)
        events: list[dict] = []
        for r in range(runs):
            self._run(inputs, True, events, run=r)
        return events

    def profile(self, inputs: Mapping[str, Any], *, repeat: int = 10, warmup: int = 1) -> list[dict]:
        """The stage's steps timed (:meth:`RankProgram.profile`) on what this rank received in one
        whole run of ``inputs`` (collective: every rank calls it)."""
        self.run(inputs)
        # (on the instance that ran those feeds: another's states would get that microbatch's rows)
        return self._programs[self._last_prog].profile(self._last_feeds, repeat=repeat, warmup=warmup)

    def close(self) -> None:
        """Free the stage's program and the communicators this rank split off the world (which belongs to
        the caller)."""
        for p in self._programs:
            p.close()
        for c in (self._pipe, self._stage_comm):
            c.close()

    def __repr__(self) -> str:
        return (f"PipelineProgram({str(self.out_dir)!r}, rank {self.rank}: stage {self.stage} of "
                f"{len(self.spec['stages'])}, {self.program!r})")
