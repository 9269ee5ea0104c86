"""The device mesh: an N-D grid of ranks.

A :class:`DeviceMesh` is stored the way PyTorch stores its ``_MeshLayout`` and ``_rank_map``:

* a **layout** — ``shape`` and ``strides`` — mapping a mesh coordinate ``c`` to a position
  ``sum(c[a] * strides[a])`` in ``[0, size)`` (row-major strides by default), and
* a **rank map** — the global rank at each position (the identity by default).

So ``rank_of(c) == rank_map[sum(c * strides)]``. Reshaping operations (:meth:`DeviceMesh.flatten`,
:meth:`DeviceMesh.unflatten`) only rewrite the layout when they can, and the ``(size,)``-array
view :meth:`DeviceMesh.tensor` is computed on demand, never stored.

Example::

    mesh = DeviceMesh((2, 4), ("dp", "tp"))
    mesh.groups("tp")        # [(0, 1, 2, 3), (4, 5, 6, 7)]
    mesh.groups("dp")        # [(0, 4), (1, 5), (2, 6), (3, 7)]
    mesh.coord_of(6)         # (1, 2)
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ConfigError

__all__ = ["DeviceMesh"]

_DEFAULT_NAMES = ("x", "y", "z", "w")


def _default_names(ndim: int) -> tuple[str, ...]:
    if ndim <= len(_DEFAULT_NAMES):
        return _DEFAULT_NAMES[:ndim]
    return tuple(f"d{a}" for a in range(ndim))


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class DeviceMesh:
    """An N-D grid of ranks with named axes.

    Parameters
    ----------
    shape
        Ranks per mesh axis, e.g. ``(2, 4)``; one or more positive ints.
    axis_names
        One distinct, non-empty name per axis; default ``x, y, z, w`` (``d0, d1...`` beyond 4).
    rank_map
        The global rank at each layout position (for the default row-major layout: the ranks of
        ``tensor().ravel()``). A permutation of ``0..size-1``; default the identity.
    strides
        The layout's stride per axis; default row-major. Must map the coordinates one-to-one
        onto ``[0, size)``.
    world_size
        The number of ranks of the whole job. Default ``size``; a sub-mesh (from
        :meth:`submesh`) holds some of the world's ranks, so its ``rank_map`` is then a set of
        distinct ranks in ``[0, world_size)`` instead of a permutation.

    Raises
    ------
    ConfigError
        On a bad shape, names, strides or rank map, with the fix.
    """

    __slots__ = ("shape", "strides", "rank_map", "axis_names", "world_size", "_inverse", "_hash")

    def __init__(self, shape: Sequence[int] | int, axis_names: Sequence[str] | None = None,
                 rank_map: Sequence[int] | None = None, *, strides: Sequence[int] | None = None,
                 world_size: int | None = None):
        if _is_int(shape):
            shape = (shape,)
        if (not isinstance(shape, (list, tuple)) or not shape
                or not all(_is_int(d) and d >= 1 for d in shape)):
            raise ConfigError(f"DeviceMesh shape {shape!r}: need one or more positive ints, e.g. (2, 4)")
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)
        size = math.prod(self.shape)
        self.axis_names: tuple[str, ...] = self._check_names(axis_names)
        self.strides: tuple[int, ...] = self._check_strides(strides)
        if world_size is not None and (not _is_int(world_size) or world_size < size):
            raise ConfigError(f"DeviceMesh world_size {world_size!r}: need an int ≥ the mesh size {size}")
        self.world_size: int = size if world_size is None else int(world_size)
        if rank_map is None:
            if self.world_size != size:
                raise ConfigError("DeviceMesh: a mesh smaller than its world needs an explicit rank_map")
            rank_map = range(size)
        self.rank_map: tuple[int, ...] = self._check_rank_map(rank_map, size)
        self._inverse = {r: p for p, r in enumerate(self.rank_map)}
        self._hash: int | None = None

    # validation ----------------------------------------------------------------------
    def _check_names(self, names) -> tuple[str, ...]:
        n = len(self.shape)
        if names is None:
            return _default_names(n)
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise ConfigError(f"DeviceMesh axis_names {names!r}: need a list of {n} strings, e.g. "
                              f"{list(_default_names(n))}")
        if len(names) != n:
            raise ConfigError(f"DeviceMesh axis_names {list(names)!r}: the mesh has {n} axes, give {n} names")
        if not all(isinstance(x, str) and x.strip() for x in names):
            raise ConfigError(f"DeviceMesh axis_names {list(names)!r}: names must be non-empty strings")
        if len(set(names)) != n:
            raise ConfigError(f"DeviceMesh axis_names {list(names)!r}: names must be distinct")
        return tuple(names)

    def _check_strides(self, strides) -> tuple[int, ...]:
        if strides is None:
            return _row_major(self.shape)
        if not isinstance(strides, (list, tuple)) or len(strides) != len(self.shape) \
                or not all(_is_int(s) and s >= 1 for s in strides):
            raise ConfigError(f"DeviceMesh strides {strides!r}: need {len(self.shape)} positive ints")
        strides = tuple(int(s) for s in strides)
        # one-to-one onto [0, size): sorted by stride, each stride is the product of the smaller modes
        acc = 1
        for a in sorted((a for a in range(len(self.shape)) if self.shape[a] > 1), key=lambda a: strides[a]):
            if strides[a] != acc:
                raise ConfigError(f"DeviceMesh strides {strides} with shape {self.shape} do not map the "
                                  "coordinates one-to-one onto 0..size-1; use a permutation of the "
                                  "row-major strides")
            acc *= self.shape[a]
        return strides

    def _check_rank_map(self, rank_map, size: int) -> tuple[int, ...]:
        if isinstance(rank_map, np.ndarray):
            rank_map = rank_map.ravel().tolist()
        try:
            ranks = list(rank_map)
        except TypeError:
            raise ConfigError(f"DeviceMesh rank_map {rank_map!r}: need a list of {size} ints") from None
        if not all(_is_int(r) for r in ranks):
            raise ConfigError(f"DeviceMesh rank_map {ranks!r}: entries must be ints")
        ranks = [int(r) for r in ranks]
        if len(ranks) != size:
            raise ConfigError(f"DeviceMesh rank_map has {len(ranks)} entries but the mesh shape {self.shape} "
                              f"holds {size} ranks; give exactly one rank per mesh position")
        if self.world_size == size:
            if sorted(ranks) != list(range(size)):
                raise ConfigError(f"DeviceMesh rank_map {ranks}: must be a permutation of 0..{size - 1} "
                                  "(each rank exactly once)")
        elif len(set(ranks)) != size or not all(0 <= r < self.world_size for r in ranks):
            raise ConfigError(f"DeviceMesh rank_map {ranks}: must hold distinct ranks in 0..{self.world_size - 1}")
        return tuple(ranks)

    # basic queries ---------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return len(self.rank_map)

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.shape)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The mesh's ranks in row-major coordinate order."""
        return tuple(self.tensor().ravel().tolist())

    def axis_index(self, axis: int | str) -> int:
        """The index of mesh axis ``axis`` (an index, negative from the end, or a name).

        Raises
        ------
        ConfigError
            When there is no such axis.
        """
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ConfigError(f"mesh has no axis named {axis!r}; its axes are {list(self.axis_names)}")
            return self.axis_names.index(axis)
        if _is_int(axis) and -self.ndim <= axis < self.ndim:
            return int(axis) % self.ndim
        raise ConfigError(f"mesh axis {axis!r} is out of range for a {self.ndim}-D mesh {list(self.axis_names)}")

    def _axes(self, axes) -> tuple[int, ...]:
        if isinstance(axes, (str, int, np.integer)):
            axes = (axes,)
        res = tuple(self.axis_index(a) for a in axes)
        if len(set(res)) != len(res):
            raise ConfigError(f"mesh axes {axes!r} repeat an axis")
        return res

    def axis_size(self, axis: int | str | Sequence[int | str]) -> int:
        """Ranks along ``axis`` (the product over several axes)."""
        return math.prod(self.shape[a] for a in self._axes(axis))

    # coordinates ------------------------------------------------------------------------
    def rank_of(self, coord: Sequence[int]) -> int:
        """The global rank at mesh coordinate ``coord``."""
        coord = tuple(coord)
        if len(coord) != self.ndim or not all(_is_int(c) and 0 <= c < d for c, d in zip(coord, self.shape)):
            raise ConfigError(f"mesh coordinate {coord} is outside the mesh of shape {self.shape}")
        return self.rank_map[sum(c * s for c, s in zip(coord, self.strides))]

    def coord_of(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of global rank ``rank``."""
        pos = self._inverse.get(rank) if _is_int(rank) else None
        if pos is None:
            raise ConfigError(f"rank {rank!r} is not in the mesh (its ranks: {sorted(self.rank_map)})")
        coord = [0] * self.ndim
        for a in sorted(range(self.ndim), key=lambda a: -self.strides[a]):
            if self.shape[a] > 1:
                coord[a], pos = divmod(pos, self.strides[a])
        return tuple(coord)

    def tensor(self) -> np.ndarray:
        """The mesh as an int64 array of ranks of shape ``shape`` (computed on demand)."""
        pos = np.zeros(self.shape, dtype=np.int64)
        for a, (d, s) in enumerate(zip(self.shape, self.strides)):
            idx = [1] * self.ndim
            idx[a] = d
            pos = pos + (np.arange(d, dtype=np.int64) * s).reshape(idx)
        return np.asarray(self.rank_map, dtype=np.int64)[pos]

    # groups --------------------------------------------------------------------------
    def groups(self, axis: int | str | Sequence[int | str]) -> list[tuple[int, ...]]:
        """The process groups along ``axis``.

        One tuple per combination of the other axes' coordinates (row-major over the other axes
        in mesh order); inside a tuple the ranks follow the coordinate along ``axis``. Several axes
        form one group per combination of the remaining axes, their ranks row-major over the
        given axes in the given order (the first given axis outermost).
        """
        axes = self._axes(axis)
        rest = [a for a in range(self.ndim) if a not in axes]
        t = np.transpose(self.tensor(), rest + list(axes)).reshape(-1, self.axis_size(axes))
        return [tuple(row) for row in t.tolist()]

    def group_of(self, rank: int, axis: int | str | Sequence[int | str]) -> tuple[int, ...]:
        """The group along ``axis`` that contains ``rank`` (see :meth:`groups` for the order)."""
        axes = self._axes(axis)
        coord = list(self.coord_of(rank))
        res = []
        for sub in itertools.product(*(range(self.shape[a]) for a in axes)):
            for a, c in zip(axes, sub):
                coord[a] = c
            res.append(self.rank_of(coord))
        return tuple(res)

    def group_index(self, rank: int, axis: int | str | Sequence[int | str]) -> int:
        """Position of ``rank`` inside its group along ``axis``."""
        coord = self.coord_of(rank)
        idx = 0
        for a in self._axes(axis):
            idx = idx * self.shape[a] + coord[a]
        return idx

    # derived meshes --------------------------------------------------------------------
    def submesh(self, axes: int | str | Sequence[int | str], rank: int | None = None) -> "DeviceMesh":
        """The mesh along ``axes`` (in the given order) through ``rank``.

        The other axes are fixed at ``rank``'s coordinates (at 0 when ``rank`` is ``None``). The
        result holds global ranks: its ``world_size`` is this mesh's.
        """
        axes = self._axes(axes)
        coord = [0] * self.ndim if rank is None else list(self.coord_of(rank))
        ranks = []
        for sub in itertools.product(*(range(self.shape[a]) for a in axes)):
            for a, c in zip(axes, sub):
                coord[a] = c
            ranks.append(self.rank_of(coord))
        return DeviceMesh(tuple(self.shape[a] for a in axes), tuple(self.axis_names[a] for a in axes), ranks,
                          world_size=self.world_size)

    def flatten(self, axes: Sequence[int | str] | None = None, name: str | None = None) -> "DeviceMesh":
        """Merge ``axes`` (default: all) into one axis, the first given axis outermost.

        The merged axis takes the place of the lowest of ``axes``; its name defaults to the
        names joined with ``_``. When the axes are consecutive in the layout only the layout
        changes; otherwise the rank map is re-laid out.
        """
        axes = self._axes(range(self.ndim) if axes is None else axes)
        name = name if name is not None else "_".join(self.axis_names[a] for a in axes)
        keep = [a for a in range(self.ndim) if a not in axes]
        at = min(axes)
        order = [a for a in keep if a < at] + list(axes) + [a for a in keep if a > at]
        shape = [self.shape[a] for a in keep]
        names = [self.axis_names[a] for a in keep]
        pos = sum(1 for a in keep if a < at)
        merged = math.prod(self.shape[a] for a in axes)
        shape.insert(pos, merged)
        names.insert(pos, name)
        live = [a for a in axes if self.shape[a] > 1]
        if all(self.strides[a] == self.strides[b] * self.shape[b] for a, b in zip(live, live[1:])):
            strides = [self.strides[a] for a in keep]
            strides.insert(pos, self.strides[live[-1]] if live else 1)
            return DeviceMesh(shape, names, self.rank_map, strides=strides, world_size=self.world_size)
        ranks = np.transpose(self.tensor(), order).reshape(shape)
        return DeviceMesh(shape, names, ranks.ravel().tolist(), world_size=self.world_size)

    def unflatten(self, axis: int | str, sizes: Sequence[int], names: Sequence[str] | None = None) -> "DeviceMesh":
        """Split ``axis`` into several axes of ``sizes`` (row-major: the first size outermost).

        ``names`` default to the axis name suffixed ``_0``, ``_1``...; the rank map is unchanged.
        """
        a = self.axis_index(axis)
        sizes = tuple(sizes)
        if not sizes or not all(_is_int(s) and s >= 1 for s in sizes) or math.prod(sizes) != self.shape[a]:
            raise ConfigError(f"cannot unflatten mesh axis {self.axis_names[a]!r} of size {self.shape[a]} into "
                              f"{sizes}: the sizes must be positive ints multiplying to {self.shape[a]}")
        names = tuple(names) if names is not None else tuple(f"{self.axis_names[a]}_{k}" for k in range(len(sizes)))
        inner = [s * self.strides[a] for s in _row_major(sizes)]
        return DeviceMesh(self.shape[:a] + sizes + self.shape[a + 1:],
                          self.axis_names[:a] + names + self.axis_names[a + 1:], self.rank_map,
                          strides=self.strides[:a] + tuple(inner) + self.strides[a + 1:],
                          world_size=self.world_size)

    # serialization -------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-able description; :meth:`from_dict` restores an equal mesh."""
        return {"shape": list(self.shape), "axis_names": list(self.axis_names), "strides": list(self.strides),
                "rank_map": list(self.rank_map), "world_size": self.world_size}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeviceMesh":
        """Build a mesh from :meth:`to_dict`'s output (``strides``, ``rank_map``, ``world_size``
        and ``axis_names`` are optional)."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a mesh description must be a dict, got {type(d).__name__}")
        known = {"shape", "axis_names", "strides", "rank_map", "world_size"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"mesh description: unknown key(s) {unknown}; known keys: {sorted(known)}")
        if "shape" not in d:
            raise ConfigError("mesh description: 'shape' is required")
        return cls(d["shape"], d.get("axis_names"), d.get("rank_map"), strides=d.get("strides"),
                   world_size=d.get("world_size"))

    # comparison and printing ---------------------------------------------------------
    def _key(self) -> tuple:
        return self.shape, self.axis_names, self.ranks, self.world_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self is other or self._key() == other._key()

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._key())
        return self._hash

    def __reduce__(self):  # rebuild on unpickling: the cached hash is per process
        return DeviceMesh.from_dict, (self.to_dict(),)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={d}" for n, d in zip(self.axis_names, self.shape))
        return f"DeviceMesh({axes}; ranks={self.tensor().tolist()})"
