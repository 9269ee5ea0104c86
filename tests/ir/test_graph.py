"""FlowGraph: construction, validation, cloning, printing and typed errors of run()."""
import numpy as np
import pytest

from shardflow.compiler import DtypeError, GraphError, ShapeError, ShardflowError
from shardflow.compiler.ir import (FlowGraph, Operator, Task, Tensor, compute, const_tensor, reduce,
                                   topological_sort)
from shardflow.compiler.ops.elementwise import Activation, Binary, CastOp, Identity, Unary


class MatMulByReduce(Operator):
    """A test op with only a compute definition: run() must evaluate it."""

    def compute(self, a, b):
        return compute("c", (a.shape[0], b.shape[1]),
                       lambda i, j: reduce((a.shape[1],), lambda k: a[i, k] * b[k, j]))


class WrongShape(Operator):
    """A buggy op whose numpy() disagrees with its definition."""

    def compute(self, x):
        return compute("y", x.shape, lambda *i: x[i])

    def numpy(self, x):
        return [x.ravel()]


def small_graph():
    """``out = relu(x + y) * c`` with a constant ``c``; returns the graph and its pieces."""
    x = Tensor("x", (2, 3), "float32")
    y = Tensor("y", (3,), "float32")
    c = const_tensor(np.array([1.0, -2.0, 3.0], np.float32), "c")
    add = Binary([x, y], name="add", fn="add")
    relu = Activation([add.outputs[0]], name="relu", kind="relu")
    mul = Binary([relu.outputs[0], c], name="mul", fn="mul")
    g = FlowGraph([x, y], [mul.outputs[0]], output_names=["out"], name="small")
    return g, (x, y, c, add, relu, mul)


def feeds(rng=None):
    rng = rng or np.random.default_rng(0)
    return {"x": rng.standard_normal((2, 3)).astype(np.float32), "y": rng.standard_normal(3).astype(np.float32)}


def expected(f):
    return np.maximum(f["x"] + f["y"], 0) * np.array([1.0, -2.0, 3.0], np.float32)


# tensors and operators ---------------------------------------------------------------------


def test_tensor_properties():
    t = Tensor("t", (2, 3, 4), "float16")
    assert (t.ndim, t.size, t.nbytes) == (3, 24, 48)
    assert not t.is_constant and repr(t) == "%t: float16[2,3,4]"
    c = const_tensor(np.zeros((5,), np.int64), "w")
    assert c.is_constant and c.shape == (5,) and c.dtype == "int64" and repr(c) == "%w: const int64[5]"
    assert const_tensor(np.float32(1)).shape == ()


def test_operator_builds_its_definition_and_output_tensors():
    x = Tensor("x", (2, 3), "float32")
    op = Unary([x], name="neg", fn="neg")
    assert op.op_type == "Unary" and op.name == "neg" and op.attrs == {"fn": "neg"}
    (out,) = op.outputs
    assert out.name == "neg:0" and out.shape == (2, 3) and out.dtype == "float32" and out.producer is op
    assert isinstance(op.task, Task) and op.task.inputs[0].shape == (2, 3)
    assert op.signature() == "%neg:0: float32[2,3] = Unary(%x) {fn='neg'}"
    # unnamed ops get a unique default name
    a, b = Unary([x], fn="neg"), Unary([x], fn="neg")
    assert a.name != b.name and a.name.startswith("Unary_")


def test_operator_without_numpy_runs_its_compute_definition():
    rng = np.random.default_rng(1)
    a = Tensor("a", (4, 5), "float32")
    b = Tensor("b", (5, 2), "float32")
    op = MatMulByReduce([a, b])
    assert op.op_type == "MatMulByReduce"
    assert op.outputs[0].shape == (4, 2) and op.outputs[0].dtype == "float32"  # inferred from the body
    av, bv = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((5, 2)).astype(np.float32)
    (c,) = op.run(av, bv)
    np.testing.assert_allclose(c, av @ bv, rtol=1e-5, atol=1e-6)
    g = FlowGraph([a, b], op.outputs)
    np.testing.assert_allclose(g.run({"a": av, "b": bv})[op.outputs[0].name], av @ bv, rtol=1e-5, atol=1e-6)


def test_operator_whose_numpy_disagrees_with_its_definition_is_reported():
    x = Tensor("x", (2, 3), "float32")
    op = WrongShape([x], name="bad")
    with pytest.raises(ShapeError, match=r"node bad \(WrongShape\) produced shape \(6,\).*says \(2, 3\)"):
        op.run(np.zeros((2, 3), np.float32))


def test_operator_run_coerces_dtype_to_the_declared_one():
    x = Tensor("x", (3,), "float32")
    op = CastOp([x], to="int32")
    (y,) = op.run(np.array([1.7, -2.2, 3.0], np.float32))
    assert y.dtype == np.int32 and y.tolist() == [1, -2, 3]


# validation ---------------------------------------------------------------------------------


def test_valid_graph_passes_validation_and_runs():
    g, _ = small_graph()
    g.validate()
    f = feeds()
    out = g.run(f)
    assert list(out) == ["out"]
    np.testing.assert_allclose(out["out"], expected(f), rtol=1e-6)


def test_nodes_computed_from_outputs_are_topologically_sorted():
    g, (x, y, c, add, relu, mul) = small_graph()
    assert g.nodes == [add, relu, mul]
    assert topological_sort([relu.outputs[0]]) == [add, relu]


def test_validate_rejects_out_of_order_nodes():
    g, (x, y, c, add, relu, mul) = small_graph()
    bad = FlowGraph(g.inputs, g.outputs, [relu, add, mul])
    with pytest.raises(GraphError, match=r"node relu \(Activation\) reads %add:0 before it is produced"):
        bad.validate()


def test_validate_rejects_dangling_tensor():
    x = Tensor("x", (3,), "float32")
    ghost = Tensor("ghost", (3,), "float32")
    op = Binary([x, ghost], name="add", fn="add")
    g = FlowGraph([x], op.outputs, [op])
    with pytest.raises(GraphError, match=r"node add \(Binary\) reads %ghost"):
        g.validate()


def test_validate_rejects_an_input_swapped_for_one_of_another_shape():
    """An op's compute definition is built from its inputs' shapes when the op is made: a pass that
    swaps in an input of another shape (instead of rebuilding the op) leaves a definition (and
    sharding rules) for the old one, which validate names."""
    from shardflow.compiler.ops.transform import Reshape

    x = Tensor("x", (2, 3, 4), "float32")
    flat = Reshape([x], name="flat", shape=(6, 4))
    g = FlowGraph([x], flat.outputs)
    g.validate()
    view = Reshape([x], name="view", shape=(1, 6, 4))
    flat.inputs = [view.outputs[0]]  # (the same elements, another shape)
    with pytest.raises(GraphError, match=r"node flat \(Reshape\) reads \[\(1, 6, 4\)\] but its compute "
                                         r"definition was built for \[\(2, 3, 4\)\]"):
        FlowGraph([x], flat.outputs, [view, flat]).validate()


def test_validate_rejects_duplicate_tensor_names():
    x = Tensor("x", (3,), "float32")
    a = Unary([x], name="same", fn="neg")
    b = Unary([a.outputs[0]], name="same", fn="abs")  # its output is also called "same:0"
    with pytest.raises(GraphError, match="two tensors are named same:0"):
        FlowGraph([x], b.outputs).validate()
    clash = Unary([x], name="n", fn="neg")
    clash.outputs[0].name = "x"  # an op output named like the graph input
    with pytest.raises(GraphError, match="two tensors are named x"):
        FlowGraph([x], clash.outputs).validate()


def test_validate_rejects_other_malformations():
    g, (x, y, c, add, relu, mul) = small_graph()
    with pytest.raises(GraphError, match="node add appears twice"):
        FlowGraph(g.inputs, g.outputs, [add, add, relu, mul]).validate()
    with pytest.raises(GraphError, match="graph output out is not produced by any node"):
        FlowGraph(g.inputs, g.outputs, [add, relu], output_names=["out"]).validate()
    with pytest.raises(GraphError, match=r"duplicate graph output names: \['o', 'o'\]"):
        FlowGraph(g.inputs, [add.outputs[0], mul.outputs[0]], output_names=["o", "o"]).validate()
    with pytest.raises(GraphError, match="graph input c has a producer or a constant value"):
        FlowGraph([x, y, c], g.outputs).validate()
    stolen = Tensor("stolen", (2, 3), "float32", producer=relu)
    add.outputs[0] = stolen
    with pytest.raises(GraphError, match="tensor stolen lists another producer than add"):
        FlowGraph(g.inputs, g.outputs, [add, relu, mul]).validate()


def test_topological_sort_detects_cycles():
    x = Tensor("x", (3,), "float32")
    a = Unary([x], name="a", fn="neg")
    b = Unary([a.outputs[0]], name="b", fn="neg")
    a.inputs = [b.outputs[0]]
    with pytest.raises(GraphError, match="cycle through node"):
        FlowGraph([x], b.outputs)


# queries, cloning, printing -----------------------------------------------------------------


def test_queries():
    g, (x, y, c, add, relu, mul) = small_graph()
    cons = g.consumers()
    assert cons[id(x)] == [add] and cons[id(add.outputs[0])] == [relu] and cons[id(c)] == [mul]
    assert g.constants() == [c]
    assert g.op_types() == {"Binary": 2, "Activation": 1}
    assert g.summary() == "3 nodes, 3 constant elements: Binary×2, Activation×1"


def test_clone_is_independent():
    g, (x, y, c, add, relu, mul) = small_graph()
    text = str(g)
    h = g.clone()
    assert str(h) == text
    old_tensors = {id(t) for op in g.nodes for t in op.inputs + op.outputs} | {id(t) for t in g.inputs}
    new_tensors = {id(t) for op in h.nodes for t in op.inputs + op.outputs} | {id(t) for t in h.inputs}
    assert not ({id(op) for op in h.nodes} & {id(op) for op in g.nodes})
    # constant tensors are new objects sharing the (read-only) arrays
    assert old_tensors & new_tensors == set()
    assert h.constants()[0].value is c.value
    h.validate()
    # rewriting the clone leaves the original alone
    h_relu = h.nodes[1]
    h.replace_uses(h_relu.outputs[0], h.nodes[0].outputs[0])
    h.nodes.remove(h_relu)
    h.inputs[0].name = "renamed"
    h.validate()
    assert str(g) == text and g.nodes == [add, relu, mul] and mul.inputs[0] is relu.outputs[0]
    f = feeds()
    np.testing.assert_allclose(g.run(f)["out"], expected(f), rtol=1e-6)
    no_relu = h.run({"renamed": f["x"], "y": f["y"]})["out"]
    np.testing.assert_allclose(no_relu, (f["x"] + f["y"]) * np.array([1.0, -2.0, 3.0], np.float32), rtol=1e-6)


def test_printing():
    g, _ = small_graph()
    assert str(g).splitlines() == [
        "graph small(%x: float32[2,3], %y: float32[3]) {",
        "  %add:0: float32[2,3] = Binary(%x, %y) {fn='add'}",
        "  %relu:0: float32[2,3] = Activation(%add:0) {kind='relu'}",
        "  %mul:0: float32[2,3] = Binary(%relu:0, %c) {fn='mul'}",
        "  return out=%mul:0",
        "}",
    ]
    assert repr(g.nodes[0]) == "Binary(add)"


def test_long_attributes_are_abbreviated_in_signatures():
    x = Tensor("x", (2,), "float32")
    op = Identity([x], name="id", note="n" * 100, arr=np.zeros((3, 4)))
    sig = op.signature()
    assert "arr=array[3,4]" in sig
    assert "note='" + "n" * 56 + "..." in sig and "n" * 60 not in sig


# run() ----------------------------------------------------------------------------------------


def test_run_returns_outputs_that_are_inputs_or_constants():
    x = Tensor("x", (3,), "float32")
    c = const_tensor(np.arange(3, dtype=np.float32), "c")
    op = Binary([x, c], name="add", fn="add")
    g = FlowGraph([x], [x, c, op.outputs[0]], output_names=["same", "const", "sum"])
    g.validate()
    v = np.array([1, 2, 3], np.float32)
    out = g.run({"x": v})
    assert list(out) == ["same", "const", "sum"]
    np.testing.assert_array_equal(out["same"], v)
    np.testing.assert_array_equal(out["const"], [0, 1, 2])
    np.testing.assert_array_equal(out["sum"], [1, 3, 5])


def test_run_wrong_shape_names_the_input():
    g, _ = small_graph()
    f = feeds()
    f["y"] = np.zeros((4,), np.float32)
    with pytest.raises(ShapeError, match=r"input 'y' has shape \(4,\), the graph expects \(3,\)"):
        g.run(f)


def test_run_wrong_dtype_names_the_input():
    g, _ = small_graph()
    f = feeds()
    f["x"] = f["x"].astype(np.float64)
    with pytest.raises(DtypeError, match=r"input 'x' has dtype float64, the graph expects float32"):
        g.run(f)


def test_run_unknown_and_missing_inputs():
    g, _ = small_graph()
    f = feeds()
    with pytest.raises(ShapeError, match=r"unknown input\(s\) \['z'\]"):
        g.run({**f, "z": f["y"]})
    with pytest.raises(ShapeError, match=r"missing input\(s\) \['y'\]"):
        g.run({"x": f["x"]})
    with pytest.raises(ShapeError, match="takes a dict"):
        g.run([f["x"], f["y"]])


def test_run_errors_are_shardflow_errors():
    assert issubclass(ShapeError, ShardflowError) and issubclass(DtypeError, ShardflowError)
    assert issubclass(GraphError, ShardflowError)
