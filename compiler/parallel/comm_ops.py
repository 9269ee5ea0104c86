"""Communication as graph ops: the collectives partition injects, plus two local ops.

Every op here is an ordinary :class:`~shardflow.compiler.ir.graph.Operator` of a rank's graph.
Inputs and outputs are that rank's *local* tensors, and the shapes follow the rank's shard, so
all ranks run the same sequence of ops with rank-specific shapes and attributes.

* Collectives (:class:`AllReduce`, :class:`AllGather`, :class:`ReduceScatter`,
  :class:`AllToAll`) work over the process group along ``mesh_axis`` (an axis index, or a tuple
  of axes for a group spanning several axes, ranked row-major over them, see
  :meth:`DeviceMesh.groups`). Their outputs are ``extern``: a rank's result needs the other
  ranks' data, so they run only under a communicator (the runtime) or
  :func:`~shardflow.compiler.parallel.simulate.simulate`; their ``numpy()`` raises.
  ``collective`` names the kind; ``group_size`` is the number of ranks in the group.
* :class:`LocalSlice` and :class:`LocalPartial` are plain local ops with exact compute
  definitions; their rank-specific values (offsets, which rank keeps the value) are attributes.

Uneven dims follow ``torch.chunk`` (see :func:`~shardflow.compiler.parallel.placement.chunk_bounds`):
rank ``j`` of a group holds chunk ``j``; the collectives pad every chunk to
:func:`~shardflow.compiler.parallel.placement.padded_chunk` internally and trim the result.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..errors import ShapeError, ShardflowError
from ..ir.expr import Const
from ..ir.graph import Operator
from ..ir.task import TensorInput, compute, extern
from .placement import PARTIAL_OPS, chunk_bounds, padded_chunk

__all__ = ["Collective", "AllReduce", "AllGather", "ReduceScatter", "AllToAll", "LocalSlice", "LocalPartial",
           "is_collective", "mesh_axes"]


def mesh_axes(mesh_axis: int | tuple[int, ...]) -> tuple[int, ...]:
    """The ``mesh_axis`` attribute of a collective as a tuple of axes."""
    return tuple(mesh_axis) if isinstance(mesh_axis, tuple) else (int(mesh_axis),)


def is_collective(op: Operator) -> bool:
    """True for the ops that need a communicator."""
    return isinstance(op, Collective)


def _dim(x: TensorInput, dim: int, who: str) -> int:
    if not isinstance(dim, int) or not 0 <= dim < x.ndim:
        raise ShapeError(f"{who}: dim {dim!r} is out of range for an input of shape {list(x.shape)}")
    return dim


class Collective(Operator):
    """Base of the ops that exchange data over a process group along ``mesh_axis``."""

    #: The collective's kind: ``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all``.
    collective: ClassVar[str] = ""
    #: A rank's result depends on other ranks' data: never folded or merged by graph passes.
    data_dependent_values: ClassVar[bool] = True

    @property
    def axes(self) -> tuple[int, ...]:
        """The mesh axes of the group."""
        return mesh_axes(self.attrs["mesh_axis"])

    def _check_group(self) -> int:
        n = self.attrs.get("group_size")
        if not isinstance(n, int) or n < 1:
            raise ShapeError(f"{self.name} ({self.op_type}): group_size must be a positive int, got {n!r}")
        idx = self.attrs.get("group_index", 0)
        if not isinstance(idx, int) or not 0 <= idx < n:
            raise ShapeError(f"{self.name} ({self.op_type}): group_index {idx!r} is outside a group of {n}")
        return n

    def _check_op(self) -> str:
        op = self.attrs.get("op", "sum")
        if op not in PARTIAL_OPS:
            raise ShapeError(f"{self.name} ({self.op_type}): reduction {op!r} is not one of {list(PARTIAL_OPS)}")
        return op

    def _reason(self) -> str:
        return f"{self.collective.replace('_', '-')} over mesh axis {self.attrs['mesh_axis']}"

    def numpy(self, *arrays: np.ndarray) -> list[np.ndarray]:
        raise ShardflowError(
            f"{self.name} ({self.op_type}) is a collective: it needs the other ranks' data and runs only under a "
            "communicator (shardflow.runtime) or shardflow.compiler.parallel.simulate.simulate, not FlowGraph.run")


class AllReduce(Collective):
    """Every rank of the group gets the ``op`` (sum, max, min, avg) of all ranks' ``x``.

    Attributes: ``mesh_axis``, ``op``, ``group_size``.
    """

    collective = "all_reduce"

    def compute(self, x):
        self._check_group()
        op = self._check_op()
        return extern("y", x.shape, x.dtype, [(0, d) for d in range(x.ndim)], f"{self._reason()} ({op})")


class AllGather(Collective):
    """Concatenate the group's chunks of ``dim``: rank ``j`` holds chunk ``j`` of a dim of
    ``global_size`` (``torch.chunk`` bounds); every rank gets all ``global_size`` entries.

    Attributes: ``mesh_axis``, ``dim``, ``global_size``, ``group_size``.
    """

    collective = "all_gather"

    def compute(self, x):
        n = self._check_group()
        dim = _dim(x, self.attrs["dim"], self.name)
        size = self.attrs["global_size"]
        if not isinstance(size, int) or size < 0 or x.shape[dim] > padded_chunk(size, n):
            raise ShapeError(f"{self.name} (AllGather): a chunk of {x.shape[dim]} along dim {dim} cannot come from "
                             f"a dim of global_size {size!r} over {n} ranks")
        shape = list(x.shape)
        shape[dim] = size
        amap = [None if d == dim else (0, d) for d in range(x.ndim)]
        return extern("y", shape, x.dtype, amap, f"{self._reason()} (dim {dim})")


class ReduceScatter(Collective):
    """Reduce the group's ``x`` with ``op`` and keep chunk ``group_index`` of ``dim``.

    Attributes: ``mesh_axis``, ``dim``, ``op``, ``group_size``, ``group_index``.
    """

    collective = "reduce_scatter"

    def compute(self, x):
        n = self._check_group()
        op = self._check_op()
        dim = _dim(x, self.attrs["dim"], self.name)
        lo, hi = chunk_bounds(x.shape[dim], n, self.attrs["group_index"])
        shape = list(x.shape)
        shape[dim] = hi - lo
        amap = [None if d == dim else (0, d) for d in range(x.ndim)]
        return extern("y", shape, x.dtype, amap, f"{self._reason()} ({op}, dim {dim})")


class AllToAll(Collective):
    """Move the split from ``src_dim`` to ``dst_dim``, built from grouped send/recv.

    Rank ``j`` holds chunk ``j`` of ``src_dim`` (a dim of ``src_size``) and the whole
    ``dst_dim``. It sends chunk ``k`` of ``dst_dim`` to peer ``k`` and concatenates the pieces
    received from peers ``0..n-1`` along ``src_dim``: it ends with the whole ``src_dim`` and
    chunk ``j`` of ``dst_dim``.

    Attributes: ``mesh_axis``, ``src_dim``, ``dst_dim``, ``src_size``, ``group_size``,
    ``group_index``.
    """

    collective = "all_to_all"

    def compute(self, x):
        n = self._check_group()
        src = _dim(x, self.attrs["src_dim"], self.name)
        dst = _dim(x, self.attrs["dst_dim"], self.name)
        size = self.attrs["src_size"]
        if src == dst:
            raise ShapeError(f"{self.name} (AllToAll): src_dim and dst_dim are both {src}")
        if not isinstance(size, int) or size < 0 or x.shape[src] > padded_chunk(size, n):
            raise ShapeError(f"{self.name} (AllToAll): a chunk of {x.shape[src]} along dim {src} cannot come from "
                             f"a dim of src_size {size!r} over {n} ranks")
        lo, hi = chunk_bounds(x.shape[dst], n, self.attrs["group_index"])
        shape = list(x.shape)
        shape[src], shape[dst] = size, hi - lo
        amap = [None if d in (src, dst) else (0, d) for d in range(x.ndim)]
        return extern("y", shape, x.dtype, amap, f"{self._reason()} (dim {src} -> dim {dst})")


class LocalSlice(Operator):
    """``y = x[..., start:stop, ...]`` along ``dim`` (the rank's offsets are the attributes).

    Partition creates one per rank, e.g. to take a rank's shard of a replicated tensor.
    """

    injective = True

    def compute(self, x):
        dim = _dim(x, self.attrs["dim"], self.name)
        start, stop = self.attrs["start"], self.attrs["stop"]
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= x.shape[dim]):
            raise ShapeError(f"{self.name} (LocalSlice): [{start!r}, {stop!r}) is not a range inside dim {dim} of "
                             f"size {x.shape[dim]}")
        shape = list(x.shape)
        shape[dim] = stop - start

        def f(*i):
            idx = list(i)
            idx[dim] = idx[dim] + start if start else idx[dim]
            return x[tuple(idx)]
        return compute("y", shape, f, dtype=x.dtype)

    def numpy(self, x):
        dim = self.attrs["dim"]
        return [x[(slice(None),) * dim + (slice(self.attrs["start"], self.attrs["stop"]),)]]

    def passthrough_input(self):
        x = self.inputs[0]
        return 0 if self.attrs["start"] == 0 and self.attrs["stop"] == x.shape[self.attrs["dim"]] else None


class LocalPartial(Operator):
    """Turn a replicated value into ``Partial`` addends: ``y = x`` if ``keep`` else zeros.

    For ``Partial(sum)`` partition sets ``keep`` on the group's first rank only; for max, min and
    avg every rank keeps its value.
    """

    injective = True

    def compute(self, x):
        if self.attrs["keep"]:
            return compute("y", x.shape, lambda *i: x[i], dtype=x.dtype)
        zero = Const(False if x.dtype == "bool" else 0, x.dtype)
        return compute("y", x.shape, lambda *i: zero, dtype=x.dtype)

    def numpy(self, x):
        return [x if self.attrs["keep"] else np.zeros_like(x)]

    def passthrough_input(self):
        return 0 if self.attrs["keep"] else None
