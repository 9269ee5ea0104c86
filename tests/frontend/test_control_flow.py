"""If, Loop and Scan resolved at import (handlers_control), and functions inlined at import
(model-local ones, and ops the ONNX schema defines as functions), checked against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import UnsupportedOperatorError, load_onnx
from shardflow.compiler.frontend import handlers_control
from shardflow.compiler.parallel import partition, search, simulate

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def model(nodes, inputs, outputs, inits=(), opset=17):
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(m)
    return m


def const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def ort_run(m, feeds):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def check(m, feeds, input_values=None, **kw):
    bound = input_values or {}
    g = load_onnx(m, input_values=bound, **kw)
    got = g.run({k: v for k, v in feeds.items() if k not in bound})
    want = ort_run(m, feeds)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=name)
    return g


def _branch(name, op, x="x"):
    return helper.make_graph([helper.make_node(op, [x], ["out"], name=f"{name}_{op}")], name, [],
                             [vi("out", F, None)])


def if_on_shape(n_rows):
    """If(rows(x) > 2) then Relu(x) else Neg(x): the branches read x from the enclosing graph."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["rows"], axis=0),
             helper.make_node("Greater", ["rows", "two"], ["c"]),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=_branch("then", "Relu"),
                              else_branch=_branch("else", "Neg"))]
    return model(nodes, [vi("x", F, ["n", 3])], [vi("y", F, ["n", 3])],
                 [const("zero", np.int64(0)), const("two", np.int64(2))])


@pytest.mark.parametrize("rows", [2, 4])
def test_if_takes_the_branch_its_static_condition_selects(rows):
    x = np.random.default_rng(0).standard_normal((rows, 3)).astype(np.float32)
    g = check(if_on_shape(rows), {"x": x}, input_shapes={"x": (rows, 3)})
    assert [op.name for op in g.nodes if op.name.startswith("branch/")] == [
        "branch/then_branch/then_Relu" if rows > 2 else "branch/else_branch/else_Neg"]


def test_if_on_a_graph_input_is_refused_unless_bound():
    m = model([helper.make_node("If", ["c"], ["y"], name="branch", then_branch=_branch("then", "Relu"),
                                else_branch=_branch("else", "Neg"))],
              [vi("c", B, []), vi("x", F, [2, 3])], [vi("y", F, [2, 3])])
    with pytest.raises(UnsupportedOperatorError, match=r"node branch \(If\): input 0 \('c'\) must be known.*"
                                                       r"input_values"):
        load_onnx(m)
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    for c in (True, False):
        check(m, {"c": np.array(c), "x": x}, input_values={"c": np.array(c)})


def counting_loop(trips, stop_at=None, opset=17):
    """acc += x * i for i < trips (stopping early once i reaches ``stop_at``), every acc stacked."""
    body_nodes = [helper.make_node("Cast", ["i"], ["fi"], to=F),
                  helper.make_node("Mul", ["x", "fi"], ["xi"]),
                  helper.make_node("Add", ["acc_in", "xi"], ["acc_out"]),
                  helper.make_node("Identity", ["acc_out"], ["scan_out"])]
    if stop_at is None:
        body_nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    else:
        body_nodes.append(helper.make_node("Less", ["i", "stop"], ["cond_out"]))
    body = helper.make_graph(body_nodes, "body", [vi("i", I64, []), vi("cond_in", B, []), vi("acc_in", F, [3])],
                             [vi("cond_out", B, []), vi("acc_out", F, [3]), vi("scan_out", F, [3])])
    inits = [const("trips", np.int64(trips)), const("go", np.array(True)), const("acc0", np.zeros(3, np.float32))]
    if stop_at is not None:
        inits.append(const("stop", np.int64(stop_at)))
    m = model([helper.make_node("Loop", ["trips", "go", "acc0"], ["acc", "all"], name="loop", body=body)],
              [vi("x", F, [3])], [vi("acc", F, [3]), vi("all", F, ["t", 3])], inits, opset=opset)
    return m


@pytest.mark.parametrize("trips,stop_at", [(4, None), (6, 2), (1, None)])
def test_loop_is_unrolled(trips, stop_at):
    x = np.array([1.0, -2.0, 0.5], np.float32)
    g = check(counting_loop(trips, stop_at), {"x": x})
    n = trips if stop_at is None else min(trips, stop_at + 1)
    assert sum("/Add(" in op.name for op in g.nodes) == n
    assert "loop/iter0/" in " ".join(op.name for op in g.nodes)


def test_loop_limits_and_data_dependent_conditions_are_refused(monkeypatch):
    monkeypatch.setattr(handlers_control, "MAX_TRIPS", 5)
    with pytest.raises(UnsupportedOperatorError, match=r"node loop \(Loop\): 6 iterations \(more than 5"):
        load_onnx(counting_loop(6))
    body = helper.make_graph([helper.make_node("ReduceSum", ["acc_in"], ["s"], keepdims=0),
                              helper.make_node("Less", ["s", "ten"], ["cond_out"]),
                              helper.make_node("Add", ["acc_in", "acc_in"], ["acc_out"])], "body",
                             [vi("i", I64, []), vi("cond_in", B, []), vi("acc_in", F, [2])],
                             [vi("cond_out", B, []), vi("acc_out", F, [2])])
    m = model([helper.make_node("Loop", ["", "go", "x"], ["y"], name="while", body=body)],
              [vi("x", F, [2])], [vi("y", F, [2])], [const("go", np.array(True)), const("ten", np.float32(10))])
    with pytest.raises(UnsupportedOperatorError, match=r"node while \(Loop\): a loop condition that depends on "
                                                       r"the data of graph inputs"):
        load_onnx(m)


def test_scan_directions_and_axes():
    """Running sums over axis 1 of x, one input read backwards, outputs stacked on axis 1 and reversed."""
    body = helper.make_graph([helper.make_node("Add", ["s_in", "a"], ["s_out"]),
                              helper.make_node("Mul", ["s_out", "b"], ["y"])], "body",
                             [vi("s_in", F, [2]), vi("a", F, [2]), vi("b", F, [2])],
                             [vi("s_out", F, [2]), vi("y", F, [2])])
    node = helper.make_node("Scan", ["s0", "xa", "xb"], ["s", "ys"], name="scan", body=body, num_scan_inputs=2,
                            scan_input_axes=[1, 0], scan_input_directions=[0, 1], scan_output_axes=[-1],
                            scan_output_directions=[1])
    m = model([node], [vi("s0", F, [2]), vi("xa", F, [2, 5]), vi("xb", F, [5, 2])],
              [vi("s", F, [2]), vi("ys", F, [2, 5])])
    rng = np.random.default_rng(2)
    check(m, {"s0": rng.standard_normal(2).astype(np.float32), "xa": rng.standard_normal((2, 5)).astype(np.float32),
              "xb": rng.standard_normal((5, 2)).astype(np.float32)})


def test_nested_control_flow_reads_every_enclosing_scope_and_shards():
    """A Loop whose body holds an If on the iteration number; the If's branches read the loop's
    state and the outer graph's weight. The unrolled graph is sharded over 2 ranks."""
    then = helper.make_graph([helper.make_node("MatMul", ["h_in", "w"], ["h_then"])], "then", [],
                             [vi("h_then", F, None)])
    other = helper.make_graph([helper.make_node("Tanh", ["h_in"], ["h_else"])], "else", [], [vi("h_else", F, None)])
    body = helper.make_graph([helper.make_node("Mod", ["i", "two"], ["r"]),
                              helper.make_node("Equal", ["r", "zero"], ["even"]),
                              helper.make_node("If", ["even"], ["h_out"], name="pick", then_branch=then,
                                               else_branch=other),
                              helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
                             [vi("i", I64, []), vi("cond_in", B, []), vi("h_in", F, [4, 8])],
                             [vi("cond_out", B, []), vi("h_out", F, [4, 8])])
    rng = np.random.default_rng(3)
    m = model([helper.make_node("Loop", ["trips", "", "x"], ["y"], name="layers", body=body)],
              [vi("x", F, [4, 8])], [vi("y", F, [4, 8])],
              [const("trips", np.int64(4)), const("two", np.int64(2)), const("zero", np.int64(0)),
               const("w", (rng.standard_normal((8, 8)) / 3).astype(np.float32))])
    x = rng.standard_normal((4, 8)).astype(np.float32)
    g = check(m, {"x": x})
    names = [op.name for op in g.nodes]
    assert "layers/iter2/pick/then_branch/MatMul(h_then)" in names
    assert "layers/iter3/pick/else_branch/Tanh(h_else)" in names
    plan = search(g, {"mesh_shape": [2]})
    got = simulate(partition(g, plan), {"x": x})
    np.testing.assert_allclose(got["y"], g.run({"x": x})["y"], rtol=1e-5, atol=1e-6)


def test_model_local_functions_are_inlined():
    """A local function calling another, with an attribute reference, used twice."""
    alpha = helper.make_attribute_ref("alpha", onnx.AttributeProto.FLOAT)
    leaky = helper.make_node("LeakyRelu", ["x"], ["y"])
    leaky.attribute.append(alpha)
    inner = helper.make_function("my", "Act", ["x"], ["y"], [leaky], [helper.make_opsetid("", 17)], ["alpha"])
    outer = helper.make_function("my", "Block", ["x", "w"], ["y"],
                                 [helper.make_node("MatMul", ["x", "w"], ["h"]),
                                  helper.make_node("Act", ["h"], ["y"], domain="my", alpha=0.3)],
                                 [helper.make_opsetid("", 17), helper.make_opsetid("my", 1)])
    rng = np.random.default_rng(4)
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Block", ["x", "w1"], ["h1"], domain="my"),
         helper.make_node("Block", ["h1", "w2"], ["y"], domain="my")], "g",
        [vi("x", F, [2, 4])], [vi("y", F, [2, 4])],
        [const("w1", rng.standard_normal((4, 4)).astype(np.float32)),
         const("w2", rng.standard_normal((4, 4)).astype(np.float32))]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my", 1)], functions=[inner, outer])
    onnx.checker.check_model(m)
    check(m, {"x": rng.standard_normal((2, 4)).astype(np.float32)})


def test_ops_defined_by_onnx_functions_are_expanded():
    """DynamicQuantizeLinear has no handler; its ONNX schema defines it as a function of other
    ops, which is imported instead. The caller's model is left as it was."""
    m = model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zp"], name="dq")],
              [vi("x", F, [3, 5])], [vi("y", TensorProto.UINT8, [3, 5]), vi("scale", F, []),
                                     vi("zp", TensorProto.UINT8, [])], opset=13)
    x = np.random.default_rng(5).standard_normal((3, 5)).astype(np.float32) * 3 + 1
    check(m, {"x": x})
    assert m.graph.node[0].domain == "" and not m.functions
