"""Index values checked at run time (compiler/passes/index_checks.py), where the compiled kernels would
clamp an index outside its axis silently: graph inputs read as indices, found through the ops that keep
values, written into the ranks' manifests and checked before a run; indices computed in the graph and not
proven in range by its value ranges, counted by extra outputs the runtime reads after the run."""
import json
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from threads import run_threads

from shardflow.compiler import compile, load_onnx
from shardflow.compiler.driver import planned_graph
from shardflow.compiler.passes.index_checks import index_check_outputs, input_index_ranges, value_ranges
from shardflow.runtime import ArtifactError, IndexRangeError, InputIndexError, load
from shardflow.runtime.comm import InProcessWorld

MODELS = os.path.join(os.path.dirname(__file__), "..", "models")


def _model(nodes, inputs, output, inits=()):
    vi = helper.make_tensor_value_info
    return helper.make_model(helper.make_graph(nodes, "g", [vi(n, t, s) for n, t, s in inputs], [vi(*output)],
                                               list(inits)), opset_imports=[helper.make_opsetid("", 17)])


def test_an_index_input_is_followed_through_the_ops_that_keep_values():
    """Token ids (int32, widened, unsqueezed) into a table of 5 rows; lengths into a ReverseSequence of 4
    steps; an index computed by an Add is not followed (its values are not the input's)."""
    model = _model([helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
                    helper.make_node("Unsqueeze", ["ids64", "ax"], ["ids2"]),
                    helper.make_node("Gather", ["table", "ids2"], ["emb"], name="embed"),
                    helper.make_node("Add", ["pos", "one"], ["pos1"]),
                    helper.make_node("Gather", ["table", "pos1"], ["pe"], name="positions"),
                    helper.make_node("ReverseSequence", ["x", "lens"], ["r"], name="rev"),
                    helper.make_node("ReduceSum", ["emb"], ["s1"], keepdims=0),
                    helper.make_node("ReduceSum", ["pe"], ["s2"], keepdims=0),
                    helper.make_node("ReduceSum", ["r"], ["s3"], keepdims=0),
                    helper.make_node("Sum", ["s1", "s2", "s3"], ["y"])],
                   [("table", TensorProto.FLOAT, [5, 3]), ("ids", TensorProto.INT32, [2]),
                    ("pos", TensorProto.INT64, [2]), ("x", TensorProto.FLOAT, [4, 2]),
                    ("lens", TensorProto.INT64, [2])],
                   ("y", TensorProto.FLOAT, []),
                   [numpy_helper.from_array(np.array([1], np.int64), "ax"),
                    numpy_helper.from_array(np.array(1, np.int64), "one")])
    assert input_index_ranges(load_onnx(model)) == {"ids": [(-5, 4, "embed")], "lens": [(0, 4, "rev")]}


def test_token_ids_past_the_table_are_refused_on_every_rank(tmp_path):
    """GPT-2's token ids on two ranks (Megatron: the table split by vocabulary rows, each rank's gather
    reading zeros outside its rows): both manifests check input_ids against the whole table, a run
    with an id past it raises InputIndexError naming the input and the embedding on each rank (the
    kernels would have clamped it, a plausible wrong answer), and in-range ids run."""
    model = os.path.join(MODELS, "gpt2_ts17.onnx")
    feeds = dict(np.load(os.path.join(MODELS, "gpt2_inputs.npz")))
    rows = 128  # (tests/models/export_models.py's VOCAB: the table's rows)
    res = compile(model, distributed_config={"mesh_shape": [2], "algo": "megatron"},
                  optimization_config={"target": "cpu"}, out_dir=tmp_path / "out")
    for r in range(2):
        entry = next(e for e in json.loads((res.out_dir / f"rank{r}" / "manifest.json").read_text())["inputs"]
                     if e["name"] == "input_ids")
        assert entry["index_checks"] == [[-rows, rows - 1, "/model/transformer/wte/Gather"]]
    world = InProcessWorld(2).communicators()
    programs = [load(res.out_dir, c.rank, c) for c in world]
    good = run_threads(world, lambda c: programs[c.rank].run(feeds))
    bad = dict(feeds, input_ids=feeds["input_ids"].copy())
    bad["input_ids"][1, 3] = rows
    for p in programs:
        with pytest.raises(InputIndexError, match=rf"input 'input_ids' holds the index {rows}, outside "
                                                  rf"\[-{rows}, {rows - 1}\].*wte/Gather") as info:
            p.run(bad)
        assert info.value.input_name == "input_ids"
    again = run_threads(world, lambda c: programs[c.rank].run(feeds))  # (nothing was left half-run)
    np.testing.assert_array_equal(again[0]["logits"], good[0]["logits"])


def _const(name, value, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def test_computed_indices_are_checked_where_their_ranges_do_not_prove_them():
    """The value ranges of the graph prove an ArgMax's, a TopK's and a clipped index in range, and an
    input checked against the table before the run; an offset added to that input, a sum of a mask and
    a GatherND's computed rows and columns (axes of 5 and 4: one check per column) are checked, one
    check for the two gathers reading the same positions."""
    model = _model([helper.make_node("ArgMax", ["x"], ["am"], axis=1, keepdims=0),
                    helper.make_node("Gather", ["table", "am"], ["g_am"], name="by_argmax"),
                    helper.make_node("TopK", ["x", "k2"], ["tv", "ti"], axis=1),
                    helper.make_node("GatherElements", ["x", "ti"], ["g_topk"], axis=1, name="by_topk"),
                    helper.make_node("Clip", ["pos", "zero", "four"], ["pc"]),
                    helper.make_node("Gather", ["table", "pc"], ["g_clip"], name="by_clip"),
                    helper.make_node("Gather", ["table", "pos"], ["g_pos"], name="by_input"),
                    helper.make_node("Add", ["pos", "one"], ["pos1"]),
                    helper.make_node("Gather", ["table", "pos1"], ["g_off"], name="by_offset"),
                    helper.make_node("ReduceSum", ["mask", "ax1"], ["n"], keepdims=0),
                    helper.make_node("Gather", ["table", "n"], ["g_sum"], name="by_sum"),
                    helper.make_node("Gather", ["x", "n"], ["g_sum2"], name="by_sum_too"),
                    helper.make_node("Add", ["nd", "one"], ["nd1"]),
                    helper.make_node("GatherND", ["x", "nd1"], ["g_nd"], name="by_nd")]
                   + [helper.make_node("ReduceSum", [o], [f"s{k}"], keepdims=0) for k, o in enumerate(
                       ["g_am", "g_topk", "g_clip", "g_pos", "g_off", "g_sum", "g_sum2", "g_nd"])]
                   + [helper.make_node("Sum", [f"s{k}" for k in range(8)], ["y"])],
                   [("table", TensorProto.FLOAT, [5, 4]), ("x", TensorProto.FLOAT, [5, 4]),
                    ("pos", TensorProto.INT64, [2]), ("mask", TensorProto.INT64, [2, 6]),
                    ("nd", TensorProto.INT64, [2, 2])],
                   ("y", TensorProto.FLOAT, []),
                   [_const("k2", [2]), _const("zero", 0), _const("four", 4), _const("one", 1), _const("ax1", [1])])
    g = planned_graph(model, distributed_config={"mesh_shape": [1]})
    checks = {(tuple(c["nodes"]), c["lo"], c["hi"], c["column"]) for c in index_check_outputs(g)}
    assert checks == {(("by_offset",), -5, 4, None), (("by_sum", "by_sum_too"), -5, 4, None),
                      (("by_nd",), -5, 4, 0), (("by_nd",), -4, 3, 1)}
    ranges = value_ranges(g, input_index_ranges(g))
    by_name = {t.name: ranges.get(id(t)) for op in g.nodes for t in op.outputs}
    by_name.update({t.name: ranges[id(t)] for t in g.inputs if id(t) in ranges})
    assert by_name["pos"] == (-5, 4) and by_name["am"] == (0, 3) and by_name["ti"] == (0, 3)
    assert by_name["pc"] == (0, 4) and by_name["pos1"] == (-4, 5)
    assert g.output_names[:1] == ["y"] and len(g.output_names) == 5
    # the evaluator still raises at the gather itself, as onnxruntime does
    feeds = {"table": np.ones((5, 4), np.float32), "x": np.ones((5, 4), np.float32), "pos": np.array([0, 3]),
             "mask": np.ones((2, 6), np.int64), "nd": np.zeros((2, 2), np.int64)}
    with pytest.raises(Exception, match="by_sum"):
        g.run(feeds)
    assert not index_check_outputs(planned_graph(model, distributed_config={"mesh_shape": [1]},
                                                 optimization_config={"index_checks": False}))


def _positions_model(batch=2, seq=6, rows=8):
    """Position ids computed from an attention mask as transformers writes them, ``cumsum(mask) - 1``
    (padding at 1), looked up in a table of ``rows`` positions, plus the token embedding."""
    return _model([helper.make_node("CumSum", ["mask", "ax1"], ["c"]),
                   helper.make_node("Sub", ["c", "one"], ["p0"]),
                   helper.make_node("Equal", ["mask", "zero"], ["pad"]),
                   helper.make_node("Where", ["pad", "one", "p0"], ["positions"]),
                   helper.make_node("Gather", ["wpe", "positions"], ["pe"], name="wpe/Gather"),
                   helper.make_node("Gather", ["wte", "ids"], ["te"], name="wte/Gather"),
                   helper.make_node("Add", ["pe", "te"], ["y"])],
                  [("ids", TensorProto.INT64, [batch, seq]), ("mask", TensorProto.INT64, [batch, seq])],
                  ("y", TensorProto.FLOAT, [batch, seq, 3]),
                  [_const("ax1", 1), _const("one", 1), _const("zero", 0),
                   numpy_helper.from_array(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3), "wpe"),
                   numpy_helper.from_array(np.arange(30, dtype=np.float32).reshape(10, 3) / 7, "wte")])


def _feeds(seq=6, lengths=(6, 4)):
    mask = np.array([[1] * n + [0] * (seq - n) for n in lengths], np.int64)
    return {"ids": np.arange(2 * seq, dtype=np.int64).reshape(2, seq) % 10, "mask": mask}


def test_a_computed_position_past_its_table_is_refused_after_the_run(tmp_path):
    """Positions from a mask (cumsum - 1) into a table of 8 rows, compiled for cpu: the manifest lists the
    check (the output is hidden from the program's outputs), runs within the table match onnxruntime, a
    mask that counts to position 9 raises IndexRangeError naming the gather (onnxruntime refuses it too),
    and the program runs again after it; with index_checks false there is no check."""
    import onnxruntime as ort

    model = _positions_model()
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out")
    manifest = json.loads((res.out_dir / "rank0" / "manifest.json").read_text())
    assert manifest["index_checks"] == [{"output": "__index_check_0", "nodes": ["wpe/Gather"], "lo": -8, "hi": 7,
                                         "column": None}]
    assert [o["name"] for o in manifest["outputs"]] == ["y"]
    prog = load(res.out_dir)
    assert prog.output_names == ["y"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    good = _feeds()
    got = prog.run(good)
    assert list(got) == ["y"]
    np.testing.assert_allclose(got["y"], sess.run(None, good)[0], rtol=1e-6)
    bad = dict(good, mask=np.ones((2, 6), np.int64))
    bad["mask"][1, :] = 2  # positions 1, 3, 5, 7, 9, 11: two past the table
    with pytest.raises(Exception):
        sess.run(None, bad)
    with pytest.raises(IndexRangeError, match=r"2 value\(s\) of the index tensor that node 'wpe/Gather' reads "
                                              r"lay outside \[-8, 7\]") as info:
        prog.run(bad)
    assert info.value.nodes == ("wpe/Gather",)
    with pytest.raises(IndexRangeError):  # (the count is read where its kernel wrote it, views or copies)
        prog.run(bad, copy_outputs=False)
    np.testing.assert_array_equal(prog.run(good)["y"], got["y"])
    np.testing.assert_array_equal(prog.run(good, copy_outputs=False)["y"], got["y"])
    broken = dict(manifest, index_checks=[dict(manifest["index_checks"][0], output="__index_check_7")])
    (res.out_dir / "rank0" / "manifest.json").write_text(json.dumps(broken))
    with pytest.raises(ArtifactError, match=r"index check output\(s\) \['__index_check_7'\] of the manifest"):
        load(res.out_dir)
    res = compile(model, distributed_config={"mesh_shape": [1]},
                  optimization_config={"target": "cpu", "index_checks": False}, out_dir=tmp_path / "off")
    manifest = json.loads((res.out_dir / "rank0" / "manifest.json").read_text())
    assert "index_checks" not in manifest and not any("index_checks" in e for e in manifest["inputs"])
    assert set(load(res.out_dir).run(bad)) == {"y"}  # (clamped, as documented)


def test_a_split_computed_index_is_refused_on_every_rank(tmp_path):
    """The same positions split by the batch over two ranks (the mask's placement): the check's output is
    whole on every rank, as any output (the plan gathers the positions, or sums the ranks' counts), so
    both ranks raise though only rank 1's rows leave the table; in-range runs match the single-device
    program."""
    model = _positions_model()
    res = compile(model, distributed_config={"mesh_shape": [2], "input_placements": {"mask": "S(0)", "ids": "S(0)"}},
                  optimization_config={"target": "cpu"}, out_dir=tmp_path / "two")
    one = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "one")
    world = InProcessWorld(2).communicators()
    programs = [load(res.out_dir, c.rank, c) for c in world]
    good = _feeds()
    got = run_threads(world, lambda c: programs[c.rank].run(good))
    want = load(one.out_dir).run(good)["y"]
    for r in range(2):
        np.testing.assert_allclose(got[r]["y"], want, rtol=1e-6)
    bad = dict(good, mask=good["mask"].copy())
    bad["mask"][1, :] = 3  # only the second row (rank 1's) leaves the table

    def run(c):
        try:
            programs[c.rank].run(bad)
        except IndexRangeError as exc:
            return str(exc)
        return None
    errors = run_threads(world, run)
    assert all(e is not None and "wpe/Gather" in e for e in errors), errors
    again = run_threads(world, lambda c: programs[c.rank].run(good))
    np.testing.assert_allclose(again[0]["y"], want, rtol=1e-6)


def _position_state_model(n: int):
    """``n`` decoding positions read from a table of 8 rows (``y = table[pos]``) and advanced by one
    (``pos_next = pos + 1``, the state's next value)."""
    return helper.make_model(helper.make_graph(
        [helper.make_node("Gather", ["table", "pos"], ["y"], name="pe"),
         helper.make_node("Add", ["pos", "one"], ["pos_next"])], "g",
        [helper.make_tensor_value_info("pos", TensorProto.INT64, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, 2]),
         helper.make_tensor_value_info("pos_next", TensorProto.INT64, [n])],
        [numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(8, 2), "table"), _const("one", 1)]),
        opset_imports=[helper.make_opsetid("", 17)])


def test_a_position_kept_as_state_is_checked_when_carried_over(tmp_path):
    """A decoding position kept as state (``pos_next = pos + 1``) reads a table of 8 rows: given, or
    carried over from the last run, a position past the table refuses the run before it starts (the
    input check; the state keeps its value) and the program goes on from a position given again."""
    model = _position_state_model(1)
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out", state={"pos_next": "pos"})
    prog = load(res.out_dir)
    np.testing.assert_array_equal(prog.run({"pos": np.array([6])})["y"], [[12, 13]])
    np.testing.assert_array_equal(prog.run({})["y"], [[14, 15]])
    with pytest.raises(InputIndexError, match=r"state input 'pos' \(carried over from the last run\) holds the "
                                              r"index 8, outside \[-8, 7\].*'pe'"):
        prog.run({})
    assert prog.read_state()["pos"].tolist() == [8]
    with pytest.raises(InputIndexError, match=r"input 'pos' holds the index 9"):
        prog.run({"pos": np.array([9])})
    np.testing.assert_array_equal(prog.run({"pos": np.array([-1])})["y"], [[14, 15]])


def test_a_decoding_step_past_its_cache_is_refused_as_onnxruntime_refuses_it(tmp_path):
    """The genai Llama's decoding step, compiled for a cache of 16 positions: a mask counting 17
    (seqlens_k 16) makes onnxruntime's GroupQueryAttention raise; the evaluator raises a ShapeError
    naming it and the compiled program an IndexRangeError (one check for both layers, which read one
    seqlens_k: their range ops are one; the rotary rows then need none: they lie before the cache's
    end)."""
    import onnxruntime as ort
    from model_refs import genai_llama_feeds

    from shardflow.compiler import ShapeError

    path = os.path.join(MODELS, "llama_genai_fp32.onnx")
    feeds = genai_llama_feeds("decode")
    shapes = {k: v.shape for k, v in feeds.items()}
    res = compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out", input_shapes=shapes)
    checks = json.loads((res.out_dir / "rank0" / "manifest.json").read_text())["index_checks"]
    assert [(c["lo"], c["hi"], c["nodes"]) for c in checks] == [
        (0, 15, ["/model/layers.0/attn/GroupQueryAttention/seqlens_k_in_range"])]
    prog = load(res.out_dir)
    np.testing.assert_allclose(prog.run(feeds)["logits"], ort.InferenceSession(path).run(["logits"], feeds)[0],
                               rtol=1e-4, atol=1e-4)
    bad = dict(feeds, attention_mask=feeds["attention_mask"].copy())
    bad["attention_mask"][1, :] = 0
    bad["attention_mask"][1, 0] = 17
    with pytest.raises(Exception, match=r"seqlens_k\[1\] = 16 is out of range \[0, 16\)"):
        ort.InferenceSession(path).run(None, bad)
    with pytest.raises(ShapeError, match=r"layers.0/attn/GroupQueryAttention/seqlens_k_in_range: seqlens_k holds 16, "
                                         r"outside \[0, 15\]"):
        load_onnx(path, input_shapes=shapes).run(bad)
    with pytest.raises(IndexRangeError, match=r"1 value\(s\) of the index tensor that node "
                                              r"'/model/layers.0/attn/GroupQueryAttention/seqlens_k_in_range'"):
        prog.run(bad)


def test_a_position_state_split_over_ranks_is_checked_on_every_rank(tmp_path):
    """Per-sequence positions kept as state and split by the batch over two ranks: carried over, one
    rank's part past the table refuses the run on both ranks (the parts' extremes all-reduced first),
    and the ranks go on together from positions given again, as the single-device program does."""
    model = _position_state_model(4)
    res = compile(model, distributed_config={"mesh_shape": [2], "input_placements": {"pos": "S(0)"},
                                             "output_placements": {"pos_next": "S(0)"}},
                  optimization_config={"target": "cpu"}, out_dir=tmp_path / "two", state={"pos_next": "pos"})
    world = InProcessWorld(2).communicators()
    programs = [load(res.out_dir, c.rank, c) for c in world]
    assert all("pos" in p._parts for p in programs)  # (each rank holds two of the four positions)

    def step(feeds):
        def run(c):
            try:
                return programs[c.rank].run(feeds)["y"]
            except InputIndexError as exc:
                return str(exc)
        return run_threads(world, run)

    got = step({"pos": np.array([0, 1, 5, 6])})
    np.testing.assert_array_equal(got[0], np.arange(16, dtype=np.float32).reshape(8, 2)[[0, 1, 5, 6]])
    step({})  # positions 1, 2, 6, 7: within the table
    errors = step({})  # 2, 3, 7, 8: rank 1's last position is past it
    assert all(isinstance(e, str) and "state input 'pos' (carried over from the last run) holds the index 8" in e
               for e in errors), errors
    got = step({"pos": np.array([3, 2, 1, 0])})
    assert all(np.array_equal(g, np.arange(16, dtype=np.float32).reshape(8, 2)[[3, 2, 1, 0]]) for g in got)
