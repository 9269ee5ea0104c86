"""The runtime on hand-written artifacts (real C kernels, no compiler): load, verify, run, errors."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import handmade
from threads import run_ranks, run_threads
from shardflow.runtime import (ChecksumError, InputDtypeError, InputError, InputNameError, InputShapeError,
                               MemoryLimitError, ShardflowError, VersionError, WorldSizeError, load)
from shardflow.runtime.artifact import ArtifactError, atomic_output_dir
from shardflow.runtime.comm import InProcessWorld


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    d = tmp_path_factory.mktemp("handmade")
    return {name: handmade.make_artifact(d / name, mesh) for name, mesh in
            (("o1", (1,)), ("o2", (2,)), ("o4", (2, 2)), ("o4b", (4,)))}


@pytest.fixture
def x():
    return np.random.default_rng(0).standard_normal(handmade.SHAPE).astype(np.float32)


def check(outs, x, world):
    want = handmade.expected(x, world)
    assert sorted(outs) == sorted(want)
    for k in want:
        np.testing.assert_allclose(outs[k], want[k], rtol=1e-6, atol=1e-6)


def test_single_rank(arts, x):
    prog = load(arts["o1"])
    assert prog.input_names == ["x"] and prog.output_names == ["y", "g"]
    check(prog.run({"x": x}), x, 1)
    out = prog.run({"x": x})
    out["y"][...] = 0  # outputs are fresh arrays
    check(prog.run({"x": x}), x, 1)


def test_outputs_as_views_of_the_program_buffers(arts, x):
    prog = load(arts["o1"])
    views = prog.run({"x": x}, copy_outputs=False)
    check(views, x, 1)
    assert not views["y"].flags.writeable
    with pytest.raises(ValueError):
        views["y"][...] = 0
    kept = {k: v.copy() for k, v in views.items()}
    check(prog.run({"x": 2 * x}), 2 * x, 1)  # the next run overwrites what the views show
    assert not np.array_equal(views["y"], kept["y"])
    check(views, 2 * x, 1)


@pytest.mark.parametrize("name,world", [("o2", 2), ("o4", 4), ("o4b", 4)])
def test_ranks_in_threads(arts, x, name, world):
    for outs in run_ranks(arts[name], {"x": x}, world=world):
        check(outs, x, world)


def test_input_errors_name_the_input(arts, x):
    prog = load(arts["o1"])
    with pytest.raises(InputShapeError, match=r"input 'x' has shape \(4, 5\)") as info:
        prog.run({"x": x[:, :5]})
    assert info.value.input_name == "x" and isinstance(info.value, InputError)
    with pytest.raises(InputDtypeError, match="input 'x' has dtype float64") as info:
        prog.run({"x": x.astype(np.float64)})
    assert info.value.input_name == "x"
    with pytest.raises(InputNameError, match="missing input 'x'"):
        prog.run({})
    with pytest.raises(InputNameError, match=r"unknown input\(s\) \['z'\]"):
        prog.run({"x": x, "z": x})


@pytest.mark.parametrize("victim", ["weights.bin", "program.json", "kernels.so"])
def test_a_corrupted_byte_is_refused_naming_the_file(arts, tmp_path, victim):
    out = tmp_path / "bad"
    shutil.copytree(arts["o2"], out)
    path = out / "rank1" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=f"rank1/{victim}") as info:
        load(out, 1, InProcessWorld(2).communicators()[1])  # fails before any communication
    assert info.value.path.endswith(f"rank1/{victim}")


def test_missing_file_and_other_format_version(arts, tmp_path):
    out = tmp_path / "v"
    shutil.copytree(arts["o1"], out)
    m = json.loads((out / "rank0" / "manifest.json").read_text())
    m["artifact_format"] = 99
    (out / "rank0" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(VersionError, match="artifact format 99"):
        load(out)
    shutil.rmtree(out)
    shutil.copytree(arts["o1"], out)
    (out / "rank0" / "kernels.so").unlink()
    with pytest.raises(ChecksumError, match="kernels.so.*missing"):
        load(out)
    with pytest.raises(ArtifactError, match="does not exist"):
        load(tmp_path / "nowhere")


def test_an_arena_too_large_to_allocate_is_a_clear_error(arts, tmp_path):
    """A program whose arena this process cannot allocate (here 1 EiB: numpy's MemoryError) is refused at
    load with a MemoryLimitError naming the rank, the folder and the size."""
    out = tmp_path / "huge"
    shutil.copytree(arts["o1"], out)
    path = out / "rank0" / "program.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), arena_bytes=1 << 60)))
    with pytest.raises(MemoryLimitError, match=r"rank 0: the program in .*huge.* needs 1.0 EiB of working memory"):
        load(out, verify=False)


def test_load_steps_run_once_when_loading(arts, tmp_path, x):
    """The first ``load_steps`` steps run once, at load (the compiler puts the steps computed from
    constants alone there): here ``mul``, on whatever the input's buffer held at load, so runs on other
    inputs give the same ``y``; an out-of-range count, or one that takes in a collective, is refused."""
    out = tmp_path / "load"
    shutil.copytree(arts["o1"], out)
    path = out / "rank0" / "program.json"
    program = json.loads(path.read_text())
    for n, match in ((1, None), (2, "allreduce0 is a collective, but the first 2 steps"),
                     (9, "load_steps = 9 is outside")):
        path.write_text(json.dumps(dict(program, load_steps=n)))
        if match:
            with pytest.raises(ArtifactError, match=match):
                load(out, verify=False)
            continue
        prog = load(out, verify=False)
        ys = [prog.run({"x": x * (k + 1)})["y"] for k in range(2)]
        np.testing.assert_array_equal(ys[0], ys[1])
        assert [s["node"] for s in prog.profile({"x": x}, repeat=1)] == ["allreduce0", "add1", "rows", "gather"]


def test_weights_mapped_copy_on_write_or_read(arts, tmp_path, x):
    """``map_weights``: the rank's weights.bin mapped (copy-on-write: a write stays in the process)
    or read into its own memory, the same outputs either way, on one rank and on two in threads; a
    corrupted byte is refused mapped too."""
    assert not isinstance(load(arts["o1"]).weights, np.memmap)  # (the cpu target's default: read)
    prog = load(arts["o1"], map_weights=True)
    assert isinstance(prog.weights, np.memmap) and prog.weights.ctypes.data % 64 == 0
    check(prog.run({"x": x}), x, 1)
    path = arts["o1"] / "rank0" / "weights.bin"
    before = path.read_bytes()
    prog.weights[:] ^= 0xFF
    assert path.read_bytes() == before and load(arts["o1"], map_weights=True).weights.tobytes() == before
    outs = run_threads(InProcessWorld(2).communicators(),
                       lambda c: load(arts["o2"], c.rank, c, map_weights=True).run({"x": x}))
    for out in outs:
        check(out, x, 2)
    bad = tmp_path / "bad"
    shutil.copytree(arts["o1"], bad)
    data = bytearray((bad / "rank0" / "weights.bin").read_bytes())
    data[3] ^= 0x10
    (bad / "rank0" / "weights.bin").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="rank0/weights.bin"):
        load(bad, map_weights=True)


def test_weights_that_cannot_be_mapped_are_read(arts, x, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")
    monkeypatch.setattr(np, "memmap", refuse)
    prog = load(arts["o1"], map_weights=True)
    assert type(prog.weights) is np.ndarray and "cannot map" in caplog.text
    check(prog.run({"x": x}), x, 1)


def test_cuda_programs_map_their_weights_by_default(arts, tmp_path, monkeypatch):
    """A cuda program's kernels read the device's copy of the weights: the host's is mapped by
    default (the page cache's pages, not the process's), read when asked."""
    import shardflow.runtime.cuda_exec as cuda_exec

    seen = []

    class Engine:
        def __init__(self, prog, **kw):
            seen.append(type(prog.weights))
    monkeypatch.setattr(cuda_exec, "CudaEngine", Engine)
    out = tmp_path / "cuda"
    shutil.copytree(arts["o1"], out)
    m = json.loads((out / "rank0" / "manifest.json").read_text())
    m["target"] = "cuda"
    (out / "rank0" / "manifest.json").write_text(json.dumps(m))
    load(out)
    load(out, map_weights=False)
    assert seen == [np.memmap, np.ndarray]

def test_world_size_mismatch_is_refused(arts):
    with pytest.raises(WorldSizeError, match="has 2 ranks; pass the world communicator"):
        load(arts["o2"])
    comms = InProcessWorld(2).communicators()
    with pytest.raises(WorldSizeError, match="compiled for 4 ranks but the communicator has 2"):
        load(arts["o4"], 0, comms[0])
    with pytest.raises(WorldSizeError, match="no rank7/ directory"):
        load(arts["o4"], 7)


def _has_cuda_device():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(_has_cuda_device(), reason="checks the message given without cupy or a GPU")
def test_cuda_artifacts_need_cupy_and_a_device(arts, tmp_path):
    out = tmp_path / "cuda"
    shutil.copytree(arts["o1"], out)
    m = json.loads((out / "rank0" / "manifest.json").read_text())
    m["target"] = "cuda"
    (out / "rank0" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardflowError, match="running cuda artifacts needs (cupy|a CUDA device)"):
        load(out)


def test_runtime_needs_no_compiler(arts, x):
    code = f"""
import sys, numpy as np
import shardflow.runtime, shardflow.runtime.launch, shardflow.runtime.comm.tcp, shardflow.runtime.comm.watchdog
import shardflow.runtime.comm.mpi, shardflow.runtime.comm.nccl, shardflow.runtime.comm.inprocess
p = shardflow.runtime.load({str(arts['o1'])!r})
p.run({{'x': np.zeros((4, 6), np.float32)}})
bad = [m for m in sys.modules if m.startswith(('shardflow.compiler', 'onnx', 'pulp'))]
assert not bad, bad
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_atomic_output_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(out) as tmp:
            (tmp / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert (out / "old.txt").read_text() == "old" and not (out / "new.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_output_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(fresh):
            raise RuntimeError("boom")
    assert not fresh.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
