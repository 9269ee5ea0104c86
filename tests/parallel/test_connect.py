"""connect(): every resharding moves each rank's data to exactly its destination shard, at the
modeled α–β cost.

The executor below applies a Resharding's steps to per-rank numpy shards with the collective
kernels of ``simulate`` (one group at a time); it is independent of the comm ops and of
partition. A second check lowers the same reshardings to comm ops and runs them with simulate.
"""
import itertools
import math

import numpy as np
import pytest

from shardflow.compiler.errors import ConfigError, ShapeError
from shardflow.compiler.ir import FlowGraph, Tensor
from shardflow.compiler.parallel.connect import ReshardingError, connect, lower_resharding, step_graph
from shardflow.compiler.parallel.cost import CostModel
from shardflow.compiler.parallel.mesh import DeviceMesh
from shardflow.compiler.parallel.placement import Partial, Replicate, Shard, TensorShardSpec
from shardflow.compiler.parallel.simulate import all_gather, all_reduce, all_to_all, reduce_scatter, simulate_ranks

REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}


# --------------------------------------------------------------------------- helpers
def make_shards(value: np.ndarray, spec: TensorShardSpec, mesh: DeviceMesh, rng) -> dict[int, np.ndarray]:
    """Each rank's local array under ``spec``; Partial axes hold random values reducing to ``value``."""
    pax = spec.partial_axes
    combos = list(itertools.product(*(range(mesh.shape[a]) for a in pax)))
    m = len(combos)
    op = spec.partial_ops[0] if pax else None
    if op in (None,) or m == 1:
        addends = [value] * m
    elif op == "sum":
        addends = [rng.integers(-9, 10, value.shape).astype(value.dtype) for _ in range(m - 1)]
        addends.append(value - sum(addends))
    elif op == "avg":
        addends = [rng.integers(-9, 10, value.shape).astype(value.dtype) for _ in range(m - 1)]
        addends.append(value * m - sum(addends))
    else:  # max / min: one addend holds the value, the others are below (above) it
        sign = 1 if op == "max" else -1
        winner = rng.integers(0, m, value.shape)
        addends = [np.where(winner == k, value, value - sign * rng.integers(1, 5, value.shape)).astype(value.dtype)
                   for k in range(m)]
    res = {}
    for r in range(mesh.size):
        c = mesh.coord_of(r)
        a = addends[combos.index(tuple(c[x] for x in pax))]
        res[r] = a[tuple(slice(s, e) for s, e in spec.local_bounds(value.shape, mesh, r))]
    return res


def check_shards(value, spec, mesh, shards):
    """Every rank holds its ``spec`` shard (Partial axes: the group's values reduce to it)."""
    pax = spec.partial_axes
    for r in range(mesh.size):
        want = value[tuple(slice(s, e) for s, e in spec.local_bounds(value.shape, mesh, r))]
        group = mesh.group_of(r, pax) if pax else (r,)
        got = np.stack([shards[g] for g in group])
        got = REDUCE[spec.partial_ops[0]](got, axis=0) if pax else got[0]
        assert got.shape == want.shape, (r, spec)
        np.testing.assert_allclose(got, want, err_msg=f"rank {r} under {spec}")


def apply_steps(resharding, shards, mesh):
    """Run the steps on per-rank numpy shards with simulate's collective kernels."""
    shape = resharding.shape
    for st in resharding.steps:
        axis = st.mesh_axis
        out = {}
        for group in mesh.groups(axis):
            arrays = [shards[r] for r in group]
            after = [st.dst.local_bounds(shape, mesh, r) for r in group]
            before = [st.src.local_bounds(shape, mesh, r) for r in group]
            if st.kind == "all_reduce":
                res = all_reduce(arrays, st.reduce_op)
            elif st.kind == "all_gather":
                d = st.tensor_dim
                res = all_gather(arrays, d, after[0][d][1] - after[0][d][0])
            elif st.kind == "reduce_scatter":
                res = reduce_scatter(arrays, st.tensor_dim, st.reduce_op)
            elif st.kind == "all_to_all":
                d = st.tensor_dim
                res = all_to_all(arrays, d, st.dst_dim, after[0][d][1] - after[0][d][0])
            elif st.kind == "local_slice":
                d = st.tensor_dim
                res = [a[(slice(None),) * d + (slice(af[d][0] - bf[d][0], af[d][1] - bf[d][0]),)]
                       for a, af, bf in zip(arrays, after, before)]
            else:
                assert st.kind == "local_partial"
                res = [a if (st.reduce_op != "sum" or j == 0) else np.zeros_like(a) for j, a in enumerate(arrays)]
            out.update(zip(group, res))
        shards = out
        for r in range(mesh.size):  # every intermediate spec is exact too
            assert shards[r].shape == st.dst.local_shape(shape, mesh, r), (str(st), r)
    return shards


def all_specs(ndim_mesh, ndim_tensor, partial_ops=("sum",)):
    choices = [Replicate()] + [Shard(d) for d in range(ndim_tensor)] + [Partial(op) for op in partial_ops]
    specs = [TensorShardSpec(ps) for ps in itertools.product(choices, repeat=ndim_mesh)]
    return [s for s in specs if len(s.partial_ops) <= 1]


def _pairs(mesh_shape, shape, partial_ops=("sum",)):
    specs = all_specs(len(mesh_shape), len(shape), partial_ops)
    return [(s, d) for s in specs for d in specs
            if not any(isinstance(p, Partial) and isinstance(q, Partial) and p != q for p, q in zip(s, d))]


# --------------------------------------------------------------------------- values
CASES = [((4,), (5, 6)), ((2, 2), (5, 6)), ((3,), (7, 2)), ((2, 3), (5, 7))]


@pytest.mark.parametrize("mesh_shape,shape", CASES)
def test_every_pair_of_specs_moves_the_right_data(mesh_shape, shape):
    rng = np.random.default_rng(0)
    mesh = DeviceMesh(mesh_shape, rank_map=list(rng.permutation(math.prod(mesh_shape))))
    cm = CostModel(mesh)
    value = rng.integers(-50, 50, shape).astype(np.float64)
    for src, dst in _pairs(mesh_shape, shape):
        r = connect(src, dst, shape, "float64", mesh, cm)
        assert r.steps[0].src == src if r.steps else src == dst
        assert all(a.dst == b.src for a, b in zip(r.steps, r.steps[1:]))
        assert not r.steps or r.steps[-1].dst == dst
        check_shards(value, dst, mesh, apply_steps(r, make_shards(value, src, mesh, rng), mesh))


@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_other_partial_reductions(op):
    rng = np.random.default_rng(1)
    mesh = DeviceMesh((2, 2))
    cm = CostModel(mesh)
    value = rng.integers(-50, 50, (5, 3)).astype(np.float64)
    for src, dst in _pairs((2, 2), (5, 3), partial_ops=(op,)):
        if not (src.partial_axes or dst.partial_axes):
            continue
        r = connect(src, dst, (5, 3), "float64", mesh, cm)
        check_shards(value, dst, mesh, apply_steps(r, make_shards(value, src, mesh, rng), mesh))


def test_one_partial_reduction_into_another():
    """P(x) -> P(y): reduced with x to R, then made a y-partial locally (one collective)."""
    rng = np.random.default_rng(2)
    mesh = DeviceMesh((2, 2))
    cm = CostModel(mesh)
    value = rng.integers(-50, 50, (5, 3)).astype(np.float64)
    pairs = [(s, d) for s in all_specs(2, 2, ("sum", "avg", "max")) for d in all_specs(2, 2, ("sum", "avg", "max"))
             if s.partial_ops and d.partial_ops and s.partial_ops != d.partial_ops]
    assert len(pairs) > 50
    for src, dst in pairs:
        r = connect(src, dst, (5, 3), "float64", mesh, cm)
        check_shards(value, dst, mesh, apply_steps(r, make_shards(value, src, mesh, rng), mesh))
    r = connect("P(avg)R", "P(sum)R", (5, 3), "float32", mesh, cm)
    assert [(st.kind, st.reduce_op) for st in r.steps] == [("all_reduce", "avg"), ("local_partial", "sum")]


def test_three_axis_mesh_sample():
    rng = np.random.default_rng(2)
    mesh = DeviceMesh((2, 2, 2), rank_map=list(rng.permutation(8)))
    cm = CostModel(mesh, axis_bandwidth_GBps=[400, 100, 25])
    shape = (5, 3, 2)
    value = rng.integers(-50, 50, shape).astype(np.float64)
    pairs = _pairs((2, 2, 2), shape)
    for k in rng.choice(len(pairs), 400, replace=False):
        src, dst = pairs[k]
        r = connect(src, dst, shape, "float64", mesh, cm)
        check_shards(value, dst, mesh, apply_steps(r, make_shards(value, src, mesh, rng), mesh))


@pytest.mark.parametrize("mesh_shape,shape", [((2, 2), (5, 6)), ((4,), (5, 6))])
def test_lowered_ops_under_simulate(mesh_shape, shape):
    """The same reshardings as comm ops in rank graphs, run by simulate (every rank's output)."""
    rng = np.random.default_rng(3)
    mesh = DeviceMesh(mesh_shape, rank_map=list(rng.permutation(math.prod(mesh_shape))))
    cm = CostModel(mesh)
    value = rng.integers(-50, 50, shape).astype(np.float32)
    for src, dst in _pairs(mesh_shape, shape):
        r = connect(src, dst, shape, "float32", mesh, cm)
        shards = make_shards(value, src, mesh, rng)
        graphs, inputs = [], {}
        for rank in range(mesh.size):
            x = Tensor(f"x{rank}", shards[rank].shape, "float32")
            y, ops = lower_resharding(r, x, mesh, rank)
            assert y.shape == dst.local_shape(shape, mesh, rank)
            graphs.append(FlowGraph([x], [y], ops, ["y"]))
            inputs[x.name] = np.ascontiguousarray(shards[rank])
        outs = simulate_ranks(graphs, inputs, mesh)
        check_shards(value, dst, mesh, {rank: o["y"] for rank, o in enumerate(outs)})


# --------------------------------------------------------------------------- choice and order of steps
def kinds(r):
    return [(s.kind, s.mesh_axis) for s in r.steps]


def test_transition_table_on_one_axis():
    mesh = DeviceMesh((4,))
    cm = CostModel(mesh)

    def c(a, b):
        return kinds(connect(a, b, (8, 8), "float32", mesh, cm))
    assert c("S(0)", "R") == [("all_gather", 0)]
    assert c("P(sum)", "R") == [("all_reduce", 0)]
    assert c("P(sum)", "S(1)") == [("reduce_scatter", 0)]
    assert c("R", "S(1)") == [("local_slice", 0)]
    assert c("S(0)", "S(1)") == [("all_to_all", 0)]  # never gather-then-slice
    assert c("R", "P(sum)") == [("local_partial", 0)]
    assert c("S(0)", "P(max)") == [("all_gather", 0), ("local_partial", 0)]
    assert c("S(1)", "S(1)") == []
    assert connect("S(1)", "S(1)", (8, 8), "float32", mesh, cm).cost == 0.0


def test_nested_sharding_unshards_inner_axis_first():
    mesh = DeviceMesh((2, 2))
    cm = CostModel(mesh)
    r = connect("S(0)S(0)", "RS(0)", (8, 4), "float32", mesh, cm)
    assert kinds(r) == [("all_gather", 1), ("all_gather", 0), ("local_slice", 1)]
    r = connect("RR", "S(0)S(0)", (8, 4), "float32", mesh, cm)
    assert kinds(r) == [("local_slice", 0), ("local_slice", 1)]


def test_reduction_before_gather():
    mesh = DeviceMesh((2, 2))
    cm = CostModel(mesh)
    # all-reduce the small shard, then gather: not gather-then-all-reduce the full tensor
    r = connect("P(sum)S(0)", "RR", (64, 64), "float32", mesh, cm)
    assert kinds(r) == [("all_reduce", 0), ("all_gather", 1)]
    assert r.steps[0].bytes == 32 * 64 * 4 and r.steps[1].bytes == 64 * 64 * 4
    r = connect("S(0)P(sum)", "RR", (64, 64), "float32", mesh, cm)
    assert kinds(r) == [("all_reduce", 1), ("all_gather", 0)]
    # scatter the partial sums before moving anything else
    r = connect("P(sum)S(0)", "S(1)S(0)", (64, 64), "float32", mesh, cm)
    assert kinds(r) == [("reduce_scatter", 0)]


# --------------------------------------------------------------------------- costs
def test_costs_against_hand_computed_alpha_beta():
    mesh = DeviceMesh((4,))
    cm = CostModel(mesh)  # defaults: 100 GB/s, 5 us
    bw, a = 100e9, 5e-6
    B = 8 * 6 * 4  # float32 (8, 6)
    r = connect("S(0)", "R", (8, 6), "float32", mesh, cm)
    assert r.steps[0].bytes == B
    assert r.cost == pytest.approx(3 / 4 * B / bw + 3 * a)
    r = connect("P(sum)", "R", (8, 6), "float32", mesh, cm)
    assert r.cost == pytest.approx(2 * 3 / 4 * B / bw + 6 * a)
    r = connect("P(sum)", "S(0)", (8, 6), "float32", mesh, cm)
    assert r.cost == pytest.approx(3 / 4 * B / bw + 3 * a)
    r = connect("S(0)", "S(1)", (8, 8), "float32", mesh, cm)
    assert r.steps[0].bytes == 8 * 8 * 4
    assert r.cost == pytest.approx(3 / 4 * (8 * 8 * 4 / 4) / bw + 3 * a)
    # all-to-all pads the new split dim to 4 equal chunks: 6 -> 8 columns
    r = connect("S(0)", "S(1)", (8, 6), "float32", mesh, cm)
    assert r.steps[0].bytes == 8 * 8 * 4
    assert connect("R", "S(0)", (8, 6), "float32", mesh, cm).cost == 0.0
    # uneven: 5 rows over 4 ranks gather padded chunks of 2 rows
    r = connect("S(0)", "R", (5, 6), "float32", mesh, cm)
    assert r.steps[0].bytes == 4 * 2 * 6 * 4
    assert r.cost == pytest.approx(3 / 4 * (4 * 2 * 6 * 4) / bw + 3 * a)


def test_costs_per_axis_links():
    mesh = DeviceMesh((2, 4), ("dp", "tp"))
    cm = CostModel(mesh, axis_bandwidth_GBps={"dp": 25, "tp": 200}, axis_latency_us=[10, 1])
    shape, isz = (16, 32), 2
    r = connect("P(sum)S(1)", "RR", shape, "float16", mesh, cm)
    # all-reduce over dp (2 ranks) of the (16, 8) shard, then all-gather over tp (4 ranks)
    assert kinds(r) == [("all_reduce", 0), ("all_gather", 1)]
    b0, b1 = 16 * 8 * isz, 16 * 32 * isz
    want = (2 * 1 / 2 * b0 / 25e9 + 2 * 10e-6) + (3 / 4 * b1 / 200e9 + 3 * 1e-6)
    assert r.cost == pytest.approx(want)
    assert [s.cost for s in r.steps] == pytest.approx([2 * 1 / 2 * b0 / 25e9 + 2 * 10e-6,
                                                       3 / 4 * b1 / 200e9 + 3 * 1e-6])


def test_cost_model_formulas():
    mesh = DeviceMesh((2, 4, 1))
    cm = CostModel(mesh, axis_bandwidth_GBps=[50, 200, 10], axis_latency_us=[2, 1, 0])
    B = 1e6
    ar0 = 2 * 1 / 2 * B / 50e9 + 2 * 1 * 2e-6
    ar1 = 2 * 3 / 4 * B / 200e9 + 2 * 3 * 1e-6
    assert cm.all_reduce(B, "x") == pytest.approx(ar0)
    assert cm.all_reduce(B, ("x", "y")) == pytest.approx(ar0 + ar1)
    assert cm.all_reduce(B, 2) == 0.0  # a group of one
    # reduce-scatter over (x, y): x scatters B, then y scatters B / 2; all-gather mirrors it
    rs = (1 / 2 * B / 50e9 + 2e-6) + (3 / 4 * (B / 2) / 200e9 + 3 * 1e-6)
    assert cm.reduce_scatter(B, (0, 1)) == pytest.approx(rs)
    assert cm.all_gather(B, (0, 1)) == pytest.approx(rs)
    assert cm.all_to_all(B, 1) == pytest.approx(3 / 4 * (B / 4) / 200e9 + 3 * 1e-6)
    assert cm.collective("all_gather", B, 1) == cm.all_gather(B, 1)
    assert cm.bandwidth("y") == 200e9 and cm.latency(0) == 2e-6
    # roofline: the larger of compute and memory time
    assert cm.compute_time(989e12, 0) == pytest.approx(1.0)
    assert cm.compute_time(1, 3.35e12) == pytest.approx(1.0)
    d = CostModel(mesh)
    assert d.bandwidth_GBps == (100.0,) * 3 and d.latency_us == (5.0,) * 3
    with pytest.raises(ConfigError, match="positive"):
        CostModel(mesh, axis_bandwidth_GBps=0)
    with pytest.raises(ConfigError, match="list of 3"):
        CostModel(mesh, axis_latency_us=[1, 2])
    with pytest.raises(ConfigError, match="unknown mesh axes"):
        CostModel(mesh, axis_bandwidth_GBps={"tp": 1})


def test_size_one_axis_is_free():
    mesh = DeviceMesh((1, 2))
    cm = CostModel(mesh)
    r = connect("S(0)R", "RR", (4, 4), "float32", mesh, cm)
    assert r.cost == 0.0
    x = Tensor("x", (4, 4), "float32")
    y, ops = lower_resharding(r, x, mesh, 0)
    assert y is x and ops == []


# --------------------------------------------------------------------------- errors and caching
def test_errors():
    mesh = DeviceMesh((2, 2))
    cm = CostModel(mesh)
    with pytest.raises(ReshardingError, match="mixes"):
        connect("P(sum)P(max)", "RR", (4, 4), "float32", mesh, cm)
    with pytest.raises(ShapeError, match="mesh has 2 axes"):
        connect("S(0)", "RR", (4, 4), "float32", mesh, cm)
    with pytest.raises(ShapeError, match="rank 2"):
        connect("S(2)R", "RR", (4, 4), "float32", mesh, cm)
    with pytest.raises(ConfigError, match="cost model"):
        connect("S(0)R", "RR", (4, 4), "float32", DeviceMesh((2, 2), ("a", "b")), cm)
    r = connect("S(0)R", "RR", (4, 4), "float32", mesh, cm)
    with pytest.raises(ShapeError, match="has shape"):
        lower_resharding(r, Tensor("x", (4, 4), "float32"), mesh, 0)


def test_results_are_cached_per_cost_model():
    mesh = DeviceMesh((2, 2))
    cm = CostModel(mesh)
    a = connect("S(0)R", "RS(1)", (4, 4), "float32", mesh, cm)
    assert connect(TensorShardSpec.parse("S(0)R"), TensorShardSpec.parse("RS(1)"), [4, 4], "float32", mesh, cm) is a
    b = connect("S(0)R", "RS(1)", (4, 4), "float32", mesh, CostModel(mesh, axis_bandwidth_GBps=1))
    assert b is not a and b.cost > a.cost
    assert "S(0)R -> RS(1)" in str(a)


@pytest.mark.parametrize("mesh_shape,shape,dtype", [((2, 2), (8, 12, 16), "float32"), ((2, 4), (6, 10), "bfloat16"),
                                                    ((2, 2, 2), (4, 6, 10), "float32")])
def test_connect_takes_the_shortest_path_of_the_step_graph(mesh_shape, shape, dtype):
    """connect's cost of every pair of specs is the shortest path over step_graph (the graph the
    planner's edge flows run on: the ILP is exact only if the two agree), found by Bellman-Ford here."""
    mesh = DeviceMesh(mesh_shape)
    cm = CostModel(mesh, axis_bandwidth_GBps=[100, 25, 400][:len(mesh_shape)])
    nodes, arcs = step_graph(shape, dtype, [[Partial("sum")]] * len(mesh_shape), mesh, cm)
    assert len(nodes) == len(set(nodes)) == (len(shape) + 2) ** len(mesh_shape)  # (R, S(d) each dim, P(sum))
    rng = np.random.default_rng(0)
    for s in rng.choice(len(nodes), 12, replace=False):
        dist = [math.inf] * len(nodes)
        dist[s] = 0.0
        for _ in range(len(nodes)):
            changed = False
            for u, v, c in arcs:
                if dist[u] + c < dist[v] - 1e-18:
                    dist[v], changed = dist[u] + c, True
            if not changed:
                break
        for t in range(len(nodes)):
            got = connect(nodes[s], nodes[t], shape, dtype, mesh, cm).cost
            assert got == pytest.approx(dist[t], rel=1e-9, abs=1e-18)


def test_a_detour_through_another_dim():
    """S(0)P(sum) -> S(1)R on [2, 2]: reduce-scattering axis 1 onto dim 2 first, then moving the splits,
    costs less than reducing the partial sums whole (what a search over each axis' own placements and
    R alone found)."""
    mesh = DeviceMesh((2, 2))
    cm = CostModel(mesh, axis_latency_us=0)
    r = connect("S(0)P(sum)", "S(1)R", (8, 12, 16), "float32", mesh, cm)
    direct = [connect("S(0)P(sum)", "S(0)R", (8, 12, 16), "float32", mesh, cm),
              connect("S(0)R", "S(1)R", (8, 12, 16), "float32", mesh, cm)]
    assert r.cost < sum(x.cost for x in direct) * (1 - 1e-6)
    assert any(st.tensor_dim == 2 or st.dst_dim == 2 for st in r.steps), str(r)
    rng = np.random.default_rng(0)
    value = rng.integers(-50, 50, (8, 12, 16)).astype(np.float64)
    src, dst = TensorShardSpec.parse("S(0)P(sum)"), TensorShardSpec.parse("S(1)R")
    check_shards(value, dst, mesh, apply_steps(r, make_shards(value, src, mesh, rng), mesh))
