"""DeviceMesh: coordinates, groups, derived meshes, serialization and validation."""
import copy
import itertools
import json
import pickle

import numpy as np
import pytest

from shardflow.compiler.errors import ConfigError
from shardflow.compiler.parallel.mesh import DeviceMesh

PERM8 = [5, 2, 7, 0, 3, 6, 1, 4]


def test_default_mesh_is_row_major():
    m = DeviceMesh((2, 4))
    assert m.size == 8 and m.ndim == 2 and m.axis_names == ("x", "y")
    assert m.strides == (4, 1)
    assert m.tensor().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.coord_of(6) == (1, 2)
    assert m.rank_of((1, 2)) == 6
    assert DeviceMesh(3).shape == (3,)
    assert DeviceMesh((2, 2, 2)).axis_names == ("x", "y", "z")
    assert DeviceMesh((1,) * 5).axis_names == ("d0", "d1", "d2", "d3", "d4")


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 2), (2, 2, 2)])
def test_coordinate_round_trip_with_permuted_rank_map(shape):
    m = DeviceMesh(shape, rank_map=PERM8)
    t = m.tensor()
    assert t.shape == shape
    # the rank map lists the ranks of the row-major positions
    assert t.ravel().tolist() == PERM8
    seen = set()
    for coord in itertools.product(*(range(d) for d in shape)):
        r = m.rank_of(coord)
        assert r == t[coord]
        assert m.coord_of(r) == coord
        seen.add(r)
    assert seen == set(range(8))


def test_custom_strides_column_major():
    m = DeviceMesh((2, 4), strides=(1, 2))
    # position = c0 + 2 * c1: column-major
    assert m.tensor().tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for r in range(8):
        assert m.rank_of(m.coord_of(r)) == r
    assert m == DeviceMesh((2, 4), rank_map=[0, 2, 4, 6, 1, 3, 5, 7])


def test_groups_along_each_axis():
    m = DeviceMesh((2, 4), ("dp", "tp"))
    assert m.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert m.groups(1) == m.groups(-1) == m.groups("tp")
    assert m.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert m.group_of(6, "dp") == (2, 6)
    assert m.group_of(6, "tp") == (4, 5, 6, 7)
    assert m.group_index(6, "tp") == 2 and m.group_index(6, "dp") == 1
    # several axes: one group per remaining coordinate, row-major over the given axes
    m3 = DeviceMesh((2, 2, 2))
    assert m3.groups(("x", "z")) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert m3.groups(("z", "x")) == [(0, 4, 1, 5), (2, 6, 3, 7)]
    assert m3.group_of(7, ("x", "z")) == (2, 3, 6, 7)
    assert m3.group_index(7, ("z", "x")) == 3


def test_groups_partition_the_mesh_with_a_rank_map():
    m = DeviceMesh((2, 2, 2), rank_map=PERM8)
    for axis in range(3):
        groups = m.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))
        for g in groups:
            coords = [m.coord_of(r) for r in g]
            # members differ only along `axis`, in coordinate order
            assert [c[axis] for c in coords] == [0, 1]
            assert len({c[:axis] + c[axis + 1:] for c in coords}) == 1
            for r in g:
                assert m.group_of(r, axis) == g


def test_submesh():
    m = DeviceMesh((2, 4), ("dp", "tp"), rank_map=PERM8)
    t = m.tensor()
    sub = m.submesh("tp", rank=t[1, 2])
    assert sub.shape == (4,) and sub.axis_names == ("tp",)
    assert sub.tensor().tolist() == t[1].tolist()
    assert sub.world_size == 8
    assert sub.coord_of(int(t[1, 3])) == (3,)
    sub = m.submesh("dp", rank=t[0, 3])
    assert sub.tensor().tolist() == t[:, 3].tolist()
    assert m.submesh("dp").tensor().tolist() == t[:, 0].tolist()
    # reordering the axes transposes
    assert m.submesh(("tp", "dp"), rank=0).tensor().tolist() == t.T.tolist()
    with pytest.raises(ConfigError, match="not in the mesh"):
        sub.coord_of(int(t[1, 0]))


def test_flatten_and_unflatten():
    m = DeviceMesh((2, 3, 4), ("a", "b", "c"), rank_map=list(np.random.default_rng(0).permutation(24)))
    t = m.tensor()
    f = m.flatten(("b", "c"))
    assert f.shape == (2, 12) and f.axis_names == ("a", "b_c")
    assert f.tensor().tolist() == t.reshape(2, 12).tolist()
    assert f.rank_map == m.rank_map  # consecutive axes: only the layout changes
    assert m.flatten().tensor().ravel().tolist() == t.ravel().tolist()
    # non-consecutive / reordered axes re-lay the ranks out
    f = m.flatten(("c", "a"), name="ca")
    assert f.shape == (8, 3) and f.axis_names == ("ca", "b")
    assert f.tensor().tolist() == np.transpose(t, (2, 0, 1)).reshape(8, 3).tolist()
    u = m.unflatten("c", (2, 2))
    assert u.shape == (2, 3, 2, 2) and u.axis_names == ("a", "b", "c_0", "c_1")
    assert u.tensor().tolist() == t.reshape(2, 3, 2, 2).tolist()
    assert u.rank_map == m.rank_map
    assert u.flatten(("c_0", "c_1"), name="c") == m
    # groups agree with the array view
    assert u.groups("c_0") == [tuple(r) for r in np.moveaxis(t.reshape(2, 3, 2, 2), 2, -1).reshape(-1, 2).tolist()]
    with pytest.raises(ConfigError, match="multiplying to 4"):
        m.unflatten("c", (3, 2))


def test_serialization_and_equality():
    m = DeviceMesh((2, 4), ("dp", "tp"), rank_map=PERM8)
    d = json.loads(json.dumps(m.to_dict()))
    assert DeviceMesh.from_dict(d) == m
    assert hash(DeviceMesh.from_dict(d)) == hash(m)
    assert DeviceMesh.from_dict({"shape": [2, 4]}) == DeviceMesh((2, 4))
    assert m != DeviceMesh((2, 4), ("dp", "tp"))
    assert m != DeviceMesh((2, 4), rank_map=PERM8)  # names differ
    assert DeviceMesh((2, 4), strides=(1, 2)).to_dict()["strides"] == [1, 2]
    sub = m.submesh("tp", rank=0)
    assert DeviceMesh.from_dict(sub.to_dict()) == sub
    assert pickle.loads(pickle.dumps(m)) == m and copy.deepcopy(sub) == sub
    assert repr(DeviceMesh((2, 2), ("dp", "tp"))) == "DeviceMesh(dp=2, tp=2; ranks=[[0, 1], [2, 3]])"
    with pytest.raises(ConfigError, match="unknown key"):
        DeviceMesh.from_dict({"shape": [2], "ranks": [0, 1]})


@pytest.mark.parametrize("kwargs,match", [
    (dict(shape=(2, 0)), "positive ints"),
    (dict(shape=()), "positive ints"),
    (dict(shape=(2, 2), rank_map=[0, 1, 2]), "holds 4 ranks"),
    (dict(shape=(2, 2), rank_map=[0, 1, 1, 3]), "permutation of 0..3"),
    (dict(shape=(2, 2), rank_map=[1, 2, 3, 4]), "permutation of 0..3"),
    (dict(shape=(2, 2), axis_names=("x",)), "give 2 names"),
    (dict(shape=(2, 2), axis_names=("x", "x")), "distinct"),
    (dict(shape=(2, 2), axis_names=("x", "")), "non-empty"),
    (dict(shape=(2, 2), axis_names="xy"), "list of 2 strings"),
    (dict(shape=(2, 4), strides=(2, 1)), "one-to-one"),
    (dict(shape=(2, 2), world_size=3, rank_map=[0, 1, 2, 5]), "≥ the mesh size 4"),
    (dict(shape=(2, 2), world_size=8, rank_map=[0, 1, 2, 9]), "distinct ranks in 0..7"),
    (dict(shape=(2, 2), world_size=8), "explicit rank_map"),
])
def test_validation_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DeviceMesh(**kwargs)


def test_bad_axis_and_coordinate_references():
    m = DeviceMesh((2, 2), ("dp", "tp"))
    with pytest.raises(ConfigError, match="no axis named 'pp'"):
        m.groups("pp")
    with pytest.raises(ConfigError, match="out of range"):
        m.groups(2)
    with pytest.raises(ConfigError, match="outside the mesh"):
        m.rank_of((2, 0))
    with pytest.raises(ConfigError, match="not in the mesh"):
        m.coord_of(4)
    with pytest.raises(ConfigError, match="repeat"):
        m.groups(("dp", 0))
