"""Placements and tensor shard specs.

A :class:`TensorShardSpec` gives one :class:`Placement` per mesh axis:

* ``Shard(d)`` — the ranks along the axis hold consecutive chunks of tensor dim ``d``;
* ``Replicate()`` — they hold the same values;
* ``Partial(op)`` — they hold addends (or candidates) whose ``op`` over the axis is the value.

Printed as ``S(0)R``, ``RS(1)``, ``P(sum)R`` and parsed back with :meth:`TensorShardSpec.parse`.

Chunks follow ``torch.chunk`` (and DTensor): a dim of ``size`` over ``n`` ranks is cut into
chunks of ``ceil(size / n)``; the trailing chunks are short or empty. When several mesh axes
shard the same dim, the dim is split by the lowest mesh axis first, then each piece by the next
mesh axis, and so on (DTensor's left-to-right order): with a 5-row tensor on ``S(0)S(0)`` over a
2 x 2 mesh, axis 0 gives rows ``[0, 3)`` and ``[3, 5)`` and axis 1 splits them into
``[0, 2), [2, 3), [3, 4), [4, 5)``.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from ..errors import ConfigError, ShapeError

if TYPE_CHECKING:
    from .mesh import DeviceMesh

__all__ = ["Placement", "Shard", "Replicate", "Partial", "TensorShardSpec", "PARTIAL_OPS", "chunk_bounds",
           "padded_chunk"]

#: Reductions a ``Partial`` placement may stand for.
PARTIAL_OPS = ("sum", "max", "min", "avg")


class Placement:
    """How the ranks along one mesh axis hold a tensor. Ordered: ``R < S(0) < S(1) < P(...)``."""

    __slots__ = ()

    def _key(self) -> tuple:
        raise NotImplementedError

    def __lt__(self, other):
        return self._key() < other._key() if isinstance(other, Placement) else NotImplemented

    def __le__(self, other):
        return self._key() <= other._key() if isinstance(other, Placement) else NotImplemented

    def __gt__(self, other):
        return self._key() > other._key() if isinstance(other, Placement) else NotImplemented

    def __ge__(self, other):
        return self._key() >= other._key() if isinstance(other, Placement) else NotImplemented

    def is_shard(self, dim: int | None = None) -> bool:
        """True for ``Shard`` (of ``dim`` when given)."""
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, op: str | None = None) -> bool:
        """True for ``Partial`` (with reduction ``op`` when given)."""
        return False


@dataclass(frozen=True, repr=False)
class Shard(Placement):
    """The ranks along the mesh axis hold consecutive ``torch.chunk`` chunks of tensor dim ``dim``."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, numbers.Integral) or isinstance(self.dim, bool) or self.dim < 0:
            raise ConfigError(f"Shard(dim={self.dim!r}): dim must be a non-negative int")
        object.__setattr__(self, "dim", int(self.dim))

    def _key(self) -> tuple:
        return (1, self.dim)

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__


@dataclass(frozen=True, repr=False)
class Replicate(Placement):
    """Every rank along the mesh axis holds the whole (local) tensor."""

    def _key(self) -> tuple:
        return (0,)

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"

    __repr__ = __str__


@dataclass(frozen=True, repr=False)
class Partial(Placement):
    """The ranks along the mesh axis hold values whose ``op`` (sum, max, min, avg) is the tensor."""

    op: str = "sum"

    def __post_init__(self):
        if self.op not in PARTIAL_OPS:
            raise ConfigError(f"Partial(op={self.op!r}): op must be one of {list(PARTIAL_OPS)}")

    def _key(self) -> tuple:
        return (2, PARTIAL_OPS.index(self.op))

    def is_partial(self, op: str | None = None) -> bool:
        return op is None or op == self.op

    def __str__(self) -> str:
        return f"P({self.op})"

    __repr__ = __str__


def chunk_bounds(size: int, n: int, idx: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``idx`` when ``size`` elements are cut into ``n`` chunks.

    ``torch.chunk`` semantics: every chunk has ``ceil(size / n)`` elements except the trailing
    ones, which are short or empty (``chunk_bounds(5, 4, 3) == (5, 5)``). This is not
    ``numpy.array_split``, which balances the sizes.
    """
    if n < 1 or not 0 <= idx < n or size < 0:
        raise ValueError(f"chunk_bounds({size}, {n}, {idx}): need size >= 0, n >= 1 and 0 <= idx < n")
    c = -(-size // n)
    return min(idx * c, size), min((idx + 1) * c, size)


def padded_chunk(size: int, n: int) -> int:
    """The per-rank chunk size collectives pad to: ``ceil(size / n)``."""
    if n < 1 or size < 0:
        raise ValueError(f"padded_chunk({size}, {n}): need size >= 0 and n >= 1")
    return -(-size // n)


_TOKEN = re.compile(r"\s*(?:S\(\s*(\d+)\s*\)|(R)|P\(\s*(\w+)\s*\)|(P)(?!\())")


@dataclass(frozen=True, order=True)
class TensorShardSpec:
    """One :class:`Placement` per mesh axis.

    Parameters
    ----------
    placements
        ``placements[a]`` says how the ranks along mesh axis ``a`` hold the tensor.
    """

    placements: tuple[Placement, ...]

    def __post_init__(self):
        ps = tuple(self.placements)
        if not all(isinstance(p, Placement) for p in ps):
            raise ConfigError(f"TensorShardSpec placements {ps!r}: each must be Shard, Replicate or Partial")
        object.__setattr__(self, "placements", ps)
        object.__setattr__(self, "_hash", hash(ps))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:  # (the planner compares specs millions of times: the hash first)
        if self is other:
            return True
        if not isinstance(other, TensorShardSpec):
            return NotImplemented
        return self._hash == other._hash and self.placements == other.placements

    def __reduce__(self):  # rebuild on unpickling: string hashes differ between processes
        return TensorShardSpec, (self.placements,)

    # construction -----------------------------------------------------------------
    @classmethod
    def replicated(cls, mesh_ndim: int) -> "TensorShardSpec":
        """``R`` on every one of ``mesh_ndim`` axes."""
        return cls((Replicate(),) * mesh_ndim)

    @classmethod
    def parse(cls, text: str) -> "TensorShardSpec":
        """Parse ``"S(0)R"``, ``"RS(1)"``, ``"P(sum)R"`` (``P`` alone means ``P(sum)``).

        Raises
        ------
        ConfigError
            When ``text`` is not a sequence of ``S(<dim>)``, ``R`` and ``P(<op>)``.
        """
        if not isinstance(text, str):
            raise ConfigError(f"a shard spec must be a string like 'S(0)R', got {type(text).__name__}")
        ps: list[Placement] = []
        pos = 0
        body = text.rstrip()
        while pos < len(body):
            m = _TOKEN.match(body, pos)
            if not m:
                raise ConfigError(f"cannot parse shard spec {text!r} at {body[pos:]!r}: write one placement per "
                                  "mesh axis as S(<dim>), R or P(<op>), e.g. 'S(0)R' or 'P(sum)S(1)'")
            if m.group(1) is not None:
                ps.append(Shard(int(m.group(1))))
            elif m.group(2):
                ps.append(Replicate())
            else:
                ps.append(Partial(m.group(3) or "sum"))
            pos = m.end()
        if not ps:
            raise ConfigError(f"empty shard spec {text!r}: give one placement per mesh axis, e.g. 'RR'")
        return cls(tuple(ps))

    @classmethod
    def from_dim_axes(cls, dim_axes: Sequence[Sequence[int]], mesh_ndim: int,
                      partial: Mapping[int, str] | Sequence[int] | None = None) -> "TensorShardSpec":
        """Build a spec from, for each tensor dim, the mesh axes splitting it (in mesh-axis order).

        ``partial`` names the ``Partial`` mesh axes: a mapping axis → op, or a sequence of axes
        (``sum``). Axes not mentioned are ``Replicate``.
        """
        ps: list[Placement] = [Replicate()] * mesh_ndim

        def claim(a: int, p: Placement):
            if not 0 <= a < mesh_ndim:
                raise ConfigError(f"mesh axis {a} is out of range for a {mesh_ndim}-D mesh")
            if not ps[a].is_replicate():
                raise ConfigError(f"mesh axis {a} is used twice ({ps[a]} and {p})")
            ps[a] = p

        for d, axes in enumerate(dim_axes):
            axes = tuple(axes)
            if list(axes) != sorted(axes):
                raise ConfigError(f"tensor dim {d} is split by mesh axes {axes}: list them in increasing order "
                                  "(a dim is split by the lowest mesh axis first)")
            for a in axes:
                claim(a, Shard(d))
        if partial is not None:
            items = partial.items() if isinstance(partial, Mapping) else ((a, "sum") for a in partial)
            for a, op in items:
                claim(a, Partial(op))
        return cls(tuple(ps))

    def with_placement(self, axis: int, placement: Placement) -> "TensorShardSpec":
        """This spec with mesh axis ``axis`` set to ``placement``."""
        ps = list(self.placements)
        ps[axis] = placement
        return TensorShardSpec(tuple(ps))

    # queries ------------------------------------------------------------------------
    @property
    def mesh_ndim(self) -> int:
        return len(self.placements)

    def __len__(self) -> int:
        return len(self.placements)

    def __getitem__(self, axis: int) -> Placement:
        return self.placements[axis]

    def __iter__(self):
        return iter(self.placements)

    @property
    def is_replicated(self) -> bool:
        """True when every mesh axis replicates the tensor."""
        return all(p.is_replicate() for p in self.placements)

    @property
    def partial_axes(self) -> tuple[int, ...]:
        """The mesh axes holding ``Partial`` values."""
        return tuple(a for a, p in enumerate(self.placements) if p.is_partial())

    @property
    def partial_ops(self) -> tuple[str, ...]:
        """The distinct reductions of the ``Partial`` axes, in mesh-axis order."""
        return tuple(dict.fromkeys(p.op for p in self.placements if isinstance(p, Partial)))

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        """The tensor dims split by at least one mesh axis, ascending."""
        return tuple(sorted({p.dim for p in self.placements if isinstance(p, Shard)}))

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """The mesh axes splitting tensor dim ``dim``, in mesh-axis (= splitting) order."""
        return tuple(a for a, p in enumerate(self.placements) if p.is_shard(dim))

    def dim_axes(self, ndim: int) -> tuple[tuple[int, ...], ...]:
        """For each of the tensor's ``ndim`` dims, the mesh axes splitting it, in mesh-axis order.

        Raises
        ------
        ShapeError
            When a ``Shard`` names a dim the tensor does not have.
        """
        self.check_ndim(ndim)
        return tuple(self.shard_axes(d) for d in range(ndim))

    def check_ndim(self, ndim: int) -> None:
        """Raise :class:`ShapeError` when a ``Shard`` names a dim ``>= ndim``."""
        for p in self.placements:
            if isinstance(p, Shard) and p.dim >= ndim:
                raise ShapeError(f"shard spec {self} splits dim {p.dim} but the tensor has rank {ndim}")

    def _check_mesh(self, shape: Sequence[int], mesh: "DeviceMesh") -> None:
        if len(self.placements) != mesh.ndim:
            raise ShapeError(f"shard spec {self} has {len(self.placements)} placements but the mesh has "
                             f"{mesh.ndim} axes")
        self.check_ndim(len(shape))

    # local shapes -------------------------------------------------------------------
    def local_bounds(self, global_shape: Sequence[int], mesh: "DeviceMesh", rank: int) -> tuple[tuple[int, int], ...]:
        """Per tensor dim, the ``[start, stop)`` of ``rank``'s shard in the global tensor.

        A dim split by several mesh axes is split by the lowest axis first, then each piece by the
        next axis (see the module docstring).
        """
        global_shape = tuple(int(d) for d in global_shape)
        self._check_mesh(global_shape, mesh)
        coord = mesh.coord_of(rank)
        bounds = [(0, d) for d in global_shape]
        for a, p in enumerate(self.placements):
            if isinstance(p, Shard):
                lo, hi = bounds[p.dim]
                s, e = chunk_bounds(hi - lo, mesh.shape[a], coord[a])
                bounds[p.dim] = (lo + s, lo + e)
        return tuple(bounds)

    def local_shape(self, global_shape: Sequence[int], mesh: "DeviceMesh", rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s shard of a tensor of ``global_shape``."""
        return tuple(e - s for s, e in self.local_bounds(global_shape, mesh, rank))

    def padded_local_shape(self, global_shape: Sequence[int], mesh: "DeviceMesh | Sequence[int]") -> tuple[int, ...]:
        """The largest shard shape over all ranks (what collectives pad every shard to).

        ``mesh`` may be a :class:`DeviceMesh` or just its shape.
        """
        mesh_shape = tuple(mesh.shape if hasattr(mesh, "shape") else mesh)
        if len(self.placements) != len(mesh_shape):
            raise ShapeError(f"shard spec {self} has {len(self.placements)} placements but the mesh has "
                             f"{len(mesh_shape)} axes")
        shape = [int(d) for d in global_shape]
        self.check_ndim(len(shape))
        for a, p in enumerate(self.placements):
            if isinstance(p, Shard):
                shape[p.dim] = padded_chunk(shape[p.dim], mesh_shape[a])
        return tuple(shape)

    def num_shards(self, mesh_shape: Sequence[int]) -> int:
        """Into how many pieces the tensor is split (product of the sizes of the ``Shard`` axes)."""
        return math.prod(n for n, p in zip(mesh_shape, self.placements) if isinstance(p, Shard))

    # printing ------------------------------------------------------------------------
    def __str__(self) -> str:
        return "".join(str(p) for p in self.placements)

    def __repr__(self) -> str:
        return f"TensorShardSpec({str(self)!r})"
