"""Large inputs a cpu program reads where the caller's arrays lie (``program.json``'s
``borrowed_inputs``, ``driver._borrowed_inputs``, ``RankProgram._lent``) and the fresh outputs' blocks
taken back when the caller drops them (``runtime.artifact.BlockPool``): which inputs qualify, which
arrays are read in place, that an output the caller holds is never written again, and that a decoding
loop feeding its outputs back equals numpy's step after step."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import compile
from shardflow.runtime import load
from shardflow.runtime.artifact import ArtifactError, aligned_empty

N = 512  # (a [512, 512] float32 tensor: 1 MiB, past both thresholds)
W = np.random.default_rng(0).standard_normal((N, N)).astype(np.float32) / N ** 0.5


def _model() -> onnx.ModelProto:
    """``present = past + x / 2`` (a cache growing by ``x``), ``y = present @ W``, ``s`` the row sums
    of ``x`` (a second reader of ``x``)."""
    nodes = [helper.make_node("Mul", ["x", "half"], ["xh"]),
             helper.make_node("Add", ["past", "xh"], ["present"]),
             helper.make_node("MatMul", ["present", "W"], ["y"]),
             helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0)]
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [N, N]) for n in ("x", "past")]
    outs = [helper.make_tensor_value_info("present", TensorProto.FLOAT, [N, N]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, N]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [N])]
    return helper.make_model(helper.make_graph(nodes, "borrow", io, outs, inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def _want(x, past):
    present = past + x / 2
    return {"present": present, "y": present @ W, "s": x.sum(1)}


def _check(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4, err_msg=k)


def _aligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` at a 64-byte aligned address (as the program's outputs are; numpy's own arrays
    of that size are at 16 bytes past a page, mostly)."""
    b = aligned_empty(a.nbytes).view(a.dtype).reshape(a.shape)
    b[...] = a
    return b


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("borrow") / "o"
    compile(_model(), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
    return out


def _feeds(seed):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((N, N)).astype(np.float32) for n in ("x", "past")}


def test_the_inputs_no_step_writes_are_listed(built, tmp_path):
    program = json.loads((built / "rank0" / "program.json").read_text())
    borrowed = {e["input"]: e for e in program["borrowed_inputs"]}
    assert "x" in borrowed and borrowed["x"]["bytes"] == N * N * 4
    # with the cache kept as state, the present is written over the past: the past is not lent
    out = tmp_path / "state"
    compile(_model(), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out,
            state={"present": "past"})
    program = json.loads((out / "rank0" / "program.json").read_text())
    assert [e["input"] for e in program["borrowed_inputs"]] == ["x"]


def test_contiguous_arrays_are_read_in_place_and_others_copied(built):
    prog = load(built)
    feeds = _feeds(1)
    want = _want(**feeds)
    aligned = {k: _aligned(v) for k, v in feeds.items()}
    assert set(prog._lent(aligned)) == {e for e in prog._borrowed} and "x" in prog._lent(aligned)
    _check(prog.run(aligned), want)
    shifted = np.empty(N * N + 1, np.float32)[1:].reshape(N, N)  # (4 bytes off 64: read in place)
    shifted[...] = feeds["x"]
    unaligned = np.frombuffer(bytearray(N * N * 4 + 1), np.float32, N * N, offset=1).reshape(N, N)
    unaligned[...] = feeds["x"]  # (its floats at odd addresses: copied)
    read_only = _aligned(feeds["x"])
    read_only.flags.writeable = False
    strided = np.asfortranarray(feeds["x"])
    for x in (feeds["x"], shifted, unaligned, read_only, strided):
        _check(prog.run(dict(aligned, x=x)), want)
    assert ["x" in prog._lent({"x": a}) for a in (shifted, unaligned, read_only, strided)] == [True, False, True, False]
    # an output view of the last run lies in the arena, which the kernels overwrite: copied
    views = prog.run(aligned, copy_outputs=False)
    assert "past" not in prog._lent({"past": views["present"]})
    _check(prog.run(dict(aligned, past=views["present"])), _want(feeds["x"], want["present"]))
    # the arrays read in place are the caller's: never written
    for k in feeds:
        np.testing.assert_array_equal(aligned[k], feeds[k])


def test_a_decoding_loop_feeds_its_outputs_back(built):
    """Each step's present is the next step's past: read in place (the outputs are aligned), while the
    step writes the new present and y into the blocks the caller dropped."""
    prog = load(built)
    feeds = _feeds(2)
    past, ref_past, addresses = feeds["past"], feeds["past"], []
    for step in range(6):
        x = feeds["x"] * (step + 1)
        if step:
            assert "past" in prog._lent({"x": x, "past": past})
        out = prog.run({"x": x, "past": past})
        assert out["y"].flags.writeable and out["y"].flags.c_contiguous  # (the caller's, as any fresh array)
        want = _want(x, ref_past)
        _check(out, want)
        assert not np.shares_memory(out["present"], past)
        addresses.append((out["present"].ctypes.data, out["y"].ctypes.data))
        past, ref_past = out["present"], want["present"]
        del out
    # once the loop runs, three blocks of 1 MiB take turns: the past held, the present and y written
    assert len({a for pair in addresses[2:] for a in pair}) == 3


def test_an_output_held_is_never_written_again(built):
    prog = load(built)
    feeds = _feeds(3)
    first = prog.run(feeds)
    kept = first["y"][7:9].copy()
    row = first["y"][7:9]  # a view: it keeps the whole block
    address = first["y"].ctypes.data
    del first
    for seed in (4, 5, 6):
        other = _feeds(seed)
        got = prog.run(other)
        _check(got, _want(**other))
        assert not np.shares_memory(got["y"], row) and not np.shares_memory(got["present"], row)
        if seed < 6:  # (the last run's outputs kept: the pool's two blocks of 1 MiB are out)
            del got
    np.testing.assert_array_equal(row, kept)
    del row
    # dropped at last, its block goes back to the pool and serves the next run
    assert address in {a.ctypes.data for a in prog.run(feeds).values()}


def test_a_borrowed_input_written_by_a_step_is_refused(built, tmp_path):
    copy = tmp_path / "bad"
    shutil.copytree(built, copy)
    path = copy / "rank0" / "program.json"
    program = json.loads(path.read_text())
    entry = next(e for e in program["borrowed_inputs"] if e["input"] == "x")
    step = next(s for s in program["steps"] if entry["buffers"][0] in s["inputs"])
    step["outputs"].append(entry["buffers"][0])  # (as if its kernel wrote x in place)
    path.write_text(json.dumps(program))
    with pytest.raises(ArtifactError, match="borrowed input 'x' is written by a step"):
        load(copy, verify=False)


def test_a_split_input_is_read_in_place_on_each_rank(tmp_path):
    """``x`` split by rows over two ranks: each rank's part of the caller's array (rows of it, so
    contiguous) is read where it lies, and both ranks return the single-device values."""
    from threads import run_threads

    from shardflow.runtime.comm import InProcessWorld

    out = tmp_path / "two"
    compile(_model(), distributed_config={"mesh_shape": [2], "input_placements": {"x": "S(0)", "past": "S(0)"}},
            optimization_config={"target": "cpu"}, out_dir=out)
    world = InProcessWorld(2).communicators()
    programs = [load(out, c.rank, c) for c in world]
    feeds = {k: _aligned(v) for k, v in _feeds(7).items()}
    lent = [set(p._lent({"x": feeds["x"][256 * r:256 * (r + 1)]})) for r, p in enumerate(programs)]
    assert lent == [{"x"}, {"x"}], lent
    for got in run_threads(world, lambda c: programs[c.rank].run(feeds)):
        _check(got, _want(**feeds))
