"""``shardflow calibrate``: measure the machine the ranks run on and write the cost model's figures.

The planner prices a plan with a roofline per rank (``device``: peak FLOP/s, memory bandwidth)
and an α–β model per mesh axis (``axis_latency_us``, ``axis_bandwidth_GBps``); its defaults
describe H100s on NVLink or a generic cpu server (:mod:`.parallel.cost`). On other machines the
balance between compute and communication is off, and so is the plan (rfcs/0001 has the
measurements that showed it). :func:`calibrate` starts the ranks on this machine, has them

* run two one-rank probe programs compiled for the target, all ranks at once (the ranks share
  the machine as a sharded program's do): a float32 GEMM (``peak_tflops`` = its FLOPs / time)
  and an element-wise ``A + B * s`` of large vectors (``mem_bandwidth_GBps`` = bytes read and
  written / time);
* time all-reduce, all-gather, reduce-scatter and all-to-all of 4 KB to 4 MB per rank along
  every mesh axis, all groups of an axis at once,
* report each host's physical memory and how many ranks run on it (``memory_GB`` of the device:
  the least share of a host's memory a rank has, which the planner keeps a plan without a
  budget within),

and fits each axis's latency and bandwidth to those times *with the cost model's own formulas*
(least squares on relative error), so that the model's collective times match the measured ones
as closely as two numbers per axis allow. The result is a ``distributed_config`` fragment:
``shardflow compile model.onnx --distributed-config machine.json`` uses it as is.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import platform
import socket
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError, ShardflowError

__all__ = ["Calibration", "calibrate", "fit_links", "probe_models", "GEMM_SHAPE", "STREAM_ELEMENTS"]

log = logging.getLogger(__name__)

#: ``(M, K, N)`` of the GEMM probe, float32.
GEMM_SHAPE = (512, 1024, 1024)
#: Elements of each vector of the streaming probe (``C = A + B * s``, float32: 96 MiB moved).
STREAM_ELEMENTS = 8 << 20


def probe_models() -> dict[str, Any]:
    """The probe programs as ONNX models: ``gemm`` (``Y = X @ W``, ``W`` a weight; credited with
    its ``flops``, as the planner counts them) and ``stream`` (``C = A + B * s``: ``A``, ``B``
    weights, ``s`` the one-number input; credited with the ``bytes`` its one kernel reads and
    writes)."""
    from onnx import TensorProto, helper, numpy_helper

    m, k, n = GEMM_SHAPE
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "W")
    gemm = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "calibrate_gemm",
                             [helper.make_tensor_value_info("X", TensorProto.FLOAT, [m, k])],
                             [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])], [w])
    # the vectors are weights and the input one number, so that the run copies no input: the kernel
    # reads A and B and writes C (fused; copy_outputs=False leaves C in place)
    e = STREAM_ELEMENTS
    ab = [numpy_helper.from_array(np.full(e, v, np.float32), name) for name, v in (("A", 1.0), ("B", 2.0))]
    nodes = [helper.make_node("Mul", ["B", "s"], ["Bs"]), helper.make_node("Add", ["A", "Bs"], ["C"])]
    stream = helper.make_graph(nodes, "calibrate_stream", [helper.make_tensor_value_info("s", TensorProto.FLOAT, [1])],
                               [helper.make_tensor_value_info("C", TensorProto.FLOAT, [e])], ab)

    def model(g):
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    return {"gemm": {"model": model(gemm), "flops": 2.0 * m * k * n},
            "stream": {"model": model(stream), "bytes": 12.0 * e}}


def _formula_terms(kind: str, group_size: int, nbytes: float) -> tuple[float, float]:
    """``(c, d)`` such that the cost model prices collective ``kind`` on one axis of
    ``group_size`` ranks at ``c * latency + d / bandwidth`` (seconds, bytes/s)."""
    from .parallel.cost import CostModel
    from .parallel.mesh import DeviceMesh

    mesh = DeviceMesh([group_size])
    c = CostModel(mesh, axis_bandwidth_GBps=1e30, axis_latency_us=1.0).collective(kind, nbytes, 0) / 1e-6
    d = CostModel(mesh, axis_bandwidth_GBps=1.0, axis_latency_us=0.0).collective(kind, nbytes, 0) * 1e9
    return c, d


def fit_links(records: Sequence[dict]) -> dict[int, dict[str, float]]:
    """Fit each mesh axis's latency and bandwidth to measured collective times.

    Parameters
    ----------
    records
        ``{"axis", "group_size", "kind", "nbytes", "seconds"}`` per timing
        (:func:`shardflow.runtime.calibrate.time_collectives`).

    Returns
    -------
    dict
        Per axis: ``latency_us``, ``bandwidth_GBps`` and ``max_rel_error`` (the worst relative
        difference between the fitted model and a measured time).
    """
    by_axis: dict[int, list[dict]] = {}
    for r in records:
        by_axis.setdefault(int(r["axis"]), []).append(r)
    res = {}
    for axis, rs in sorted(by_axis.items()):
        terms = np.array([_formula_terms(r["kind"], int(r["group_size"]), float(r["nbytes"])) for r in rs])
        t = np.array([float(r["seconds"]) for r in rs])
        if np.any(t <= 0):
            raise ShardflowError(f"calibrate: a collective on axis {axis} measured no time; measure again")
        a = terms / t[:, None]  # relative error: rows scaled by 1/t
        x = _nonneg_lstsq(a, np.ones(len(t)))
        if x[1] <= 0:
            raise ShardflowError(f"calibrate: the times on axis {axis} do not grow with the message size, so no "
                                 f"bandwidth fits them ({[f'{v * 1e6:.1f} us' for v in t]}); measure again on an "
                                 "idle machine")
        model = terms @ x
        res[axis] = {"latency_us": float(x[0] * 1e6), "bandwidth_GBps": float(1.0 / x[1] / 1e9),
                     "max_rel_error": float(np.max(np.abs(model - t) / t))}
    return res


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares ``min |a x - b|`` over ``x >= 0`` for two unknowns (the unconstrained
    solution, else the best with one unknown at zero)."""
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    if np.all(x >= 0):
        return x
    best, best_err = np.zeros(2), float(np.sum(b * b))
    for j in range(2):
        col = a[:, j]
        v = max(float(col @ b) / float(col @ col), 0.0) if col @ col > 0 else 0.0
        cand = np.zeros(2)
        cand[j] = v
        err = float(np.sum((a @ cand - b) ** 2))
        if err < best_err:
            best, best_err = cand, err
    return best


@dataclasses.dataclass
class Calibration:
    """What :func:`calibrate` measured and fitted.

    Attributes
    ----------
    config
        The ``distributed_config`` fragment: ``mesh_shape``, ``axis_bandwidth_GBps``,
        ``axis_latency_us`` and ``device`` (``name``, ``peak_tflops``, ``mem_bandwidth_GBps``,
        ``memory_GB`` where the ranks' systems report their memory).
    measured
        The ranks' raw timings (``programs_s``: seconds per probe run; ``collectives``: one
        record per collective, kind, axis and size), the backend and threads per rank.
    links
        :func:`fit_links`'s result per axis.
    """

    config: dict
    measured: dict
    links: dict

    def save(self, path: str | os.PathLike) -> None:
        """Write :attr:`config` as JSON (atomically)."""
        from shardflow.runtime.artifact import write_json

        write_json(path, self.config)

    def report(self) -> str:
        """The fitted figures and, per collective, measured against modeled time."""
        from .parallel.cost import CostModel, DeviceProfile
        from .parallel.mesh import DeviceMesh

        d = self.config["device"]
        lines = [f"device: {d['name']}",
                 f"  peak {d['peak_tflops'] * 1e3:.1f} GFLOP/s (GEMM {'x'.join(map(str, GEMM_SHAPE))}: "
                 f"{self.measured['programs_s']['gemm'] * 1e3:.3f} ms), memory {d['mem_bandwidth_GBps']:.1f} GB/s "
                 f"(add of 2 x {STREAM_ELEMENTS * 4 >> 20} MiB: {self.measured['programs_s']['stream'] * 1e3:.3f} ms)"
                 + (f", {d['memory_GB']:g} GB a rank (its host's memory over its ranks there)" if "memory_GB" in d
                    else ""),
                 f"links ({self.measured['backend']} backend, {self.measured['threads_per_rank']} thread(s) per rank):"]
        shape = self.config["mesh_shape"]
        if not self.links:
            lines[-1] = ("links: none measured (no mesh axis has two ranks or more); the file keeps the defaults, "
                         f"{self.config['axis_bandwidth_GBps']} GB/s and {self.config['axis_latency_us']} us")
            return "\n".join(lines)
        for axis, fit in self.links.items():
            lines.append(f"  axis {axis} ({shape[axis]} ranks): latency {fit['latency_us']:.2f} us, bandwidth "
                         f"{fit['bandwidth_GBps']:.3f} GB/s (worst fit error {fit['max_rel_error'] * 100:.0f}%)")
        lines.append(f"  {'axis':>4}  {'collective':<15}{'per rank':>10}  {'measured':>11}  {'model':>11}")
        dev = DeviceProfile("x", 1.0, 1.0)
        for r in self.measured["collectives"]:
            fit = self.links[r["axis"]]
            cm = CostModel(DeviceMesh([r["group_size"]]), axis_bandwidth_GBps=fit["bandwidth_GBps"],
                           axis_latency_us=fit["latency_us"], device=dev)
            model = cm.collective(r["kind"], r["nbytes"], 0)
            lines.append(f"  {r['axis']:>4}  {r['kind']:<15}{_fmt_bytes(r['buffer_bytes']):>10}  "
                         f"{r['seconds'] * 1e6:8.1f} us  {model * 1e6:8.1f} us")
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def calibrate(mesh_shape: Sequence[int], *, target: str = "cpu", launcher: str | None = None,
              backend: str | None = None, trials: int = 5, timeout_s: float = 900.0) -> Calibration | None:
    """Measure this machine's ranks and links and fit the cost model to them.

    Started plainly, it starts ``prod(mesh_shape)`` local ranks (as ``shardflow run`` does).
    Started as one rank of several (``mpiexec -n N``, ``srun``, torchrun-style variables: e.g.
    ranks on several hosts), this process is that rank: every rank compiles the probes into its
    own temporary folder and rank 0 gathers the timings.

    Parameters
    ----------
    mesh_shape
        Ranks per mesh axis; the ranks of each axis's groups time their collectives together.
    target
        ``cpu`` (the only target measured so far).
    launcher, backend
        How the ranks start and talk, as for ``shardflow run`` (``auto``: mpiexec and MPI when
        installed, else own processes and TCP). The link figures hold for that backend.
    trials
        Timings per figure (the median is kept).
    timeout_s
        Kill the ranks after this long (local ranks only).

    Returns
    -------
    Calibration or None
        ``.config`` is the ``distributed_config`` fragment; ``.save(path)`` writes it. ``None``
        on the ranks other than 0 when started by a launcher.
    """
    from shardflow.runtime.calibrate import run_rank
    from shardflow.runtime.launch import detect_environment, start_ranks

    if target != "cpu":
        raise ConfigError(f"calibrate: target {target!r} is not measured yet (only 'cpu'); for GPUs give "
                          "distributed_config 'device' and the link figures ('axis_bandwidth_GBps', "
                          "'axis_latency_us') by hand")
    shape = [int(d) for d in mesh_shape]
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"calibrate: mesh {list(mesh_shape)!r} needs one or more positive sizes")
    if trials < 1:
        raise ConfigError(f"calibrate: trials = {trials}: need at least 1")
    nproc = int(np.prod(shape))
    env = detect_environment()
    as_rank = env.launched_by != "single"
    if as_rank and env.size != nproc:
        raise ConfigError(f"calibrate: mesh {shape} has {nproc} ranks but {env.size} were started ({env.source}); "
                          f"start {nproc}")
    probes = probe_models()
    with tempfile.TemporaryDirectory(prefix="shardflow-calibrate-") as tmp:
        dirs = {}
        for name, p in probes.items():
            dirs[name] = os.path.join(tmp, name)
            log.info("compiling the %s probe", name)
            _compile_probe(p["model"], target, dirs[name])
        if as_rank:
            measured = run_rank(shape, dirs, trials=trials, backend=backend or "auto", env=env)
            if measured is None:
                return None
        else:
            argv = ["--mesh", "x".join(map(str, shape)), "--trials", str(trials),
                    "--result", os.path.join(tmp, "result.json")]
            argv += [a for name, d in dirs.items() for a in ("--probe", f"{name}={d}")]
            if backend is not None:
                argv += ["--backend", backend]
            log.info("timing on %d rank(s)", nproc)
            rc = start_ranks("shardflow.runtime.calibrate", argv, nproc, launcher=launcher, backend=backend,
                             timeout=timeout_s)
            result_path = Path(tmp, "result.json")
            if rc != 0 or not result_path.is_file():
                raise ShardflowError(f"calibrate: the ranks failed (exit status {rc}); see their messages above")
            measured = json.loads(result_path.read_text())
    return _fit(shape, target, probes, measured)


def _compile_probe(model, target: str, out_dir: str) -> None:
    """Compile a probe model for one rank of ``target`` into ``out_dir``."""
    from .driver import compile as compile_model

    compile_model(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": target},
                  out_dir=out_dir)


def _fit(shape: list[int], target: str, probes: dict, measured: dict) -> Calibration:
    from .parallel.cost import DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US

    links = fit_links(measured["collectives"])
    t = measured["programs_s"]
    nproc = int(np.prod(shape))
    threads = measured["threads_per_rank"]
    name = (f"{target} calibrated on {socket.gethostname()} ({platform.processor() or platform.machine()}), "
            f"{datetime.date.today().isoformat()}: {nproc} rank(s) x {threads} thread(s)")
    config = {
        "mesh_shape": shape,
        "axis_bandwidth_GBps": [round(links[a]["bandwidth_GBps"], 4) if a in links else DEFAULT_BANDWIDTH_GBPS
                                for a in range(len(shape))],
        "axis_latency_us": [round(links[a]["latency_us"], 3) if a in links else DEFAULT_LATENCY_US
                            for a in range(len(shape))],
        "device": {"name": name, "peak_tflops": round(probes["gemm"]["flops"] / t["gemm"] / 1e12, 6),
                   "mem_bandwidth_GBps": round(probes["stream"]["bytes"] / t["stream"] / 1e9, 3)},
    }
    if measured.get("memory_per_rank_bytes"):
        # each host's memory shared by its ranks: the planner keeps a plan without a budget within it
        config["device"]["memory_GB"] = round(measured["memory_per_rank_bytes"] / 1e9, 3)
    return Calibration(config, measured, links)
