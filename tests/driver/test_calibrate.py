"""``shardflow calibrate``: the link fit, the ranks' timings and the command end to end."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from shardflow.compiler import ConfigError, ShardflowError, load_onnx
from shardflow.compiler.calibrate import GEMM_SHAPE, STREAM_ELEMENTS, calibrate, fit_links, probe_models
from shardflow.compiler.parallel.config import DistributedConfig
from shardflow.compiler.parallel.cost import COLLECTIVES, CostModel
from shardflow.compiler.parallel.mesh import DeviceMesh
from shardflow.compiler.parallel.search import op_flops
from shardflow.runtime.calibrate import BUFFER_BYTES, axis_groups, time_collectives
from shardflow.runtime.comm import InProcessWorld
from models import mlp
from threads import run_threads

HAS_MPI = shutil.which("mpiexec") is not None and importlib.util.find_spec("mpi4py") is not None
SHARDFLOW = [sys.executable, "-m", "shardflow.compiler.cli"]


def _records(mesh_shape, latency_us, bandwidth_GBps, noise=0.0, seed=0):
    """What the ranks would report on links that follow the cost model exactly (times noise)."""
    rng = np.random.default_rng(seed)
    recs = []
    for axis, n in enumerate(mesh_shape):
        cm = CostModel(DeviceMesh([n]), axis_bandwidth_GBps=bandwidth_GBps[axis], axis_latency_us=latency_us[axis])
        for kind in COLLECTIVES:
            for b in BUFFER_BYTES:
                nbytes = b * n if kind in ("all_gather", "all_to_all") else b
                t = cm.collective(kind, nbytes, 0) * (1 + noise * rng.uniform(-1, 1))
                recs.append({"axis": axis, "group_size": n, "kind": kind, "buffer_bytes": b, "nbytes": nbytes,
                             "seconds": t})
    return recs


def test_fit_links_recovers_the_figures_of_model_shaped_times():
    fit = fit_links(_records([2, 4], [7.5, 2.0], [3.0, 50.0]))
    assert fit[0]["latency_us"] == pytest.approx(7.5, rel=1e-6)
    assert fit[0]["bandwidth_GBps"] == pytest.approx(3.0, rel=1e-6)
    assert fit[1]["latency_us"] == pytest.approx(2.0, rel=1e-6)
    assert fit[1]["bandwidth_GBps"] == pytest.approx(50.0, rel=1e-6)
    assert fit[0]["max_rel_error"] < 1e-6
    noisy = fit_links(_records([2], [7.5], [3.0], noise=0.05))
    assert noisy[0]["latency_us"] == pytest.approx(7.5, rel=0.15)
    assert noisy[0]["bandwidth_GBps"] == pytest.approx(3.0, rel=0.1)
    assert 0.0 < noisy[0]["max_rel_error"] <= 0.15


def test_fit_links_keeps_the_latency_nonnegative_and_refuses_shrinking_times():
    # a link faster for small messages than any latency allows: latency 0, not negative
    recs = _records([2], [0.0], [10.0])
    for r in recs:
        r["seconds"] *= 1 - 0.3 * (r["buffer_bytes"] == BUFFER_BYTES[0])
    fit = fit_links(recs)
    assert fit[0]["latency_us"] == 0.0 and fit[0]["bandwidth_GBps"] > 0
    shrinking = _records([2], [5.0], [3.0])  # larger messages faster: no bandwidth explains that
    for r in shrinking:
        r["seconds"] = 1e-3 / r["buffer_bytes"] ** 0.5
    with pytest.raises(ShardflowError, match="do not grow with the message size"):
        fit_links(shrinking)


def test_axis_groups_are_the_mesh_groups():
    for shape in ([2, 3], [2, 2], [4], [2, 1, 3]):
        mesh = DeviceMesh(shape)
        for axis in range(len(shape)):
            assert sorted(map(tuple, axis_groups(shape, axis))) == sorted(mesh.groups(axis))


def test_time_collectives_times_every_kind_and_size_along_every_axis():
    comms = InProcessWorld(4).communicators()
    sizes = (4096, 65536)
    got = run_threads(comms, lambda c: time_collectives(c, [2, 2], buffer_bytes=sizes, trials=1))
    recs = got[0]
    assert len(recs) == 2 * len(COLLECTIVES) * len(sizes)
    for r in recs:
        assert r["group_size"] == 2 and r["seconds"] > 0
        scale = 2 if r["kind"] in ("all_gather", "all_to_all") else 1
        assert r["nbytes"] == r["buffer_bytes"] * scale
    # every rank reports the slowest rank's figure, so all agree
    assert [r["seconds"] for r in got[1]] == [r["seconds"] for r in recs]


def test_time_collectives_refuses_a_mesh_of_another_size():
    comms = InProcessWorld(2).communicators()
    with pytest.raises(ShardflowError, match="mesh \\[4\\] has 4 ranks but 2 were started"):
        run_threads(comms, lambda c: time_collectives(c, [4], trials=1))


def test_probes_are_credited_with_the_planners_flops_and_the_kernels_bytes():
    probes = probe_models()
    m, k, n = GEMM_SHAPE
    gemm = load_onnx(probes["gemm"]["model"])
    assert probes["gemm"]["flops"] == 2 * m * k * n
    assert sum(op_flops(op) for op in gemm.nodes) == pytest.approx(probes["gemm"]["flops"], rel=1e-3)
    stream = load_onnx(probes["stream"]["model"])
    assert [t.name for t in stream.inputs] == ["s"] and stream.inputs[0].shape == (1,)
    vectors = [t for op in stream.nodes for t in op.inputs if t.is_constant]
    assert sorted(t.size for t in vectors) == [STREAM_ELEMENTS] * 2
    assert probes["stream"]["bytes"] == 3 * 4 * STREAM_ELEMENTS  # A and B read, C written


def test_calibrate_refuses_other_targets_and_bad_meshes():
    with pytest.raises(ConfigError, match="target 'cuda' is not measured yet"):
        calibrate([2], target="cuda")
    with pytest.raises(ConfigError, match="positive"):
        calibrate([2, 0])
    with pytest.raises(ConfigError, match="trials"):
        calibrate([2], trials=0)


@pytest.mark.parametrize("launcher", [pytest.param("mpiexec", marks=pytest.mark.skipif(not HAS_MPI,
                                                                                        reason="needs mpiexec")),
                                      "spawn"])
def test_calibrate_command_writes_a_config_that_compile_and_plan_take(tmp_path, launcher):
    out = tmp_path / "machine.json"
    res = subprocess.run(SHARDFLOW + ["calibrate", "--mesh", "2", "-o", str(out), "--launcher", launcher,
                                      "--trials", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = json.loads(out.read_text())
    assert set(cfg) == {"mesh_shape", "axis_bandwidth_GBps", "axis_latency_us", "device"}
    dc = DistributedConfig.from_dict(cfg)
    assert dc.mesh_shape == (2,)
    assert dc.device.peak_flops > 1e9 and dc.device.mem_bandwidth > 1e8
    assert dc.axis_bandwidth_GBps[0] > 0 and dc.axis_latency_us[0] >= 0
    assert "calibrated" in dc.device.name
    # the host's memory over its two ranks: what a rank may hold
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert dc.device.memory_bytes == pytest.approx(total // 2, rel=1e-5, abs=1e6)
    assert "GB a rank (its host's memory over its ranks there)" in res.stdout
    backend = "mpi" if launcher == "mpiexec" else "tcp"
    assert f"links ({backend} backend" in res.stdout
    for kind in COLLECTIVES:
        assert len([line for line in res.stdout.splitlines() if f" {kind} " in line]) == len(BUFFER_BYTES)
    # the plan is priced with the calibrated figures
    from shardflow.compiler.parallel import search

    plan = search(load_onnx(mlp(layers=2)), cfg)
    assert "calibrated" in plan.to_text()


def test_calibrate_command_reports_ranks_that_cannot_connect(tmp_path):
    # the mpi backend needs ranks started by mpiexec: the spawned ranks fail, and nothing is written
    res = subprocess.run(SHARDFLOW + ["calibrate", "--mesh", "2", "-o", str(tmp_path / "m.json"), "--launcher",
                                      "spawn", "--backend", "mpi", "--trials", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert "needs ranks started by mpiexec" in res.stderr and "calibrate: the ranks failed" in res.stderr
    assert not (tmp_path / "m.json").exists()



@pytest.mark.skipif(not HAS_MPI, reason="needs mpiexec and mpi4py")
def test_calibrate_started_under_mpiexec_is_one_rank_of_it(tmp_path):
    out = tmp_path / "machine.json"
    mpiexec = [shutil.which("mpiexec"), "-n", "2"]
    res = subprocess.run(mpiexec + SHARDFLOW + ["calibrate", "--mesh", "2", "-o", str(out), "--trials", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("wrote ") == 1  # rank 0 reports and writes
    assert DistributedConfig.from_dict(json.loads(out.read_text())).mesh_shape == (2,)
    bad = subprocess.run(mpiexec + SHARDFLOW + ["calibrate", "--mesh", "4", "-o", str(tmp_path / "bad.json")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "mesh [4] has 4 ranks but 2 were started" in bad.stderr
    assert not (tmp_path / "bad.json").exists()


def test_report_of_a_single_rank_says_no_link_was_measured():
    from shardflow.compiler.calibrate import Calibration

    cal = Calibration({"mesh_shape": [1], "axis_bandwidth_GBps": [100.0], "axis_latency_us": [5.0],
                       "device": {"name": "cpu calibrated", "peak_tflops": 0.09, "mem_bandwidth_GBps": 16.0}},
                      {"programs_s": {"gemm": 0.012, "stream": 0.006}, "backend": "self", "threads_per_rank": "2",
                       "collectives": []}, {})
    text = cal.report()
    assert "peak 90.0 GFLOP/s" in text and "memory 16.0 GB/s" in text
    assert "links: none measured" in text and "collective" not in text
