"""Placements, shard specs and torch.chunk-style uneven shards."""
import itertools
import pickle

import numpy as np
import pytest

from shardflow.compiler.errors import ConfigError, ShapeError
from shardflow.compiler.parallel.mesh import DeviceMesh
from shardflow.compiler.parallel.placement import (Partial, Replicate, Shard, TensorShardSpec, chunk_bounds,
                                                   padded_chunk)


def torch_chunk(a: np.ndarray, n: int) -> list[np.ndarray]:
    """``torch.chunk(a, n)`` reimplemented: chunks of ceil(len/n); fewer chunks when they run out."""
    c = -(-len(a) // n)
    return [a[i:i + c] for i in range(0, len(a), c)] if c else []


@pytest.mark.parametrize("size", range(0, 13))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_chunk_bounds_follow_torch_chunk(size, n):
    a = np.arange(size)
    want = torch_chunk(a, n)
    got = [a[slice(*chunk_bounds(size, n, i))] for i in range(n)]
    # the first chunks are torch's; the remaining ranks hold empty chunks
    assert [g.tolist() for g in got[:len(want)]] == [w.tolist() for w in want]
    assert all(g.size == 0 for g in got[len(want):])
    assert np.concatenate(got).tolist() == a.tolist()
    assert padded_chunk(size, n) == max(g.size for g in got)


def test_chunk_bounds_are_not_array_split():
    # 5 over 4: torch.chunk gives 2, 2, 1, 0 (array_split would give 2, 1, 1, 1)
    assert [chunk_bounds(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert padded_chunk(5, 4) == 2
    with pytest.raises(ValueError):
        chunk_bounds(5, 4, 4)


def test_chunk_bounds_match_real_torch():
    torch = pytest.importorskip("torch")
    for size, n in itertools.product(range(0, 10), range(1, 6)):
        t = torch.arange(size)
        want = [c.tolist() for c in torch.chunk(t, n)] if size else []
        got = [list(range(*chunk_bounds(size, n, i))) for i in range(n)]
        assert [g for g in got if g] == [w for w in want if w]


def test_placement_values_and_order():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1) and Partial() == Partial("sum")
    assert Replicate() != Partial() and len({Shard(1), Shard(1), Replicate(), Replicate()}) == 2
    assert sorted([Partial("max"), Shard(1), Replicate(), Partial(), Shard(0)]) == \
        [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("max")]
    assert Shard(np.int64(2)).dim == 2 and type(Shard(np.int64(2)).dim) is int
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Partial("max").is_partial("max") and not Partial("max").is_partial("sum")
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # frozen
    with pytest.raises(ConfigError, match="non-negative"):
        Shard(-1)
    with pytest.raises(ConfigError, match="one of"):
        Partial("prod")


@pytest.mark.parametrize("text,placements", [
    ("S(0)R", (Shard(0), Replicate())),
    ("RS(1)", (Replicate(), Shard(1))),
    ("P(sum)R", (Partial("sum"), Replicate())),
    ("RR", (Replicate(), Replicate())),
    ("S(0)S(0)P(max)", (Shard(0), Shard(0), Partial("max"))),
    ("S(12)", (Shard(12),)),
])
def test_str_and_parse(text, placements):
    spec = TensorShardSpec(placements)
    assert str(spec) == text
    assert TensorShardSpec.parse(text) == spec
    assert repr(spec) == f"TensorShardSpec({text!r})"


def test_parse_variants_and_errors():
    assert TensorShardSpec.parse(" S( 0 ) P R") == TensorShardSpec((Shard(0), Partial("sum"), Replicate()))
    for bad in ["", "X", "S(a)R", "S(0", "P(prod)", "RR)"]:
        with pytest.raises(ConfigError):
            TensorShardSpec.parse(bad)


def test_spec_is_hashable_and_ordered():
    a, b = TensorShardSpec.parse("S(0)R"), TensorShardSpec.parse("S(0)R")
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert TensorShardSpec([Shard(0)]) == TensorShardSpec((Shard(0),))  # lists become tuples
    assert pickle.loads(pickle.dumps(a)) == a and hash(pickle.loads(pickle.dumps(a))) == hash(a)
    specs = [TensorShardSpec.parse(t) for t in ["P(sum)R", "S(0)R", "RR", "RS(1)"]]
    assert [str(s) for s in sorted(specs)] == ["RR", "RS(1)", "S(0)R", "P(sum)R"]
    with pytest.raises(ConfigError):
        TensorShardSpec(("R",))


def test_queries():
    spec = TensorShardSpec.parse("S(1)P(sum)S(1)S(0)")
    assert spec.dim_axes(3) == ((3,), (0, 2), ())
    assert spec.partial_axes == (1,) and spec.partial_ops == ("sum",)
    assert spec.sharded_dims == (0, 1)
    assert not spec.is_replicated and TensorShardSpec.parse("RRR").is_replicated
    assert spec.shard_axes(1) == (0, 2)
    assert spec.num_shards((2, 3, 4, 5)) == 2 * 4 * 5
    assert spec.with_placement(1, Replicate()) == TensorShardSpec.parse("S(1)RS(1)S(0)")
    with pytest.raises(ShapeError, match="rank 1"):
        spec.dim_axes(1)


def test_from_dim_axes_round_trip():
    for text in ["S(1)P(sum)S(1)S(0)", "RRR", "S(0)S(0)S(0)", "P(max)S(2)R"]:
        spec = TensorShardSpec.parse(text)
        partial = {a: spec[a].op for a in spec.partial_axes}
        assert TensorShardSpec.from_dim_axes(spec.dim_axes(3), len(spec), partial) == spec
    assert TensorShardSpec.from_dim_axes(((), (0,)), 2, partial=[1]) == TensorShardSpec.parse("S(1)P(sum)")
    with pytest.raises(ConfigError, match="increasing order"):
        TensorShardSpec.from_dim_axes(((1, 0),), 2)
    with pytest.raises(ConfigError, match="used twice"):
        TensorShardSpec.from_dim_axes(((0,), (0,)), 2)
    with pytest.raises(ConfigError, match="out of range"):
        TensorShardSpec.from_dim_axes(((2,),), 2)


def test_local_shape_with_two_axes_on_one_dim():
    mesh = DeviceMesh((2, 2))
    spec = TensorShardSpec.parse("S(0)S(0)")
    # 5 rows: axis 0 splits into [0,3) and [3,5); axis 1 splits each piece
    assert [spec.local_bounds((5, 6), mesh, r)[0] for r in range(4)] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert [spec.local_shape((5, 6), mesh, r) for r in range(4)] == [(2, 6), (1, 6), (1, 6), (1, 6)]
    assert spec.padded_local_shape((5, 6), mesh) == (2, 6)
    # the rank map decides which rank holds which piece
    pm = DeviceMesh((2, 2), rank_map=[3, 1, 0, 2])
    assert spec.local_bounds((5, 6), pm, 3)[0] == (0, 2)  # rank 3 sits at coordinate (0, 0)
    assert spec.local_bounds((5, 6), pm, 2)[0] == (4, 5)
    with pytest.raises(ShapeError, match="mesh has 2 axes"):
        TensorShardSpec.parse("S(0)").local_shape((5, 6), mesh, 0)


@pytest.mark.parametrize("mesh_shape,shape", [((4,), (5, 6)), ((2, 2), (5, 6)), ((2, 3), (7, 2)),
                                              ((2, 2, 2), (5, 3, 2))])
def test_shards_tile_the_tensor(mesh_shape, shape):
    """For every spec without Partial, the replicas of each shard agree and the shards tile the tensor."""
    mesh = DeviceMesh(mesh_shape, rank_map=list(np.random.default_rng(1).permutation(int(np.prod(mesh_shape)))))
    choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
    for ps in itertools.product(choices, repeat=mesh.ndim):
        spec = TensorShardSpec(ps)
        count = np.zeros(shape, dtype=int)
        pieces = {}
        for r in range(mesh.size):
            b = spec.local_bounds(shape, mesh, r)
            assert tuple(e - s for s, e in b) == spec.local_shape(shape, mesh, r)
            assert all(e - s <= p for (s, e), p in zip(b, spec.padded_local_shape(shape, mesh)))
            sharded_coord = tuple(c for c, p in zip(mesh.coord_of(r), ps) if isinstance(p, Shard))
            pieces.setdefault(sharded_coord, b)
            assert pieces[sharded_coord] == b  # ranks differing only on replicated axes hold the same shard
        for b in pieces.values():
            count[tuple(slice(s, e) for s, e in b)] += 1
        assert (count == 1).all(), spec
