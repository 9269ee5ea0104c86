"""Sequences and optionals (handlers_sequence): resolved at import into lists of the graph's tensors (a
sequence graph input or output taken and returned item by item), checked against the onnx package's
sequence models (their reference outputs), against onnxruntime, compiled for cpu, and refused with typed
errors where a program would need a value it cannot hold."""
from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import onnx.backend.test
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import (ModelFormatError, ShapeError, ShardflowError, UnsupportedOperatorError, cli, compile,
                                load_onnx)
from shardflow.runtime import load
from test_control_flow import const, model, ort_run, vi

F, I64 = TensorProto.FLOAT, TensorProto.INT64
_SIMPLE = os.path.join(os.path.dirname(onnx.backend.test.__file__), "data", "simple")


def seq_vi(name, elem, shape=None):
    return helper.make_tensor_sequence_value_info(name, elem, shape)


@pytest.mark.parametrize("case", sorted(os.path.basename(d) for d in glob.glob(os.path.join(_SIMPLE,
                                                                                           "test_sequence_model*"))))
def test_the_onnx_packages_sequence_models(case):
    """test_sequence_model1-8 (SequenceEmpty/Construct/Insert/Erase/At/Length, SplitToSequence,
    ConcatFromSequence; tensors in and out): the evaluator against the reference outputs shipped with
    them. Model 8's split lengths are a graph input: bound at import, as any shape-steering input."""
    folder = os.path.join(_SIMPLE, case)
    m = onnx.load(os.path.join(folder, "model.onnx"))
    data = os.path.join(folder, "test_data_set_0")
    inits = {i.name for i in m.graph.initializer}
    real = [v for v in m.graph.input if v.name not in inits]
    feeds = {v.name: numpy_helper.to_array(onnx.load_tensor(os.path.join(data, f"input_{k}.pb")))
             for k, v in enumerate(real)}
    want = [numpy_helper.to_array(onnx.load_tensor(os.path.join(data, f"output_{k}.pb")))
            for k in range(len(m.graph.output))]
    bound = {k: v for k, v in feeds.items() if v.dtype == np.int64}  # (model 8's splits)
    g = load_onnx(m, input_shapes={k: v.shape for k, v in feeds.items() if k not in bound}, input_values=bound)
    got = g.run({k: v for k, v in feeds.items() if k not in bound})
    for out, w in zip(m.graph.output, want):
        assert got[out.name].shape == w.shape
        np.testing.assert_array_equal(got[out.name], w, err_msg=out.name)


def _evaluated_and_compiled_match_onnxruntime(m, feeds, tmp_path):
    want = ort_run(m, feeds)
    got = load_onnx(m).run(feeds)
    res = compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out")
    ran = load(res.out_dir).run(feeds)
    # (onnxruntime returns a sequence output as a list; ours are its items, name[0], name[1], ...)
    want = {k: v for name, w in want.items()
            for k, v in (zip([f"{name}[{i}]" for i in range(len(w))], w) if isinstance(w, list) else [(name, w)])}
    assert sorted(got) == sorted(ran) == sorted(want)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=1e-6, err_msg=f"evaluator {name}")
        np.testing.assert_allclose(ran[name], w, rtol=1e-5, atol=1e-6, err_msg=f"cpu program {name}")


def _split_and_gather():
    """SplitToSequence three ways (scalar chunks with a short last one, given lengths, ones with the
    axis dropped), SequenceAt from the end, SequenceErase/Insert, SequenceLength and both kinds of
    ConcatFromSequence."""
    nodes = [
        helper.make_node("SplitToSequence", ["x", "three"], ["s3"], axis=1),  # 3, 3, 1 columns
        helper.make_node("SplitToSequence", ["x", "lens"], ["sl"], axis=0),  # rows 1 and 3
        helper.make_node("SplitToSequence", ["x"], ["s1"], axis=-1, keepdims=0),  # 7 columns of 4
        helper.make_node("SequenceAt", ["s3", "minus1"], ["last"]),
        helper.make_node("SequenceErase", ["s1", "zero"], ["s1e"]),
        helper.make_node("SequenceInsert", ["s1e", "row", "minus1"], ["s1i"]),
        helper.make_node("SequenceLength", ["s1i"], ["n"]),
        helper.make_node("ConcatFromSequence", ["s1i"], ["stacked"], axis=1, new_axis=1),
        helper.make_node("ConcatFromSequence", ["sl"], ["joined"], axis=0),
        helper.make_node("SequenceAt", ["sl", "zero"], ["first"]),
        helper.make_node("Relu", ["first"], ["first_relu"]),
        helper.make_node("SequenceConstruct", ["row", "row"], ["rows"]),
        helper.make_node("SequenceAt", ["rows", "one"], ["row_again"]),  # (a graph input, straight out)
    ]
    inits = [const("three", np.array(3, np.int64)), const("lens", np.array([1, 3], np.int64)),
             const("minus1", np.array(-1, np.int64)), const("zero", np.array(0, np.int32)),
             const("one", np.array(1, np.int64))]
    m = model(nodes, [vi("x", F, [4, 7]), vi("row", F, [4])],
              [vi("last", F, [4, 1]), vi("n", I64, []), vi("stacked", F, [4, 7]), vi("joined", F, [4, 7]),
               vi("first_relu", F, [1, 7]), vi("row_again", F, [4])], inits)
    rng = np.random.default_rng(0)
    return m, {"x": rng.standard_normal((4, 7)).astype(np.float32), "row": rng.standard_normal(4).astype(np.float32)}


def _loop_appending():
    """A Loop that appends a tensor computed from the iteration number to a carried sequence (the
    pattern of a scripted list append), concatenated after the loop, and a SequenceMap over it with a
    tensor input beside the sequence."""
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["fi"], to=F),
         helper.make_node("Mul", ["x", "fi"], ["xi"]),
         helper.make_node("SequenceInsert", ["seq_in", "xi"], ["seq_out"]),
         helper.make_node("Identity", ["cond"], ["cond_out"])],
        "body", [vi("i", I64, []), vi("cond", TensorProto.BOOL, []), seq_vi("seq_in", F)],
        [vi("cond_out", TensorProto.BOOL, []), seq_vi("seq_out", F)])
    mapped = helper.make_graph(
        [helper.make_node("Add", ["e", "b"], ["sum"]), helper.make_node("ReduceSum", ["sum"], ["r"], keepdims=1)],
        "map", [vi("e", F, [2, 3]), vi("b", F, [3])], [vi("r", F, [1, 1])])
    nodes = [helper.make_node("SequenceEmpty", [], ["empty"], dtype=F),
             helper.make_node("Loop", ["trips", "", "empty"], ["seq"], body=body),
             helper.make_node("ConcatFromSequence", ["seq"], ["all"], axis=0),
             helper.make_node("SequenceMap", ["seq", "b"], ["sums"], body=mapped),
             helper.make_node("ConcatFromSequence", ["sums"], ["sum_rows"], axis=-1)]
    m = model(nodes, [vi("x", F, [2, 3]), vi("b", F, [3])], [vi("all", F, [8, 3]), vi("sum_rows", F, [1, 4])],
              [const("trips", np.array(4, np.int64))])
    rng = np.random.default_rng(1)
    return m, {"x": rng.standard_normal((2, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}


@pytest.mark.parametrize("case", [_split_and_gather, _loop_appending], ids=["split-gather", "loop-append"])
def test_sequences_against_onnxruntime_and_compiled_for_cpu(tmp_path, case):
    m, feeds = case()
    _evaluated_and_compiled_match_onnxruntime(m, feeds, tmp_path)


def test_a_sequence_output_is_returned_item_by_item(tmp_path):
    """A graph output that is a sequence gives the outputs ``name[0]``, ``name[1]``, ...: a split's
    parts, and a graph input returned twice (each its own output tensor), evaluated and compiled."""
    x = vi("x", F, [3, 2])
    m = model([helper.make_node("SplitToSequence", ["x"], ["parts"], axis=0),
               helper.make_node("SequenceConstruct", ["x", "x"], ["twice"])],
              [x], [seq_vi("parts", F, [1, 2]), seq_vi("twice", F, [3, 2])])
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    want = {"parts[0]": a[:1], "parts[1]": a[1:2], "parts[2]": a[2:], "twice[0]": a, "twice[1]": a}
    got = load_onnx(m).run({"x": a})
    res = compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out")
    ran = load(res.out_dir).run({"x": a})
    for outs in (got, ran):
        assert sorted(outs) == sorted(want)
        for name, w in want.items():
            np.testing.assert_array_equal(outs[name], w, err_msg=name)


def _sequence_in():
    """A sequence graph input, its items concatenated and one of them read."""
    return model([helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0),
                  helper.make_node("SequenceAt", ["s", "one"], ["second"])],
                 [seq_vi("s", F, ["n", 3])], [vi("y", F, ["a", 3]), vi("second", F, ["b", 3])],
                 [const("one", np.array(1, np.int64))])


def test_a_sequence_input_is_taken_item_by_item(tmp_path):
    """A sequence graph input's length is not in the model: its items' shapes are given as a list
    (the program takes the items as the inputs s[0], s[1], ...), or its items bound as arrays."""
    items = [np.full((k + 1, 3), k, np.float32) for k in range(3)]
    want = {"y": np.concatenate(items), "second": items[1]}
    g = load_onnx(_sequence_in(), input_shapes={"s": [a.shape for a in items]})
    assert [t.name for t in g.inputs] == ["s[0]", "s[1]", "s[2]"]
    feeds = {f"s[{k}]": a for k, a in enumerate(items)}
    res = compile(_sequence_in(), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out", input_shapes={"s": [a.shape for a in items]})
    bound = load_onnx(_sequence_in(), input_values={"s": items})
    assert bound.inputs == []
    for outs in (g.run(feeds), load(res.out_dir).run(feeds), bound.run({})):
        for name, w in want.items():
            np.testing.assert_array_equal(outs[name], w, err_msg=name)
    # the command line gives the items' shapes in brackets
    path = tmp_path / "seq_in.onnx"
    onnx.save(_sequence_in(), path)
    assert cli.main(["compile", str(path), "-o", str(tmp_path / "cli"), "--shape", "s=[1x3,2x3,3x3]"]) == 0
    np.testing.assert_array_equal(load(tmp_path / "cli").run(feeds)["y"], want["y"])
    # ... and binds its items from .npy files in brackets
    for k, a in enumerate(items):
        np.save(tmp_path / f"s{k}.npy", a)
    files = ",".join(str(tmp_path / f"s{k}.npy") for k in range(3))
    assert cli.main(["compile", str(path), "-o", str(tmp_path / "cli_bound"), "--value", f"s=[{files}]"]) == 0
    assert load(tmp_path / "cli_bound").input_names == []
    np.testing.assert_array_equal(load(tmp_path / "cli_bound").run({})["y"], want["y"])
    with pytest.raises(ShapeError, match=r"graph input 's' is a sequence.*input_shapes=\{'s': \[\(\.\.\.\), "):
        load_onnx(_sequence_in())
    with pytest.raises(ShapeError, match=r"input_shapes\['s'\] = \(2, 3\): the input is a sequence"):
        load_onnx(_sequence_in(), input_shapes={"s": (2, 3)})
    with pytest.raises(ShapeError, match=r"input_shapes\['s'\]\[1\] = \(2, 4\): dim 1 is fixed to 3"):
        load_onnx(_sequence_in(), input_shapes={"s": [(2, 3), (2, 4)]})


def test_what_a_program_cannot_hold_is_refused_by_name():
    x = vi("x", F, [2, 3])
    # a position out of range, and one computed from graph inputs
    nodes = [helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
             helper.make_node("SequenceAt", ["s", "p"], ["y"])]
    m = model(nodes, [x], [vi("y", F, ["a", "b"])], [const("p", np.array(2, np.int64))])
    with pytest.raises(ShapeError, match=r"SequenceAt.*position 2 is outside \[-2, 1\]"):
        load_onnx(m)
    m = model(nodes, [x, vi("p", I64, [])], [vi("y", F, ["a", "b"])])
    with pytest.raises(UnsupportedOperatorError, match="must be known at compile time"):
        load_onnx(m)
    # the concatenation of an empty sequence has no shape; a sequence of mixed types is not one
    m = model([helper.make_node("SequenceEmpty", [], ["s"]), helper.make_node("ConcatFromSequence", ["s"], ["y"],
                                                                              axis=0)], [], [vi("y", F, ["a", "b"])])
    with pytest.raises(UnsupportedOperatorError, match="an empty sequence"):
        load_onnx(m)
    i = vi("i", I64, [2])
    m = helper.make_model(helper.make_graph([helper.make_node("SequenceConstruct", ["x", "i"], ["s"], name="mixed"),
                                             helper.make_node("SequenceLength", ["s"], ["n"])], "g", [x, i],
                                            [vi("n", I64, [])]), opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelFormatError, match="node mixed .*different element types"):
        load_onnx(m)


def test_a_scripted_torch_module_with_list_ops(tmp_path):
    """What users' models hold: a ``torch.jit.script``ed forward that splits its input into a list,
    appends to another in a loop, concatenates and stacks it and returns it too, exported by the
    TorchScript exporter (SplitToSequence, a Loop carrying a SequenceInsert, SequenceLength,
    ConcatFromSequence, a sequence output); the evaluator and the cpu program against onnxruntime."""
    torch = pytest.importorskip("torch")
    from typing import List

    class Chunks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            parts: List[torch.Tensor] = []
            for chunk in torch.split(x, 2, dim=1):
                parts.append(torch.relu(self.lin(chunk)))
            return torch.cat(parts, dim=1) + torch.stack(parts, 0).sum(0).repeat(1, len(parts), 1), parts

    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    path = str(tmp_path / "chunks.onnx")
    torch.onnx.export(torch.jit.script(Chunks()), (x,), path, opset_version=17, dynamo=False)
    m = onnx.load(path)
    assert {"SplitToSequence", "ConcatFromSequence", "Loop"} <= {n.op_type for n in m.graph.node}
    name = m.graph.input[0].name
    feeds = {name: x.numpy()}
    _evaluated_and_compiled_match_onnxruntime(m, feeds, tmp_path)


def test_optionals_of_tensors_and_sequences(tmp_path):
    """``Optional`` holding a tensor or a sequence is that value (OptionalHasElement true,
    OptionalGetElement the value); an empty ``Optional`` is known empty at import."""
    x = vi("x", F, [2, 3])
    nodes = [helper.make_node("Optional", ["x"], ["ox"]),
             helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
             helper.make_node("Optional", ["s"], ["os"]),
             helper.make_node("OptionalHasElement", ["os"], ["has"]),
             helper.make_node("OptionalGetElement", ["os"], ["s2"]),
             helper.make_node("ConcatFromSequence", ["s2"], ["y"], axis=1),
             helper.make_node("OptionalGetElement", ["ox"], ["x2"])]
    m = model(nodes, [x], [vi("has", TensorProto.BOOL, []), vi("y", F, [1, 6]), vi("x2", F, [2, 3])], opset=18)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = load_onnx(m).run({"x": a})
    want = ort_run(m, {"x": a})
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    # an empty Optional: OptionalHasElement false (through an Identity too), evaluated, compiled and by
    # onnxruntime; OptionalGetElement of it, another op given it and a graph output of it refused by name
    opt_type = helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2]))
    empty = helper.make_node("Optional", [], ["e"], name="nothing", type=helper.make_tensor_type_proto(F, [2]))
    m = model([empty, helper.make_node("Identity", ["e"], ["e2"]), helper.make_node("OptionalHasElement", ["e2"],
                                                                                   ["has"])],
              [], [vi("has", TensorProto.BOOL, [])], opset=18)
    assert load_onnx(m).run({})["has"] == ort_run(m, {})["has"] == np.array(False)
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    assert load(tmp_path / "o").run({})["has"] == np.array(False)
    for reader, match in ((helper.make_node("OptionalGetElement", ["e"], ["y"], name="get"),
                           r"node get \(OptionalGetElement\): reads the empty optional 'nothing', which has no"),
                          (helper.make_node("Shape", ["e"], ["y"], name="sz"),
                           r"node sz \(Shape\): input 0 \('e'\), an empty optional \(from 'nothing'")):
        with pytest.raises(ShardflowError, match=match):
            load_onnx(model([empty, reader], [], [vi("y", F, [2])], opset=18))
    with pytest.raises(UnsupportedOperatorError, match="graph output 'e' is an empty optional"):
        load_onnx(model([empty], [], [helper.make_value_info("e", opt_type)], opset=18))
    # an optional graph input bound to None is an empty optional; a tensor input cannot be
    opt_in = helper.make_value_info("o", opt_type)
    m = model([helper.make_node("OptionalHasElement", ["o"], ["has"])], [opt_in], [vi("has", TensorProto.BOOL, [])],
              opset=18)
    g = load_onnx(m, input_values={"o": None})
    assert g.inputs == [] and g.run({})["has"] == np.array(False)
    assert load_onnx(m).run({"o": np.ones(2, np.float32)})["has"] == np.array(True)  # (compiled as present)
    with pytest.raises(ShapeError, match=r"input_values\['x'\] is None, but only an optional input"):
        load_onnx(model([helper.make_node("Relu", ["x"], ["y"])], [x], [vi("y", F, [2, 3])]), input_values={"x": None})


def test_a_sequence_given_to_another_op_is_refused_by_name():
    m = helper.make_model(helper.make_graph(
        [helper.make_node("SplitToSequence", ["x"], ["s"], axis=0), helper.make_node("Shape", ["s"], ["n"], name="sz")],
        "g", [vi("x", F, [2, 3])], [vi("n", I64, [1])]), opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOperatorError, match=r"node sz \(Shape\): input 0 \('s'\), a sequence"):
        load_onnx(m)
