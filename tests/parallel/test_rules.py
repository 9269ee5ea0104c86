"""Every generated sharding rule of every op, checked numerically.

For each op example (the ``examples(rng)`` of every ops module) and every strategy the rules
generate on a mesh, the op alone is planned with that strategy, partitioned into rank graphs
(with the collectives that resolve Partial outputs and reshard inputs) and simulated; the result
must equal the op's unsharded result.
"""
import numpy as np
import pytest
from op_examples import op_examples

from shardflow.compiler.ir import FlowGraph, Tensor
from shardflow.compiler.parallel import partition, simulate
from shardflow.compiler.parallel.config import DistributedConfig
from shardflow.compiler.parallel.plan import ShardingPlan
from shardflow.compiler.parallel.rules import op_strategies
from shardflow.compiler.parallel.search import Problem

MESHES = [(2,), (3,), (2, 2)]


def _examples():
    return [pytest.param(cls, arrays, attrs, id=f"{mod}-{cls.op_type}-{k}") for mod, k, cls, arrays, attrs in op_examples()]


def _single_op_graph(cls, arrays, attrs):
    ins = [Tensor(f"in{k}", a.shape, str(a.dtype)) for k, a in enumerate(arrays)]
    op = cls(ins, name="op", **attrs)
    return FlowGraph(ins, list(op.outputs), [op]), op


def check_strategies(graph, op, feeds, mesh_shape):
    """Run every strategy of ``op`` through partition + simulate; return how many were checked."""
    want = op.run(*[feeds[t.name] for t in op.inputs])
    problem = Problem(graph, DistributedConfig.from_dict({"mesh_shape": list(mesh_shape)}))
    strategies = problem.strategies[id(op)]
    for s in strategies:
        plan = ShardingPlan.from_assignment(problem, {id(op): s}, algo="test")
        got = simulate(partition(graph, plan), feeds, plan.mesh)
        for name, w in zip(graph.output_names, want):
            g = got[name]
            assert g.shape == w.shape and g.dtype == w.dtype, f"{s}: {g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"
            if w.dtype.kind == "f":
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=str(s))
            else:
                np.testing.assert_array_equal(g, w, err_msg=str(s))
    return len(strategies)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("cls,arrays,attrs", _examples())
def test_every_rule_is_numerically_right(cls, arrays, attrs, mesh_shape):
    graph, op = _single_op_graph(cls, arrays, attrs)
    if any(getattr(o, "collective", None) for o in graph.nodes):
        pytest.skip("collectives are checked in test_connect/test_simulate")
    feeds = {f"in{k}": a for k, a in enumerate(arrays)}
    check_strategies(graph, op, feeds, mesh_shape)


def test_matmul_rules_match_the_analytic_set():
    from shardflow.compiler.ops.linalg import MatMul

    a, w = Tensor("a", (4, 6), "float32"), Tensor("w", (6, 8), "float32")
    got = {str(s) for s in op_strategies(MatMul([a, w]), (2,))}
    assert got == {"(R, R) -> (R)", "(S(0), R) -> (S(0))", "(R, S(1)) -> (S(1))", "(S(1), S(0)) -> (P(sum))"}


def test_a_dim_viewed_as_several_splits_by_its_outer_one():
    """A dim viewed as several (``[.., 48]`` as ``[.., 4, 3, 4]``: BLOOM's head-major QKV, each
    head's Q, K and V inside it) splits by the outer one, each block of it reading its block of the
    dim, as a view as two did; a read of part of each block (the first 8 of each 12) too. Every
    strategy is checked numerically; an inner dim still does not split."""
    from shardflow.compiler.ops.transform import AffineGather, Reshape

    rng = np.random.default_rng(0)
    x = Tensor("in0", (2, 48), "float32")
    view = Reshape([x], name="op", shape=(2, 4, 3, 4))
    assert "(S(1)) -> (S(1))" in {str(s) for s in op_strategies(view, (4,))}
    assert "(S(1)) -> (S(2))" not in {str(s) for s in op_strategies(view, (3,))}
    feeds = {"in0": rng.standard_normal((2, 48)).astype(np.float32)}
    assert check_strategies(FlowGraph([x], list(view.outputs), [view]), view, feeds, (4,)) >= 3
    pick = AffineGather([x], name="op", shape=(2, 4, 2, 4), coefs=((1, 0, 0, 0), (0, 12, 4, 1)), offsets=(0, 0))
    assert "(S(1)) -> (S(1))" in {str(s) for s in op_strategies(pick, (4,))}
    assert check_strategies(FlowGraph([x], list(pick.outputs), [pick]), pick, feeds, (2,)) >= 2


@pytest.mark.parametrize("ranks", [2, 4])
def test_several_dims_merged_into_one_split_by_the_outer(ranks):
    """Several dims merged into one (``[.., 4, 2, 4]`` viewed as ``[.., 32]``: the grouped-query
    attention's output ``[.., Hkv, G, d]`` merged back, whose middle dim is read at ``(o // 4) % 2``)
    split by the outer one: each block of the output reads its block of it and the whole of the
    others (before: no split of the merged dim at all). Every strategy is checked numerically; a
    split whose blocks cut the middle dim is not offered."""
    from shardflow.compiler.ops.transform import Reshape

    rng = np.random.default_rng(0)
    x = Tensor("in0", (3, 4, 2, 4), "float32")
    merge = Reshape([x], name="op", shape=(3, 32))
    assert "(S(1)) -> (S(1))" in {str(s) for s in op_strategies(merge, (ranks,))}
    feeds = {"in0": rng.standard_normal((3, 4, 2, 4)).astype(np.float32)}
    assert check_strategies(FlowGraph([x], list(merge.outputs), [merge]), merge, feeds, (ranks,)) >= 3
    assert "(S(1)) -> (S(1))" not in {str(s) for s in op_strategies(merge, (8,))}


def test_softmax_axis_is_never_split():
    from shardflow.compiler.ops.reduce import Softmax

    x = Tensor("x", (4, 6), "float32")
    op = Softmax([x], axes=(1,), log=False)
    specs = {str(s) for s in op_strategies(op, (2,))}
    assert specs == {"(R) -> (R)", "(S(0)) -> (S(0))"}


def test_partial_sums_go_through_linear_ops_only():
    """An op takes partial sums (and gives one) exactly where its output is a homogeneous linear
    function of those inputs: a + b, a * w, transposes, zero and edge padding do; a + w (w whole),
    a * b, activations, padding with a nonzero fill, casts to integers and products do not."""
    from shardflow.compiler.ops.elementwise import Activation, Binary, CastOp, Where
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.ops.transform import Pad, Transpose

    a, b = Tensor("a", (4, 6), "float32"), Tensor("b", (4, 6), "float32")
    cond = Tensor("c", (4, 6), "bool")

    def partial(op):
        return {str(s) for s in op_strategies(op, (2,)) if "partial sums" in s.assignment}
    assert partial(Binary([a, b], fn="add")) == {"(P(sum), P(sum)) -> (P(sum))"}
    assert partial(Binary([a, b], fn="sub")) == {"(P(sum), P(sum)) -> (P(sum))"}
    assert partial(Binary([a, b], fn="mul")) == {"(P(sum), R) -> (P(sum))", "(R, P(sum)) -> (P(sum))"}
    assert partial(Binary([a, b], fn="div")) == {"(P(sum), R) -> (P(sum))"}
    assert partial(Transpose([a], perm=[1, 0])) == {"(P(sum)) -> (P(sum))"}
    assert partial(Pad([a], begin=[1, 0], end=[0, 2], mode="constant", value=0.0)) == {"(P(sum)) -> (P(sum))"}
    assert partial(Pad([a], begin=[1, 0], end=[0, 0], mode="edge")) == {"(P(sum)) -> (P(sum))"}  # copies: linear
    assert partial(Where([cond, a, b])) == {"(R, P(sum), P(sum)) -> (P(sum))"}
    assert partial(CastOp([a], to="float64")) == {"(P(sum)) -> (P(sum))"}
    for op in (Binary([a, b], fn="max"), Activation([a], kind="relu"), CastOp([a], to="int32"),
               Pad([a], begin=[1, 0], end=[0, 0], mode="constant", value=1.0),
               MatMul([a, Tensor("w", (6, 8), "float32")])):
        assert partial(op) == set(), op
