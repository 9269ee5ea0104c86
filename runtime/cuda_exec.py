"""Running a cuda rank program with cupy: device arena, cubin kernels, CUDA graphs.

The weight shard is uploaded once and the activation arena allocated once on the rank's device;
every kernel step becomes a ``cupy.RawModule`` function with its launch dimensions (from
``program.json``) and its argument views precomputed. After one eager warm-up run the program is
captured into CUDA graphs: one graph for the whole run when every collective can be captured
(world size 1, or NCCL: each collective is prepared once on fixed staging buffers, see
:mod:`.comm.prepared`, so its copies and NCCL calls are issued inside the graph), else one graph
per run of kernels between collectives, the collectives running eagerly in between (MPI or TCP
with host staging, e.g. several ranks sharing one GPU). Everything is ordered on one stream.

Fresh outputs without a copy: when the program ends with kernels that write program outputs
nothing else touches (:func:`fresh_output_writers`; a model's logits), a run that returns fresh
device arrays (cupy inputs, ``copy_outputs=True``) replays the graph of the steps before them and
launches those kernels on freshly allocated arrays, instead of running them into the arena and
copying their outputs out (206 MB of GPT-2's logits at 8x128).

State (``compile(state=...)``): the state inputs' views are zeroed after the load steps; the
outputs not written in place are copied into them on the device after the last step, inside the
captured graph; a trailing kernel that reads a state input is not moved out of the graph.

A program compiled with ``optimization_config["pdl"]`` has its kernels launched with programmatic
dependent launch (:mod:`.pdl`), eagerly and while graphs are captured alike.
"""
from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Any

import numpy as np

from .artifact import ALIGNMENT, ArtifactError, buffer_dtype, uncovered
from .comm.prepared import prepare
from .errors import MemoryLimitError, ShardflowError, format_bytes
from .pdl import pdl_launcher
from .tma import kernel_args

__all__ = ["CudaEngine", "fresh_output_writers"]

log = logging.getLogger(__name__)


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise ShardflowError(f"running cuda artifacts needs cupy ({exc}); pip install 'shardflow[cuda12]' "
                             "(or [cuda13])") from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise ShardflowError("running cuda artifacts needs a CUDA device; none is visible")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise ShardflowError(f"running cuda artifacts needs a CUDA device ({exc})") from None
    return cupy


def fresh_output_writers(program: dict) -> tuple[int, frozenset[int]]:
    """The kernels at the end of ``program`` (a ``program.json``) that can write straight into
    fresh output arrays: ``(how many trailing steps, the buffers they write)``. Each of those steps
    is a kernel whose every output buffer is a program output that no step reads and no other
    step writes, that is neither a program input nor weights, and that only one output name
    returns, and which reads no state input (the state is copied before they run); the run of such steps must end
    the program (so nothing after them reuses what they read) and not reach into the steps run at
    load (``load_steps``). ``(0, frozenset())`` if none."""
    steps = program["steps"]
    named = Counter(int(i) for _, i in program["outputs"])
    outputs = {i for i, k in named.items() if k == 1}  # (a buffer under two names: one copy for each)
    inputs = {int(i) for _, i in program["inputs"]}
    read = {int(i) for s in steps for i in s.get("inputs", ())}
    writers = Counter(int(i) for s in steps for i in s.get("outputs", ()))
    buffers = program["buffers"]
    state = {int(e["input_buffer"]) for e in program.get("state", ())}
    n = 0
    for s in reversed(steps[int(program.get("load_steps", 0)):]):
        outs = [int(i) for i in s.get("outputs", ())]
        if s["kind"] != "kernel" or not outs or state & {int(i) for i in s.get("inputs", ())} or any(
                i not in outputs or i in read or i in inputs or writers[i] != 1
                or buffers[i]["storage"] in ("weights", "external")
                for i in outs):
            break
        n += 1
    return n, frozenset(int(i) for s in steps[len(steps) - n:] for i in s["outputs"])


class CudaEngine:
    """Device state and the run loop of one cuda rank program (used by ``RankProgram``)."""

    def __init__(self, prog, use_graph: bool = True, pdl: bool = False):
        cp = _cupy()
        self.cp = cp
        self.prog = prog
        self.pdl = pdl  # kernels compiled for programmatic dependent launch, launched so (runtime/pdl.py)
        p = prog.program
        self.device = cp.cuda.Device().id
        self.sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
        compiled_for = getattr(prog, "manifest", {}).get("sm_count")
        if compiled_for and int(compiled_for) != self.sms:  # (correct either way; only the sizing is off)
            log.warning("rank %s: its kernels were sized for %d multiprocessors and this GPU has %d: recompile "
                        "with optimization_config['sm_count'] = %d (or on this machine) for the best tiles and "
                        "splits", getattr(prog, "rank", "?"), int(compiled_for), self.sms, self.sms)
        self.stream = cp.cuda.Stream(non_blocking=True)
        out_of_memory = getattr(getattr(cp.cuda, "memory", None), "OutOfMemoryError", MemoryError)
        # weights regions another shape variant holds on this device: {("weights" | "external", offset): array}
        given = dict(getattr(prog, "device_weights", None) or {})
        try:
            with self.stream:
                self.regions = self._upload_weights(prog, given)
                self.arena = cp.zeros(max(int(p["arena_bytes"]), 1), cp.uint8)
        except out_of_memory as exc:  # (cupy's own error names no program)
            raise MemoryLimitError(
                f"rank {getattr(prog, 'rank', '?')}: the program in {str(prog.directory)!r} needs "
                f"{format_bytes(int(prog.weights.nbytes))} of weights and {format_bytes(int(p['arena_bytes']))} of "
                f"working memory (its arena) on GPU {self.device}, which could not allocate them ({exc}); run it on "
                "a GPU with more free memory, split the model over more ranks, or compile it for smaller input "
                "shapes") from None
        #: bytes of weights this program reads from arrays another program put on the device
        self.borrowed_bytes = sum(int(a.nbytes) for a in given.values()
                                  if any(a is r for r in self.regions.values()))
        self.views = []
        for b in p["buffers"]:
            dtype = buffer_dtype(b["dtype"], device=True)
            shape = tuple(b["shape"])
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            off = int(b["offset"])
            if b["storage"] == "arena":
                self.views.append(self.arena[off:off + n].view(dtype).reshape(shape))
                continue
            self.views.append(self.region(b["storage"], off, n).view(dtype).reshape(shape))
        self.inputs = [(name, self.views[i], prog.buffers[i]) for name, i in p["inputs"]]
        self.outputs = [(name, int(i), self.views[i]) for name, i in p["outputs"]]
        path = prog.directory / p.get("kernels_file", "kernels.cubin")
        steps = p["steps"]
        self.module = None
        if any(s["kind"] == "kernel" for s in steps):
            try:
                self.module = cp.RawModule(path=str(path))
            except Exception as exc:  # noqa: BLE001 - cupy raises several types for a bad cubin
                raise ArtifactError(f"cannot load {str(path)!r} on device {self.device}: {exc}") from None
        # the leading steps computed from constants alone (kernels: RankProgram checked) run once, now
        n_load = int(p.get("load_steps", 0))
        with self.stream:
            self._run_segment_kernels([self._launch(s) for s in steps[:n_load]])
        # state: (input view, output view) per entry; the pairs not written in place are copied
        self.state = [(e["input"], self.views[int(e["input_buffer"])], self.views[int(e["output_buffer"])])
                      for e in p.get("state", ())]
        self.state_copies = [(x, y) for _, x, y in self.state if x.data.ptr != y.data.ptr]
        self.reset_state()
        steps = steps[n_load:]
        segments: list[tuple[list, Any]] = []
        launches: list = []
        self.capturable = True
        n_tail, self.fresh_buffers = fresh_output_writers(p)
        self.tail = []  # (launch, [(argument position, buffer)]) of the kernels that may write fresh outputs
        for k, s in enumerate(steps):
            if s["kind"] == "kernel":
                launches.append(self._launch(s))
                if k >= len(steps) - n_tail and launches[-1] is not None:
                    outs = [(len(s["inputs"]) + j, int(i)) for j, i in enumerate(s["outputs"])]
                    self.tail.append((launches[-1], outs))
            else:
                fn, safe = self._collective(s)
                self.capturable &= safe
                segments.append((launches, fn))
                launches = []
        if launches:
            segments.append((launches, None))
        self.segments = segments
        self.body = segments  # the same without the trailing kernels (they come after the last collective)
        if n_tail:
            last, _ = segments[-1]
            self.body = segments[:-1] + [(last[:len(last) - n_tail], None)]
        self.use_graph = use_graph
        self.graphs: dict | None = None  # "all" / "body" -> the captured graphs
        self.runs = 0

    def _upload_weights(self, prog, given: dict) -> dict:
        """The program's weights on the device: ``{(storage, offset): array}``. Without ``given`` one array
        of its whole weights file; otherwise the given arrays (regions alike in a shape variant loaded
        before, on this device) and, uploaded, the stretches of the file between them and each region of
        the external weights file (``storage`` ``external``: an earlier variant's file) not given."""
        cp = self.cp
        p = prog.program
        total = int(prog.weights.nbytes)
        weights = {off: a for (kind, off), a in given.items() if kind == "weights"}
        if not weights:
            res = {("weights", 0): cp.asarray(prog.weights) if total else cp.zeros(1, cp.uint8)}
        else:
            spans = sorted((off, int(a.nbytes)) for off, a in weights.items())
            if any(off < 0 or off + n > total for off, n in spans):
                raise ArtifactError(f"rank {getattr(prog, 'rank', '?')}: a weights region given by another shape "
                                    f"variant lies outside this program's {total} bytes of weights")
            res = {("weights", off): a for off, a in weights.items()}
            for a, b in uncovered(spans, total):  # (each from an aligned offset: its buffers keep their alignment)
                a -= a % ALIGNMENT
                res[("weights", a)] = cp.asarray(prog.weights[a:b])
        external = getattr(prog, "external_regions", None) or {}
        for b in p["buffers"]:
            if b["storage"] not in ("weights", "arena", "external"):
                raise ArtifactError(f"rank {getattr(prog, 'rank', '?')}: buffer {b['name']} has storage "
                                    f"{b['storage']!r}, which the cuda engine does not read")
            key = ("external", int(b["offset"]))
            if b["storage"] == "external" and key not in res:
                res[key] = given[key] if key in given else cp.asarray(external[key[1]])
        return res

    def region(self, storage: str, offset: int, nbytes: int):
        """The device bytes ``[offset, offset + nbytes)`` of the program's ``storage`` (``weights`` or
        ``external``), as a view of the array that holds them."""
        for (kind, start), a in self.regions.items():
            if kind == storage and start <= offset and offset + nbytes <= start + int(a.nbytes):
                return a[offset - start:offset - start + nbytes]
        raise ArtifactError(f"rank {self.prog.rank}: no {storage} bytes [{offset}, {offset + nbytes}) on the device "
                            "(a buffer across a region given by another shape variant, or outside the weights)")

    def _launch(self, s: dict):
        launch = s.get("launch") or {}
        if "grid" not in launch or "block" not in launch:
            raise ArtifactError(f"program.json of rank {self.prog.rank}: kernel {s['node']} has no launch dimensions")
        try:
            fn = self.module.get_function(s["symbol"])
        except Exception:  # noqa: BLE001
            raise ArtifactError(f"the cubin of rank {self.prog.rank} has no kernel {s['symbol']!r} ({s['node']})") \
                from None
        grid, block = tuple(launch["grid"]), tuple(launch["block"])
        args = tuple(self.views[i] for i in list(s["inputs"]) + list(s["outputs"]))
        if 0 in grid:
            return None  # nothing to compute (empty output)
        if launch.get("persistent") and grid[0] > self.sms:  # blocks loop over the work: one per SM
            cluster = int(launch.get("cluster", 1))  # (whole clusters: the grid a multiple of their size)
            grid = (max(cluster, self.sms - self.sms % cluster),) + grid[1:]
        if launch.get("tensor_maps"):  # TMA-fed kernels: the buffers' addresses are fixed from here on
            args = kernel_args(launch["tensor_maps"], args, f"kernel {s['symbol']} ({s['node']})")
        smem = int(launch.get("shared_mem", 0))
        if smem > 48 * 1024:  # above the default limit a kernel must ask for its dynamic shared memory
            try:
                fn.max_dynamic_shared_size_bytes = smem
            except Exception as exc:  # noqa: BLE001 - cupy raises CUDADriverError
                raise ArtifactError(f"kernel {s['symbol']} ({s['node']}) needs {smem} bytes of shared memory, "
                                    f"which device {self.device} cannot give: {exc}") from None
        if self.pdl:
            fn = pdl_launcher(fn, f"kernel {s['symbol']} ({s['node']})")
        return functools.partial(fn, grid, block, args, shared_mem=smem)

    def _run_tail(self, fresh: dict) -> None:
        """The trailing kernels, writing the output buffers ``fresh`` maps to arrays of their own."""
        for call, outs in self.tail:
            args = list(call.args[2])
            for pos, buf in outs:
                args[pos] = fresh[buf]
            call.func(*call.args[:2], tuple(args), **call.keywords)

    def _collective(self, s: dict):
        prog = self.prog
        kind, attrs = s["collective"], s.get("attrs", {})
        group = prog.groups.get(s["group"])
        if group is None:
            raise ArtifactError(f"program.json of rank {prog.rank}: collective {s['node']} uses mesh axes "
                                f"{s['group']!r}, which the mesh groups do not list")
        if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            raise ArtifactError(f"program.json of rank {prog.rank}: unknown collective {kind!r} ({s['node']})")
        if kind in ("all_reduce", "reduce_scatter") and prog.program["buffers"][s["inputs"][0]]["dtype"] == "bfloat16":
            # (held as 16-bit patterns here, which a backend would sum as integers; the compiler
            # reduces bfloat16 in float32 since session 34)
            raise ArtifactError(f"program.json of rank {prog.rank}: {kind} {s['node']} reduces a bfloat16 buffer, "
                                "which this runtime cannot do on a GPU; compile the model again")
        with self.stream:  # staging buffers are allocated once, here, on the rank's stream
            pc = prepare(group, kind, self.views[s["inputs"][0]], self.views[s["outputs"][0]], attrs)
        return pc, pc.capturable

    # ---------------------------------------------------------------------------------------
    def _run_segment_kernels(self, launches) -> None:
        for f in launches:
            if f is not None:
                f()

    def _eager(self, segments) -> None:
        with self.stream:
            self._run_all(segments)

    def _capture(self, body) -> Any:
        s = self.stream
        with s:
            s.begin_capture()
            try:
                body()
            finally:
                graph = s.end_capture()
        return graph

    def _graphs(self, segments) -> list:
        if self.capturable:
            return [(self._capture(functools.partial(self._run_all, segments)), None)]
        return [(self._capture(functools.partial(self._run_segment_kernels, launches))
                 if any(f is not None for f in launches) else None, coll) for launches, coll in segments]

    def _graph(self, which: str) -> list:
        """The captured graphs of ``"all"`` steps or of the ``"body"`` before the trailing kernels,
        captured on first use."""
        if which not in self.graphs:
            self.graphs[which] = self._graphs(self.segments if which == "all" else self.body)
            log.debug("rank %d: captured %d CUDA graph(s) of %s the steps", self.prog.rank,
                      sum(1 for g in self.graphs[which] if g[0] is not None), which)
        return self.graphs[which]

    def _run_all(self, segments) -> None:
        """Every kernel and collective of ``segments`` in order, then the state copies, on the
        current stream (eagerly or while capturing)."""
        for launches, coll in segments:
            self._run_segment_kernels(launches)
            if coll is not None:
                coll()
        self._copy_state()

    def _copy_state(self) -> None:
        for x, y in self.state_copies:
            x.data.copy_from_device_async(y.data, y.nbytes, self.stream)

    def read_state(self) -> dict:
        with self.stream:
            res = {name: x.get(stream=self.stream) for name, x, _ in self.state}
        self.stream.synchronize()
        return res

    def reset_state(self) -> None:
        with self.stream:
            for _, x, _ in self.state:
                x.fill(0)
        self.stream.synchronize()

    def timed_run(self, inputs) -> tuple[list[tuple[float, float]], dict]:
        """One run launched step by step from Python (no graph), a CUDA event recorded on the rank's stream
        before the first step and after each: ``(times, outputs)``, ``times`` each step's (start, end) in
        milliseconds from the first event (the GPU's own clock: a step's launch overhead is not in it),
        ``outputs`` copies, on the device when an input was (a pipeline stage's sends stay there), else
        on the host, as :meth:`run` returns them."""
        cp = self.cp
        device_io = any(type(a).__module__.startswith("cupy") for a in inputs.values())
        self._set_inputs(inputs)
        calls = [c for launches, coll in self.segments for c in list(launches) + ([coll] if coll is not None else [])]
        marks = [cp.cuda.Event() for _ in range(len(calls) + 1)]
        with self.stream:
            marks[0].record(self.stream)
            for call, mark in zip(calls, marks[1:]):
                if call is not None:  # (an empty output's kernel: nothing launched)
                    call()
                mark.record(self.stream)
            self._copy_state()
            outs = {name: view.copy() if device_io else view.get(stream=self.stream) for name, i, view in self.outputs}
        self.stream.synchronize()
        at = [cp.cuda.get_elapsed_time(marks[0], m) for m in marks]
        return [(at[k], at[k + 1]) for k in range(len(calls))], outs

    def _set_inputs(self, inputs) -> None:
        """The given inputs copied into their device buffers (a state input left out keeps its value)."""
        cp = self.cp
        with self.stream:
            for name, view, _ in self.inputs:
                if name not in inputs:  # a state input left out keeps its value
                    continue
                a = inputs[name]
                if type(a).__module__.startswith("cupy"):
                    cp.copyto(view, a)
                else:
                    h = np.asarray(a, order="C")
                    if h.dtype != view.dtype and h.dtype.kind == "V" and h.dtype.itemsize == view.dtype.itemsize:
                        h = h.view(view.dtype)  # (ml_dtypes' bfloat16 and float8: their bytes on the device)
                    view.set(h, stream=self.stream)

    def run(self, inputs, copy_outputs: bool = True) -> dict:
        cp = self.cp
        device_io = any(type(a).__module__.startswith("cupy") for a in inputs.values())
        self._set_inputs(inputs)
        if self.use_graph and self.graphs is None and self.runs >= 1:
            self.graphs = {}  # captured from now on, each kind on its first use
        fresh = device_io and copy_outputs and bool(self.tail)  # the last kernels write fresh arrays
        if self.graphs is None:
            self._eager(self.body if fresh else self.segments)
        else:
            graphs = self._graph("body" if fresh else "all")
            with self.stream:
                for g, coll in graphs:
                    if g is not None:
                        g.launch(self.stream)
                    if coll is not None:
                        coll()
                if not self.capturable:  # (captured with the steps otherwise)
                    self._copy_state()
        self.runs += 1
        with self.stream:
            if fresh:
                arrays = {i: cp.empty(view.shape, view.dtype) for _, i, view in self.outputs if i in self.fresh_buffers}
                self._run_tail(arrays)
                outs = {name: arrays[i] if i in arrays else view.copy() for name, i, view in self.outputs}
            elif device_io:  # views of the arena when not copied (valid until the next run)
                outs = {name: view.copy() if copy_outputs else view for name, i, view in self.outputs}
            else:
                outs = {name: view.get(stream=self.stream) for name, i, view in self.outputs}
        self.stream.synchronize()
        return outs
