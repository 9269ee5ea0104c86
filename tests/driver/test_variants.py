"""Shape variants (compile_variants, runtime/variants.py): one out_dir with a program per set of sizes
of the model's named dynamic dims, run at each against onnxruntime, on one rank and on two, from
Python and from the command line; shapes of no variant and malformed variants refused by name."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import ConfigError, ShapeError, ShardflowError, cli, compile_variants
from shardflow.runtime import ArtifactError, ChecksumError, InputShapeError, WorldSizeError, load
from shardflow.runtime.artifact import buffer_nbytes
from shardflow.runtime.comm import InProcessWorld
from shardflow.runtime.profile import memory_record

HIDDEN = 16


def dynamic_model() -> onnx.ModelProto:
    """``x [batch, seq, 16]`` through an MLP, a residual and a softmax over ``seq``: named dynamic dims."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((HIDDEN, 4 * HIDDEN)).astype(np.float32) * 0.3, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4 * HIDDEN, HIDDEN)).astype(np.float32) * 0.3, "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["m"]), helper.make_node("Add", ["m", "x"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=1)]
    dims = ["batch", "seq", HIDDEN]
    g = helper.make_graph(nodes, "dyn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], [w1, w2])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _x(batch, seq, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, seq, HIDDEN)).astype(np.float32)


def _ort(x):
    return onnxruntime.InferenceSession(dynamic_model().SerializeToString()).run(None, {"x": x})[0]


def test_one_out_dir_runs_every_variant_and_refuses_other_shapes(tmp_path):
    res = compile_variants(dynamic_model(), variants=[{"seq": 4}, {"seq": 8}, {"seq": 8, "batch": 3}],
                           dim_sizes={"batch": 2}, distributed_config={"mesh_shape": [1]},
                           optimization_config={"target": "cpu"}, out_dir=tmp_path / "out")
    spec = json.loads((tmp_path / "out" / "variants.json").read_text())
    assert [(v["dir"], v["dim_sizes"], v["inputs"]) for v in spec["variants"]] == [
        ("v0", {"seq": 4}, {"x": [2, 4, HIDDEN]}), ("v1", {"seq": 8}, {"x": [2, 8, HIDDEN]}),
        ("v2", {"seq": 8, "batch": 3}, {"x": [3, 8, HIDDEN]})]
    assert [r.out_dir for r in res.results] == [tmp_path.resolve() / "out" / f"v{k}" for k in range(3)]
    prog = load(tmp_path / "out")
    assert prog.input_names == ["x"] and prog.output_names == ["y"] and prog.last is None  # (nothing loaded yet)
    assert not prog._programs and len(load(tmp_path / "out").preload()._programs) == 3
    for shape, k in (((2, 8), 1), ((2, 4), 0), ((3, 8), 2), ((2, 8), 1)):
        x = _x(*shape)
        np.testing.assert_allclose(prog.run({"x": x})["y"], _ort(x), rtol=1e-5, atol=1e-6)
        assert prog.last is prog.program(k) and prog.last.out_dir == tmp_path / "out" / f"v{k}"
    with pytest.raises(InputShapeError, match=r"no variant .* compiled for the inputs' shapes \(x \[2, 5, 16\]\); "
                                              r"its variants take v0: x \[2, 4, 16\]; v1: x \[2, 8, 16\]; "
                                              r"v2: x \[3, 8, 16\]"):
        prog.run({"x": _x(2, 5)})
    # the weights do not depend on the sequence: one file, hard-linked into the other variants
    assert res.shared_weights == 2
    w = [tmp_path / "out" / f"v{k}" / "rank0" / "weights.bin" for k in range(3)]
    assert os.path.samefile(w[0], w[1]) and os.path.samefile(w[0], w[2])


def test_variants_on_two_ranks(tmp_path):
    compile_variants(dynamic_model(), variants=[{"seq": 4}, {"seq": 6}], dim_sizes={"batch": 2},
                     distributed_config={"mesh_shape": [2], "algo": "megatron"}, optimization_config={"target": "cpu"},
                     out_dir=tmp_path / "out")
    from threads import run_threads

    world = InProcessWorld(2).communicators()
    progs = [load(tmp_path / "out", c.rank, c) for c in world]
    for seq in (6, 4, 6):
        x = _x(2, seq, seed=seq)
        outs = run_threads(world, lambda c: progs[c.rank].run({"x": x})["y"], timeout=60)
        for got in outs:
            np.testing.assert_allclose(got, _ort(x), rtol=1e-5, atol=1e-6)

    # ranks given different shapes all refuse the run (their programs' collectives would not match)
    def mismatched(c):
        try:
            progs[c.rank].run({"x": _x(2, 4 + 2 * c.rank)})
        except InputShapeError as exc:
            return str(exc)
    assert run_threads(world, mismatched, timeout=60) == ["the ranks were given inputs of different shapes, which "
                                                         "different variants take (rank 0 v0, rank 1 v1); every rank "
                                                         "of a program runs the same shapes"] * 2

    def one_unknown(c):  # (rank 1's shapes no variant takes: rank 0 does not wait for it)
        try:
            progs[c.rank].run({"x": _x(2, 4 + 3 * c.rank)})
        except InputShapeError as exc:
            return str(exc)
    got = run_threads(world, one_unknown, timeout=60)
    assert got[0].startswith("rank 1 was given inputs whose shapes no variant") and "x [2, 7, 16]" in got[1]


def test_the_command_line_compiles_runs_and_inspects_variants(tmp_path, capsys):
    path = tmp_path / "dyn.onnx"
    onnx.save(dynamic_model(), path)
    out = tmp_path / "out"
    assert cli.main(["compile", str(path), "-o", str(out), "--mesh", "2", "--dim", "batch=2", "--variant", "seq=4",
                     "--variant", "seq=8,batch=1", "-q"]) == 0
    x = _x(1, 8)
    np.savez(tmp_path / "in.npz", x=x)
    for launcher in ("mpiexec", "spawn") if shutil.which("mpiexec") else ("spawn",):  # (MPI, and TCP's gather)
        proc = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "run", str(out), "--nproc", "2",
                               "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "o.npz"), "--profile",
                               "--launcher", launcher], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        np.testing.assert_allclose(np.load(tmp_path / "o.npz")["y"], _ort(x), rtol=1e-5, atol=1e-6)
        assert "memory per rank" in proc.stderr and f"ran {out / 'v1'} on 2 rank(s)" in proc.stderr
    text = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "inspect", str(out)], capture_output=True,
                          text=True, timeout=120).stdout
    assert "== shape variant v0 (seq=4)" in text and "== shape variant v1 (seq=8, batch=1)" in text
    assert "x float32[1, 8, 16]" in text
    capsys.readouterr()
    for flags, why in ((["--variant", "seq"], "--variant 'seq': use NAME=SIZE"),):
        assert cli.main(["compile", str(path), "-o", str(tmp_path / "o2"), *flags]) == 2
        assert why in capsys.readouterr().err


def test_malformed_variants_are_refused_and_leave_no_out_dir(tmp_path):
    kw = dict(distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    for bad, match in (([], "non-empty list"), ({"seq": 4}, "non-empty list"), ([{}], r"variants\[0\] = \{\}"),
                       ([{"seq": -1}], r"variants\[0\]: 'seq': -1"), ([{"seq": True}], "'seq': True"),
                       ([{"seq": 4}, {"seq": 4}], r"variants\[1\] = \{'seq': 4\} repeats variants\[0\]")):
        with pytest.raises(ConfigError, match=match):
            compile_variants(dynamic_model(), variants=bad, dim_sizes={"batch": 1}, **kw)
    # two variants the inputs cannot tell apart; a dim the model does not have
    with pytest.raises(ConfigError, match=r"variants 0 \{'seq': 4\} and 1 \{'seq': 4, 'batch': 2\} give the inputs the "
                                          "same shapes"):
        compile_variants(dynamic_model(), variants=[{"seq": 4}, {"seq": 4, "batch": 2}], dim_sizes={"batch": 2}, **kw)
    with pytest.raises(ShapeError, match=r"dim_sizes names \['tokens'\]"):
        compile_variants(dynamic_model(), variants=[{"tokens": 4}], dim_sizes={"batch": 2}, **kw)
    assert not (tmp_path / "o").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".o")]


def test_a_variants_out_dir_checks_its_list_and_the_world(tmp_path):
    compile_variants(dynamic_model(), variants=[{"seq": 4}], dim_sizes={"batch": 1},
                     distributed_config={"mesh_shape": [2]}, optimization_config={"target": "cpu"},
                     out_dir=tmp_path / "out")
    with pytest.raises(WorldSizeError, match="compiled for 2 ranks"):
        load(tmp_path / "out")
    spec_path = tmp_path / "out" / "variants.json"
    spec = json.loads(spec_path.read_text())
    for broken, match in (({**spec, "version": 9}, "version 9"), ({**spec, "variants": []}, "non-empty list"),
                          ({**spec, "variants": [{**spec["variants"][0], "dir": "v7"}]}, "variant folder 'v7'")):
        spec_path.write_text(json.dumps(broken))
        with pytest.raises(ArtifactError, match=match):
            load(tmp_path / "out")


def _position_model() -> onnx.ModelProto:
    """``x [batch, seq, 16]`` plus a position table sliced to ``seq`` (a constant that differs between
    variants), through an MLP whose two weights are 64 KiB each (``SHARE_MIN_BYTES``)."""
    rng = np.random.default_rng(0)
    inner = 1024  # (16 x 1024 floats: 64 KiB, SHARE_MIN_BYTES)
    w1 = numpy_helper.from_array(rng.standard_normal((HIDDEN, inner)).astype(np.float32) * 0.1, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((inner, HIDDEN)).astype(np.float32) * 0.1, "w2")
    pos = numpy_helper.from_array(rng.standard_normal((32, HIDDEN)).astype(np.float32), "pos")
    const = {n: numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             (("one", [1]), ("two", [2]), ("zero", [0]))}
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Slice", ["shape", "one", "two"], ["len"]),
             helper.make_node("Slice", ["pos", "zero", "len", "zero"], ["p"]),
             helper.make_node("Add", ["x", "p"], ["xp"]),
             helper.make_node("MatMul", ["xp", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    dims = ["batch", "seq", HIDDEN]
    g = helper.make_graph(nodes, "pos", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], [w1, w2, pos, *const.values()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_variant_reads_the_weights_another_loaded_variant_holds(tmp_path):
    """The variants' weights files differ (a position table sliced to the sequence is a constant of each),
    so no file is shared; their large regions alike (the MLP's 64 KiB weights) are read from the variant
    loaded first, whose memory the second's kernels then read."""
    m = _position_model()
    res = compile_variants(m, variants=[{"seq": 4}, {"seq": 8}], dim_sizes={"batch": 2},
                           distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                           out_dir=tmp_path / "out")
    # on disk: v1's large regions stay in v0's file (its own file holds its position slice only)
    v0, v1 = res.variants
    assert res.shared_weights == 0 and res.external_bytes == 2 << 16 and v1["weights"]["0"] == []
    assert sorted(sha for _, _, sha in v1["external"]["0"]) == sorted(sha for _, _, sha in v0["weights"]["0"])
    files = [tmp_path / "out" / v / "rank0" / "weights.bin" for v in ("v0", "v1")]
    assert files[1].stat().st_size < 4096 < (2 << 16) < files[0].stat().st_size
    assert [v["weights_alike_bytes"] for v in cli.inspect_out_dir(str(tmp_path / "out"))["variants"]] == [2 << 16, 0]
    sess = onnxruntime.InferenceSession(m.SerializeToString())

    def check(prog, seq):
        x = _x(2, seq, seed=seq)
        np.testing.assert_allclose(prog.run({"x": x})["y"], sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)

    alone = load(tmp_path / "out" / "v1")  # (a variant's folder is an out_dir: it reads v0's file itself)
    check(alone, 8)
    assert sorted(a.nbytes for a in alone.external_regions.values()) == [1 << 16] * 2
    assert memory_record(alone)["weights"] == alone.weights.nbytes + (2 << 16)
    for kw in ({}, {"verify": False}, {"map_weights": True}):
        for order in ((8, 4, 8), (4, 8, 4)):
            prog = load(tmp_path / "out", **kw)
            for seq in order:
                check(prog, seq)
            assert prog.borrowed_bytes == 2 << 16  # (the second loaded reads the first's copy)
            first, second = (prog.program(1), prog.program(0)) if order[0] == 8 else (prog.program(0), prog.program(1))
            assert first.borrowed_weights_bytes == 0 and second.borrowed_weights_bytes == 2 << 16
            held = [b.array for b in first.buffers if b.array.nbytes >= 1 << 16]
            assert sum(any(np.shares_memory(b.array, h) for h in held) for b in second.buffers) >= 2
    assert memory_record(second)["weights"] == second.weights.nbytes  # (v1: its own file, the rest borrowed)
    # a list whose checksums do not fit the files: refused when verifying, before any bytes are lent
    path = tmp_path / "out" / "variants.json"
    spec = json.loads(path.read_text())
    path.write_text(json.dumps(spec).replace(v0["weights"]["0"][0][2], "0" * 64))
    prog = load(tmp_path / "out")
    prog.run({"x": _x(2, 4)})
    with pytest.raises(ChecksumError, match="lists a weights region with sha256 0000"):
        prog.run({"x": _x(2, 8)})
    # the earlier variant's file is checked where a later one reads it
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 1
    files[0].unlink()  # (its hard links keep the bytes as they were)
    files[0].write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="checksum mismatch in .*v0/rank0/weights.bin"):
        load(tmp_path / "out" / "v1")


def _skip(*args):  # (the stand-in's kernel: these tests check where the weights are, not the kernels)
    pass


def test_cuda_variants_hold_their_shared_weights_once_on_disk_and_on_the_device(tmp_path, monkeypatch):
    """The cuda target as the cpu's: v1's large regions stay in v0's file; loaded after v0 (cupy's numpy
    stand-in, tests/fake_cupy.py: the kernels are not run, no GPU here), v1's buffers there are views of
    v0's device arrays, not uploaded again, in either loading order (v0 loaded second uploads only the
    stretches of its file between the regions v1 holds); loaded alone, v1 uploads them from v0's file.
    Every buffer's device bytes are its weights' bytes in the files."""
    import collections

    from fake_cupy import _fake_cupy

    from shardflow.compiler.codegen import cuda
    if cuda._find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    res = compile_variants(_position_model(), variants=[{"seq": 4}, {"seq": 8}], dim_sizes={"batch": 2},
                           distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cuda"},
                           out_dir=tmp_path / "out")
    v0, v1 = res.variants
    assert res.external_bytes == 2 << 16 and v1["weights"]["0"] == [] and len(v1["external"]["0"]) == 2
    files = [tmp_path / "out" / v / "rank0" / "weights.bin" for v in ("v0", "v1")]
    assert files[1].stat().st_size < 4096 < (2 << 16) < files[0].stat().st_size
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(collections.defaultdict(lambda: _skip), []))
    on_disk = {v: np.fromfile(f, np.uint8) for v, f in zip(("v0", "v1"), files)}

    def check_bytes(prog, name):
        ext = np.fromfile(files[0], np.uint8)
        for b, view in zip(prog.program["buffers"], prog._engine.views):
            if b["storage"] != "arena":
                off, n = int(b["offset"]), buffer_nbytes(b)
                src = ext if b["storage"] == "external" else on_disk[name]
                np.testing.assert_array_equal(np.asarray(view).reshape(-1).view(np.uint8), src[off:off + n])

    def shared(a, b):
        return sum(any(np.shares_memory(x, y) for y in b._engine.views) for x in a._engine.views
                   if x.nbytes >= 1 << 16)

    for order in ((0, 1), (1, 0)):
        prog = load(tmp_path / "out")
        first, second = (prog.program(k) for k in order)
        for k in order:
            check_bytes(prog.program(k), f"v{k}")
        assert first.borrowed_weights_bytes == 0 and second.borrowed_weights_bytes == 2 << 16
        assert prog.borrowed_bytes == 2 << 16 and shared(second, first) == 2
    alone = load(tmp_path / "out" / "v1")
    check_bytes(alone, "v1")
    assert alone.borrowed_weights_bytes == 0
    assert sorted(a.nbytes for a in alone.external_regions.values()) == [1 << 16] * 2


def test_cuda_variants_run_on_the_host_emulation(tmp_path, monkeypatch, tmp_path_factory):
    """The same two variants compiled for cuda and run, kernels and all, on the host emulation of CUDA
    (tests/host_cupy.py: no nvcc, no GPU): each variant's outputs onnxruntime's in both loading orders,
    the second loaded reading the first's device arrays."""
    from host_cupy import use_host_cuda

    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    use_host_cuda(monkeypatch, str(tmp_path_factory.getbasetemp() / "cuda-host-kernels"))
    m = _position_model()
    compile_variants(m, variants=[{"seq": 4}, {"seq": 8}], dim_sizes={"batch": 2},
                     distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cuda"},
                     out_dir=tmp_path / "out")
    sess = onnxruntime.InferenceSession(m.SerializeToString())
    for order in ((4, 8, 4), (8, 4, 8)):
        prog = load(tmp_path / "out")
        for seq in order:
            x = _x(2, seq, seed=seq)
            np.testing.assert_allclose(prog.run({"x": x})["y"], sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
        assert prog.borrowed_bytes == 2 << 16


def test_read_weights_leaves_out_the_regions_read_elsewhere(tmp_path):
    """The file's bytes but the skipped regions (whose pages stay untouched), the whole file and each
    region checked when verifying; without verifying, only the kept ranges are read."""
    import hashlib

    from shardflow.runtime.artifact import _HASH_CHUNK, read_weights

    data = np.random.default_rng(0).integers(0, 256, _HASH_CHUNK + 3 * 4096, dtype=np.uint8)
    (tmp_path / "w.bin").write_bytes(data.tobytes())
    whole = hashlib.sha256(data).hexdigest()
    regions = [(4096, 8192), (_HASH_CHUNK - 4096, 8192)]  # (the second across the chunks' border)
    skip = [(off, n, hashlib.sha256(data[off:off + n]).hexdigest()) for off, n in regions]
    keep = np.ones(data.size, bool)
    for off, n in regions:
        keep[off:off + n] = False
    for sha in (whole, None):
        buf = read_weights(tmp_path / "w.bin", data.size, sha, skip=skip)
        np.testing.assert_array_equal(buf[keep], data[keep])
    for mapped in (False, True):
        with pytest.raises(ChecksumError, match=r"bytes 4096\.\.12288 have sha256 .* the shape variants' list says"):
            read_weights(tmp_path / "w.bin", data.size, whole, skip=[skip[0][:2] + ("f" * 64,), skip[1]],
                         mapped=mapped)
    np.testing.assert_array_equal(read_weights(tmp_path / "w.bin", data.size, whole, skip=skip, mapped=True), data)


def _state_model(cache_dim: str = "seq") -> onnx.ModelProto:
    """``y = x @ w + past``, the present (``y``) kept as the next run's ``past``: a running sum per variant."""
    w = numpy_helper.from_array(np.eye(HIDDEN, dtype=np.float32) * 2, "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "past"], ["present"]),
             helper.make_node("Identity", ["present"], ["y"])]
    g = helper.make_graph(nodes, "st", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
                                        helper.make_tensor_value_info("past", TensorProto.FLOAT,
                                                                      ["batch", cache_dim, HIDDEN])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
                           helper.make_tensor_value_info("present", TensorProto.FLOAT, ["batch", cache_dim, HIDDEN])],
                          [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_each_variant_keeps_its_own_state(tmp_path):
    compile_variants(_state_model(), variants=[{"seq": 4}, {"seq": 8}], dim_sizes={"batch": 1},
                     state={"present": "past"}, distributed_config={"mesh_shape": [1]},
                     optimization_config={"target": "cpu"}, out_dir=tmp_path / "out")
    prog = load(tmp_path / "out")
    assert prog.state_names == {"past": "present"} and prog.input_names == ["x", "past"]
    with pytest.raises(ShardflowError, match="no variant has run yet"):
        prog.read_state()
    sums = {4: np.zeros((1, 4, HIDDEN), np.float32), 8: np.zeros((1, 8, HIDDEN), np.float32)}
    for seq in (4, 4, 8, 4, 8):
        x = _x(1, seq, seed=seq)
        sums[seq] = sums[seq] + 2 * x
        np.testing.assert_allclose(prog.run({"x": x})["y"], sums[seq], rtol=1e-6)
        np.testing.assert_allclose(prog.read_state()["past"], sums[seq], rtol=1e-6)
    prog.reset_state()
    x = _x(1, 4, seed=9)
    np.testing.assert_allclose(prog.run({"x": x})["y"], 2 * x, rtol=1e-6)
    # variants the inputs a run is given cannot tell apart (a cache length alone) are refused
    with pytest.raises(ConfigError, match="their state inputs, which a run need not be given, aside"):
        compile_variants(_state_model("cache"), variants=[{"cache": 4}, {"cache": 8}], dim_sizes={"batch": 1, "seq": 1},
                         state={"present": "past"}, distributed_config={"mesh_shape": [1]},
                         optimization_config={"target": "cpu"}, out_dir=tmp_path / "o2")


@pytest.mark.slow
def test_an_exported_gpt2_with_dynamic_axes_on_two_ranks(tmp_path):
    """GPT-2 (a small config) exported by the TorchScript exporter with dynamic batch and sequence, three
    variants (two lengths, two batch sizes) on two ranks, each against onnxruntime's dynamic session; the
    variants' weights files differ (the position slice and the causal mask are folded per length), the
    large regions are read from the variant loaded first."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from export_models import export_dynamic_gpt2
    from threads import run_threads

    path = str(tmp_path / "gpt2.onnx")
    export_dynamic_gpt2(path, vocab_size=500, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    res = compile_variants(path, variants=[{"seq": 8}, {"seq": 16}, {"seq": 5, "batch": 1}], dim_sizes={"batch": 2},
                           distributed_config={"mesh_shape": [2], "algo": "megatron"},
                           optimization_config={"target": "cpu"}, out_dir=tmp_path / "out")
    assert res.shared_weights == 0 and res.external_bytes > 0  # (the files differ; their large regions alike)
    sess = onnxruntime.InferenceSession(path)
    world = InProcessWorld(2).communicators()
    progs = [load(tmp_path / "out", c.rank, c) for c in world]
    for b, s in ((2, 16), (1, 5), (2, 8)):
        feeds = {"input_ids": np.random.default_rng(s).integers(0, 500, (b, s)).astype(np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}
        want = sess.run(None, feeds)[0]
        for got in run_threads(world, lambda c: progs[c.rank].run(feeds)["logits"], timeout=120):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert all(p.borrowed_bytes > 0 for p in progs)
