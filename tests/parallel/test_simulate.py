"""simulate(): lockstep execution of rank graphs with in-memory collectives; the comm ops."""
import numpy as np
import pytest

from shardflow.compiler.errors import GraphError, ShapeError, ShardflowError
from shardflow.compiler.ir import FlowGraph, Tensor, const_tensor, evaluate_task
from shardflow.compiler.ops.elementwise import Binary, Unary
from shardflow.compiler.parallel.comm_ops import (AllGather, AllReduce, AllToAll, LocalPartial, LocalSlice,
                                                  ReduceScatter, is_collective)
from shardflow.compiler.parallel.mesh import DeviceMesh
from shardflow.compiler.parallel.placement import chunk_bounds
from shardflow.compiler.parallel.simulate import (all_gather, all_reduce, all_to_all, reduce_scatter, simulate,
                                                  simulate_ranks)

rng = np.random.default_rng(0)


def chunks(a, n, dim):
    return [np.take(a, range(*chunk_bounds(a.shape[dim], n, j)), axis=dim) for j in range(n)]


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [0, 1, 5, 8])
def test_kernels_uneven(n, size):
    full = rng.standard_normal((size, 3))
    parts = [rng.standard_normal((size, 3)) for _ in range(n)]
    for got in all_reduce(parts, "sum"):
        np.testing.assert_allclose(got, sum(parts))
    for got in all_reduce(parts, "max"):
        np.testing.assert_array_equal(got, np.max(parts, axis=0))
    for got in all_reduce(parts, "avg"):
        np.testing.assert_allclose(got, np.mean(parts, axis=0))
    for got in all_gather(chunks(full, n, 0), 0, size):
        np.testing.assert_array_equal(got, full)
    for got, want in zip(reduce_scatter(parts, 0, "min"), chunks(np.min(parts, axis=0), n, 0)):
        np.testing.assert_array_equal(got, want)
    # all-to-all: dim 1 (size 7) gathered, dim 0 (size `size`) becomes split
    full = rng.standard_normal((size, 7))
    ins = chunks(full, n, 1)
    for j, got in enumerate(all_to_all(ins, 1, 0, 7)):
        np.testing.assert_array_equal(got, chunks(full, n, 0)[j])


def test_kernel_checks_chunk_sizes():
    with pytest.raises(ShapeError, match="chunk 1 of 5 over 2 ranks has 2"):
        all_gather([np.zeros((3, 1)), np.zeros((1, 1))], 0, 5)
    with pytest.raises(ShapeError, match="different shapes"):
        all_reduce([np.zeros(2), np.zeros(3)])


def test_integer_avg_truncates():
    got = all_reduce([np.array([1, -1, 4]), np.array([2, -2, 4])], "avg")[0]
    assert got.dtype == np.int64 and got.tolist() == [1, -1, 4]


# --------------------------------------------------------------------------- comm ops
def test_local_ops_compute_definitions_are_exact():
    x = rng.standard_normal((5, 6)).astype(np.float32)
    for op in [LocalSlice([const_tensor(x)], dim=1, start=2, stop=5), LocalSlice([const_tensor(x)], dim=0, start=4,
                                                                                  stop=4),
               LocalPartial([const_tensor(x)], keep=True), LocalPartial([const_tensor(x)], keep=False)]:
        want = op.run(x)[0]
        got = evaluate_task(op.task, [x])[0]
        assert got.shape == want.shape == op.outputs[0].shape
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(LocalSlice([const_tensor(x)], dim=1, start=2, stop=5).run(x)[0], x[:, 2:5])
    assert not LocalPartial([const_tensor(x)], keep=False).run(x)[0].any()
    with pytest.raises(ShapeError, match="not a range"):
        LocalSlice([const_tensor(x)], dim=1, start=4, stop=7)


def test_collective_shapes_and_refusal_to_run_alone():
    x = Tensor("x", (3, 8), "float32")
    assert AllReduce([x], mesh_axis=0, op="sum", group_size=2).outputs[0].shape == (3, 8)
    assert AllGather([x], mesh_axis=0, dim=0, global_size=5, group_size=2).outputs[0].shape == (5, 8)
    assert ReduceScatter([x], mesh_axis=0, dim=1, op="sum", group_size=3, group_index=2).outputs[0].shape == (3, 2)
    a2a = AllToAll([x], mesh_axis=1, src_dim=0, dst_dim=1, src_size=5, group_size=2, group_index=1)
    assert a2a.outputs[0].shape == (5, 4) and a2a.collective == "all_to_all" and is_collective(a2a)
    assert a2a.task.is_extern and a2a.task.outputs[0].axis_map == (None, None)
    assert not is_collective(LocalSlice([x], dim=0, start=0, stop=1))
    with pytest.raises(ShapeError, match="cannot come from"):
        AllGather([x], mesh_axis=0, dim=0, global_size=4, group_size=2)
    with pytest.raises(ShapeError, match="group_index"):
        ReduceScatter([x], mesh_axis=0, dim=1, op="sum", group_size=2, group_index=2)
    with pytest.raises(ShapeError, match="reduction"):
        AllReduce([x], mesh_axis=0, op="prod", group_size=2)
    op = AllReduce([x], mesh_axis=0, op="sum", group_size=2)
    with pytest.raises(ShardflowError, match="communicator"):
        op.run(np.zeros((3, 8), np.float32))
    g = FlowGraph([x], op.outputs, [op])
    with pytest.raises(ShardflowError, match="simulate"):
        g.run({"x": np.zeros((3, 8), np.float32)})


# --------------------------------------------------------------------------- simulate
def _rank_graph(mesh, rank, shape):
    """Partition-style rank graph: full input, local slice along axis x, exp, a partial product
    along axis y, all-reduce over y, all-gather over x."""
    coord = mesh.coord_of(rank)
    x = Tensor("x", shape, "float32")
    lo, hi = chunk_bounds(shape[0], mesh.shape[0], coord[0])
    s = LocalSlice([x], dim=0, start=lo, stop=hi)
    e = Unary(s.outputs, fn="exp")
    # each rank along y contributes (coord_y + 1) * e; the all-reduce sums them
    m = Binary([e.outputs[0], const_tensor(np.float32(coord[1] + 1))], fn="mul")
    ar = AllReduce(m.outputs, mesh_axis=1, op="sum", group_size=mesh.shape[1])
    ag = AllGather(ar.outputs, mesh_axis=0, dim=0, global_size=shape[0], group_size=mesh.shape[0])
    return FlowGraph([x], ag.outputs, [s, e, m, ar, ag], ["y"])


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (4, 1)])
def test_simulate_matches_the_unsharded_result(mesh_shape):
    mesh = DeviceMesh(mesh_shape, rank_map=list(rng.permutation(int(np.prod(mesh_shape)))))
    shape = (5, 3)
    graphs = [_rank_graph(mesh, r, shape) for r in range(mesh.size)]
    x = rng.standard_normal(shape).astype(np.float32)
    want = np.exp(x) * sum(range(1, mesh_shape[1] + 1))
    np.testing.assert_allclose(simulate(graphs, {"x": x}, mesh)["y"], want, rtol=1e-6)
    for out in simulate_ranks(graphs, {"x": x}, mesh):
        np.testing.assert_allclose(out["y"], want, rtol=1e-6)


def test_all_to_all_and_reduce_scatter_in_graphs():
    mesh = DeviceMesh((3,))
    shape = (7, 4)
    a = rng.standard_normal(shape).astype(np.float32)
    graphs = []
    for r in range(3):
        x = Tensor("a", shape, "float32")
        lo, hi = chunk_bounds(7, 3, r)
        s = LocalSlice([x], dim=0, start=lo, stop=hi)                          # S(0)
        t = AllToAll(s.outputs, mesh_axis=0, src_dim=0, dst_dim=1, src_size=7, group_size=3, group_index=r)  # S(1)
        p = LocalPartial(t.outputs, keep=r == 0)                               # S(1) with zeros off rank 0
        g = AllGather(p.outputs, mesh_axis=0, dim=1, global_size=4, group_size=3)
        rs = ReduceScatter(g.outputs, mesh_axis=0, dim=0, op="sum", group_size=3, group_index=r)
        graphs.append(FlowGraph([x], rs.outputs, [s, t, p, g, rs], ["out"]))
    outs = simulate_ranks(graphs, {"a": a}, mesh)
    # after the all-gather every rank holds rank 0's columns [0, 2) and zeros elsewhere... summed 3 times
    keep = np.zeros_like(a)
    keep[:, 0:2] = a[:, 0:2]
    for r, out in enumerate(outs):
        lo, hi = chunk_bounds(7, 3, r)
        np.testing.assert_allclose(out["out"], 3 * keep[lo:hi])
    # every rank's values by tensor name: its input, its slice, what each collective gave it
    values: list = []
    simulate_ranks(graphs, {"a": a}, mesh, values=values)
    assert len(values) == 3
    for r, (g, vals) in enumerate(zip(graphs, values)):
        lo, hi = chunk_bounds(7, 3, r)
        assert set(vals) == {"a"} | {t.name for op in g.nodes for t in op.outputs}
        np.testing.assert_array_equal(vals[g.nodes[0].outputs[0].name], a[lo:hi])
        np.testing.assert_allclose(vals[g.nodes[3].outputs[0].name], keep)  # (the all-gather's)
        np.testing.assert_allclose(vals[g.outputs[0].name], outs[r]["out"])


def test_per_rank_input_names_and_missing_inputs():
    mesh = DeviceMesh((2,))
    graphs = []
    for r in range(2):
        x = Tensor(f"x{r}", (2,), "float32")
        op = AllReduce([x], mesh_axis=0, op="max", group_size=2)
        graphs.append(FlowGraph([x], op.outputs, [op], ["m"]))
    got = simulate(graphs, {"x0": np.array([1, 5], np.float32), "x1": np.array([3, 2], np.float32)}, mesh)
    assert got["m"].tolist() == [3, 5]
    with pytest.raises(ShapeError, match="rank 1: missing input 'x1'"):
        simulate(graphs, {"x0": np.zeros(2, np.float32)}, mesh)


def _graph_with(ops_for_rank, mesh):
    graphs = []
    for r in range(mesh.size):
        x = Tensor("x", (4,), "float32")
        y = x
        nodes = []
        for make in ops_for_rank(r):
            op = make(y)
            nodes.append(op)
            y = op.outputs[0]
        graphs.append(FlowGraph([x], [y], nodes, ["y"]))
    return graphs


def test_mismatched_collectives_raise_instead_of_hanging():
    mesh = DeviceMesh((2, 2))
    x = {"x": np.zeros(4, np.float32)}

    def ar(axis):
        return lambda t: AllReduce([t], mesh_axis=axis, op="sum", group_size=2)

    graphs = _graph_with(lambda r: [ar(0)] if r != 3 else [ar(1)], mesh)
    with pytest.raises(GraphError, match="collective #0 differs between ranks.*rank 3"):
        simulate(graphs, x, mesh)
    graphs = _graph_with(lambda r: [ar(0), ar(1)] if r != 2 else [ar(0)], mesh)
    with pytest.raises(GraphError, match=r"collective #1: rank\(s\) \[2\] finished"):
        simulate(graphs, x, mesh)
    graphs = _graph_with(lambda r: [lambda t: AllReduce([t], mesh_axis=0, op="sum", group_size=4)], mesh)
    with pytest.raises(GraphError, match="group_size is 4"):
        simulate(graphs, x, mesh)
    graphs = _graph_with(lambda r: [lambda t: ReduceScatter([t], mesh_axis=0, dim=0, op="sum", group_size=2,
                                                            group_index=0)], mesh)
    with pytest.raises(GraphError, match="group_index 0, but it is member 1"):
        simulate(graphs, x, mesh)
    with pytest.raises(GraphError, match="3 rank graphs"):
        simulate(graphs[:3], x, mesh)


def test_collective_over_two_mesh_axes():
    """A group spanning axes (y, x): members ordered row-major over (y, x), as DeviceMesh.groups."""
    mesh = DeviceMesh((2, 2), rank_map=[2, 0, 3, 1])
    a = rng.standard_normal((7, 2)).astype(np.float32)
    graphs = []
    for r in range(4):
        j = mesh.group_index(r, (1, 0))
        x = Tensor("a", a.shape, "float32")
        lo, hi = chunk_bounds(7, 4, j)
        s = LocalSlice([x], dim=0, start=lo, stop=hi)
        g = AllGather(s.outputs, mesh_axis=(1, 0), dim=0, global_size=7, group_size=4)
        graphs.append(FlowGraph([x], g.outputs, [s, g], ["y"]))
    for out in simulate_ranks(graphs, {"a": a}, mesh):
        np.testing.assert_array_equal(out["y"], a)
    # the same slices gathered in (x, y) order are a different permutation of the rows
    for gr in graphs:
        gr.nodes[1].attrs["mesh_axis"] = (0, 1)
    assert not np.array_equal(simulate(graphs, {"a": a}, mesh)["y"], a)


@pytest.mark.parametrize("mesh_shape", [[1], [2]])
def test_scalar_constants_stay_scalars_on_every_rank(mesh_shape):
    """A 0-d constant read by an op on a 0-d value (min(reduce_min(x), 0), as in
    DynamicQuantizeLinear): its shard is 0-d too (it used to become shape (1,))."""
    from shardflow.compiler.ops.reduce import Reduce
    from shardflow.compiler.parallel import partition, search

    x = Tensor("x", (2, 3), "float32")
    red = Reduce([x], kind="min", axes=(0, 1), keepdims=False)
    low = Binary([red.outputs[0], const_tensor(np.float32(0))], fn="min")
    graph = FlowGraph([x], low.outputs, [red, low], ["y"])
    xv = rng.standard_normal((2, 3)).astype(np.float32) + 3
    got = simulate(partition(graph, search(graph, {"mesh_shape": mesh_shape})), {"x": xv})
    assert got["y"].shape == () and got["y"] == 0
