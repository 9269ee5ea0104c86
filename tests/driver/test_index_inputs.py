"""Graph inputs read as indices (compiler/passes/index_inputs.py): found through the ops that keep
values, written into the ranks' manifests, and checked by the runtime before a run, where the compiled
kernels would clamp an index outside its axis silently."""
import json
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from threads import run_threads

from shardflow.compiler import compile, load_onnx
from shardflow.compiler.passes.index_inputs import input_index_ranges
from shardflow.runtime import InputIndexError, load
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
