"""Convolution, transposed convolution, pooling and resize (N-D over the dims after ``[N, C]``).

Windows read the input at ``o * stride + k * dilation - pad_begin``; reads that fall in the
padding sit in the untaken branch of a select. The numpy implementations use sliding-window
views (im2col + matmul for convolutions).

Attributes use full per-spatial-dim tuples: ``strides``, ``dilations``, ``kernel`` (pools) and
``pads = (begin_0, ..., begin_n, end_0, ..., end_n)`` as in ONNX.
"""
from __future__ import annotations

import math
from itertools import product
from typing import ClassVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import ShapeError
from ..ir.expr import (BinOp, Cast, Const, Expr, UnaryOp, affine_expr, dtype_kind, eq, if_then_else, logical_and,
                       maximum, minimum, numpy_type, sum_type)
from ..ir.graph import Operator
from ..ir.task import compute, reduce

__all__ = ["Conv", "PackedConv", "PackedConvInteger", "PackedConvBf16", "pack_bf16_conv", "pack_int8_conv",
           "int8_conv_rows", "INT8_CONV_MIN_K", "BLOCK", "block_channels",
           "unblock_channels", "WinogradConv", "winograd_weights", "WINOGRAD", "ConvTranspose", "Pool", "GlobalPool",
           "Resize", "conv_output_size", "pool_output_size"]


def conv_output_size(size: int, kernel: int, stride: int, dilation: int, pad_begin: int, pad_end: int) -> int:
    """Output extent of a convolution window sweep (floor rounding)."""
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1


def pool_output_size(size: int, kernel: int, stride: int, dilation: int, pad_begin: int, pad_end: int,
                     ceil_mode: bool) -> int:
    """Output extent of a pooling window sweep; with ``ceil_mode`` the last window must start
    inside the input or the begin padding (ONNX / PyTorch rule)."""
    span = size + pad_begin + pad_end - dilation * (kernel - 1) - 1
    if not ceil_mode:
        return span // stride + 1
    out = -(-span // stride) + 1
    if (out - 1) * stride >= size + pad_begin:
        out -= 1
    return out


def _spatial(op: Operator, x, n_sp: int):
    """The op's strides, dilations and (begin, end) pads, checked against ``n_sp`` spatial dims."""
    strides = tuple(op.attrs.get("strides") or (1,) * n_sp)
    dil = tuple(op.attrs.get("dilations") or (1,) * n_sp)
    pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
    if len(strides) != n_sp or len(dil) != n_sp or len(pads) != 2 * n_sp:
        raise ShapeError(f"{op.name}: input of shape {x.shape} has {n_sp} spatial dims, but strides={strides}, "
                         f"dilations={dil}, pads={pads}")
    if min(strides + dil, default=1) < 1:
        raise ShapeError(f"{op.name}: strides {strides} and dilations {dil} must be positive")
    return strides, dil, pads[:n_sp], pads[n_sp:]


def _tiles(kern, s, dil, pb, ins, out) -> bool:
    """A transposed conv's windows (``kern`` taps at strides ``s``, dilations ``dil``, padding
    ``pb`` before) cover the output ``out`` of input ``ins`` exactly, without overlap."""
    return all(k == st and d == 1 and p == 0 and o == i * st for k, st, d, p, i, o in zip(kern, s, dil, pb, ins, out))


def _window_pos(o: Expr, k: Expr, stride: int, dilation: int, kernel: int, pad: int) -> Expr:
    """The input position ``o * stride + k * dilation - pad`` read by window ``o`` at tap ``k``."""
    return affine_expr([(o, stride), (k, dilation if kernel > 1 else 0)], -pad)


def _window_guard(pos: list[Expr], lo: list[int], hi: list[int], may_low: list[bool], may_high: list[bool]):
    """``lo[d] <= pos[d] < hi[d]`` for the dims where the bound can be crossed, or ``None``."""
    conds = []
    for d, p in enumerate(pos):
        if may_low[d]:
            conds.append(p >= lo[d])
        if may_high[d]:
            conds.append(p < hi[d])
    return _all(conds)


def _all(conds: list[Expr]) -> Expr | None:
    """The conjunction of ``conds`` (``None`` when empty)."""
    res = None
    for c in conds:
        res = c if res is None else logical_and(res, c)
    return res


def _lowest(dtype: str) -> Const:
    k = dtype_kind(dtype)
    if k == "f":
        return Const(-np.inf, dtype)
    if k == "b":
        return Const(False, dtype)
    return Const(int(np.iinfo(dtype).min), dtype)


def _windows(xp: np.ndarray, kernel, strides, dil, out) -> np.ndarray:
    """View of shape ``(N, C, *out, *kernel)`` of the (already padded) ``xp``."""
    n_sp = len(kernel)
    span = tuple((k - 1) * d + 1 for k, d in zip(kernel, dil))
    v = sliding_window_view(xp, span, axis=tuple(range(2, 2 + n_sp)))
    sl = (slice(None),) * 2 + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides)) \
        + tuple(slice(None, None, d) for d in dil)
    return v[sl]


def _pad_for(x: np.ndarray, kernel, strides, dil, pb, out, value) -> np.ndarray:
    """Pad (or crop) the spatial dims so that ``out`` windows fit exactly."""
    pads = [(0, 0), (0, 0)]
    crop = [slice(None), slice(None)]
    for d in range(len(kernel)):
        need = (out[d] - 1) * strides[d] + (kernel[d] - 1) * dil[d] + 1
        end = need - pb[d] - x.shape[2 + d]
        pads.append((pb[d], max(end, 0)))
        crop.append(slice(0, need))
    return np.pad(x, pads, constant_values=value)[tuple(crop)]


#: Channels per block of the cpu target's blocked layout: a tensor ``[N, C, H, W]`` (``C`` a multiple of
#: BLOCK) stored as ``[N, C / BLOCK, H, W, BLOCK]`` (passes/layout.py).
BLOCK = 16


def block_channels(a: np.ndarray) -> np.ndarray:
    """``[N, C, *spatial]`` in the blocked layout ``[N, C / BLOCK, *spatial, BLOCK]``."""
    n, c = a.shape[:2]
    b = a.reshape((n, c // BLOCK, BLOCK) + a.shape[2:])
    return np.ascontiguousarray(np.moveaxis(b, 2, -1))


def unblock_channels(a: np.ndarray) -> np.ndarray:
    """The inverse of :func:`block_channels`."""
    b = np.moveaxis(a, -1, 2)
    return np.ascontiguousarray(b.reshape((a.shape[0], a.shape[1] * BLOCK) + a.shape[2:-1]))


class Conv(Operator):
    """N-D convolution ``y[n, oc, o] = bias[oc] + sum_{ic, k} x[n, g*ICG + ic, o*s + k*d - pb] * w[oc, ic, k]``.

    Inputs ``x [N, C, *in]``, ``w [OC, C/group, *k]``, optional ``bias [OC]``; attributes ``group``,
    ``strides``, ``dilations``, ``pads``; ``blocked_in`` and ``blocked_out`` (2-D; the cpu target gives
    them to PackedConv, WinogradConv and depthwise Convs only): ``x``, or ``y``, is in the blocked layout
    ``[N, C / BLOCK, H, W, BLOCK]`` (:data:`BLOCK`; passes/layout.py), its channels a multiple of BLOCK.
    """

    #: a grouped conv splits by whole groups across ranks (the rules read its input channel ``(oc // ocg) *
    #: icg + ic`` in the group number; :meth:`local_attrs` gives the local op its share of the groups)
    splits_by_blocks: ClassVar[bool] = True

    def _weight_shape(self, x, w) -> tuple[int, ...]:
        """``[OC, C/group, *kernel]``: the shape of the weight the op reads."""
        if w.ndim != len(self._x_shape(x)):
            raise ShapeError(f"{self.name}: Conv takes x [N, C, spatial...] and w of the same rank, got {x.shape} "
                             f"and {w.shape}")
        return tuple(w.shape)

    def _weight_at(self, w, oc, ic, k):
        """The weight of output channel ``oc``, input channel ``ic`` (of its group) and tap ``k``."""
        return w[(oc, ic, *k)]

    def _x_shape(self, x) -> tuple[int, ...]:
        """The logical ``[N, C, *in]`` of the input ``x`` (its shape unless ``blocked_in``)."""
        if not self.attrs.get("blocked_in"):
            return tuple(x.shape)
        if x.ndim != 5 or x.shape[-1] != BLOCK:
            raise ShapeError(f"{self.name}: a blocked input is [N, C/{BLOCK}, H, W, {BLOCK}], got {x.shape}")
        return (x.shape[0], x.shape[1] * BLOCK) + tuple(x.shape[2:-1])

    def _x_at(self, x, n, ch, pos):
        """The input element of image ``n``, channel ``ch`` at spatial position ``pos``."""
        if not self.attrs.get("blocked_in"):
            return x[(n, ch, *pos)]
        return x[(n, ch // BLOCK, *pos, ch % BLOCK)]

    def _output(self, shape, f, dt):
        """The compute of the output ``y[n, oc, *out] = f(n, oc, *out)`` over the logical ``shape`` (blocked
        with ``blocked_out``)."""
        if not self.attrs.get("blocked_out"):
            return compute("y", shape, f, dtype=dt)
        if shape[1] % BLOCK or len(shape) != 4:
            raise ShapeError(f"{self.name}: a blocked output needs a 2-D conv of a multiple of {BLOCK} channels, "
                             f"got [N, OC, ...] = {list(shape)}")
        return compute("y", (shape[0], shape[1] // BLOCK) + tuple(shape[2:]) + (BLOCK,),
                       lambda n, cb, *o: f(n, cb * BLOCK + o[-1], *o[:-1]), dtype=dt)

    def compute(self, x, w, *bias):
        return self._conv_compute(x, w, bias, x.dtype, self._x_at, self._weight_at)

    def _conv_compute(self, x, w, bias, dt: str, x_at, weight_at, finish=None, out_dt: str | None = None):
        """The conv's compute in ``dt``: ``sum x_at(x, n, ch, pos) * weight_at(w, oc, ic, k)`` over the
        window (taps in the padding read 0) plus ``bias``, then ``finish`` (an ``Expr -> Expr``) giving the
        output of type ``out_dt`` (default: ``dt``)."""
        xs = self._x_shape(x)
        n_sp = len(xs) - 2
        wshape = self._weight_shape(x, w)
        if n_sp < 1:
            raise ShapeError(f"{self.name}: Conv takes x [N, C, spatial...], got {x.shape}")
        g = self.attrs.get("group", 1)
        s, dil, pb, pe = _spatial(self, x, n_sp)
        n, c = xs[:2]
        oc, icg = wshape[:2]
        kern = wshape[2:]
        if g < 1 or c != icg * g or oc % g:
            raise ShapeError(f"{self.name}: x has {c} channels and w has shape {wshape}; with group={g} w must be "
                             f"[M, C/group, ...] with M divisible by group")
        if bias and bias[0].shape != (oc,):
            raise ShapeError(f"{self.name}: bias has shape {bias[0].shape}, expected ({oc},)")
        ins = xs[2:]
        out = tuple(conv_output_size(ins[d], kern[d], s[d], dil[d], pb[d], pe[d]) for d in range(n_sp))
        if min(out, default=1) < 1:
            raise ShapeError(f"{self.name}: the kernel {kern} (dilations {dil}) does not fit the padded input {ins}")
        ocg = oc // g
        may_low = [pb[d] > 0 for d in range(n_sp)]
        may_high = [(out[d] - 1) * s[d] + (kern[d] - 1) * dil[d] - pb[d] > ins[d] - 1 for d in range(n_sp)]

        def f(ni, oci, *o):
            def body(ic, *k):
                if g == 1:
                    ch = ic
                elif icg == 1:
                    ch = oci if ocg == 1 else oci // ocg
                else:
                    ch = (oci // ocg) * icg + ic
                pos = [_window_pos(o[d], k[d], s[d], dil[d], kern[d], pb[d]) for d in range(n_sp)]
                v = x_at(x, ni, ch, pos)
                cond = _window_guard(pos, [0] * n_sp, list(ins), may_low, may_high)
                if cond is not None:
                    v = if_then_else(cond, v, Const(0, dt))
                return v * weight_at(w, oci, ic, k)
            acc = reduce((icg, *kern), body, "sum")
            v = acc + bias[0][oci] if bias else acc
            return finish(v) if finish is not None else v
        return self._output((n, oc) + out, f, out_dt or dt)

    def local_attrs(self, inputs, output_shapes):
        """On channel shards the group count is the local channels over channels per group."""
        attrs = super().local_attrs(inputs, output_shapes)
        if self.attrs.get("group", 1) != 1:
            attrs["group"] = inputs[0].shape[1] // inputs[1].shape[1]
        return attrs

    def numpy(self, x, w, *bias):
        blocked_in, blocked_out = self.attrs.get("blocked_in"), self.attrs.get("blocked_out")
        out = self.outputs[0].shape[2:-1] if blocked_out else self.outputs[0].shape[2:]
        y = self._numpy(unblock_channels(x) if blocked_in else x, w, bias, out)
        return [block_channels(y) if blocked_out else y]

    def _numpy(self, x, w, bias, out) -> np.ndarray:
        """The conv of ``x [N, C, *in]`` by ``w`` (+ ``bias``) with the output's spatial extents ``out``."""
        n_sp = x.ndim - 2
        g = self.attrs.get("group", 1)
        s, dil, pb, pe = _spatial(self, x, n_sp)
        kern = w.shape[2:]
        cols = _windows(_pad_for(x, kern, s, dil, pb, out, 0), kern, s, dil, out)
        n, c = x.shape[:2]
        oc, icg = w.shape[:2]
        p, kp = math.prod(out), math.prod(kern)
        # (N, G, ICG, *out, *k) -> (N, G, P, ICG * K)
        cols = cols.reshape((n, g, icg) + out + kern)
        cols = cols.transpose((0, 1) + tuple(range(3, 3 + n_sp)) + (2,) + tuple(range(3 + n_sp, 3 + 2 * n_sp)))
        cols = cols.reshape(n, g, p, icg * kp)
        wm = w.reshape(g, oc // g, icg * kp).transpose(0, 2, 1)
        y = np.matmul(cols, wm)  # (N, G, P, OCG)
        y = y.transpose(0, 1, 3, 2).reshape((n, oc) + out)
        if bias:
            y = y + bias[0].reshape((oc,) + (1,) * n_sp)
        return np.ascontiguousarray(y, dtype=x.dtype)


class PackedConv(Conv):
    """A :class:`Conv` (one group) whose constant weight is stored as the GEMM's packed panels: the
    form the cpu target gives a 1x1 conv on small images, and a wider window with long products at
    horizontal stride 2 or (3x3) on small images (``passes/prepack.py``), computed as
    ``y^T[P, OC] = im2col(x)^T[P, K] @ W^T[K, OC]`` with the output pixels as the GEMM's rows (the wider
    windows and the 1x1 expansions, on an AVX-512 host, from the image blocked by 16 channels, the output
    channels as vector lanes: rfcs/0002).

    Inputs ``x [N, C, *in]``, ``wp [ceil(OC / PANEL), K, PANEL]`` =
    :func:`~shardflow.compiler.ops.linalg.pack_panels` of ``w.reshape(OC, K).T`` with
    ``K = C * prod(kernel)`` (``w[oc, c, *k]`` at ``[oc // PANEL, c * prod(kernel) + flat(k), oc % PANEL]``),
    optional ``bias [OC]``. Attributes: Conv's, ``oc`` and ``kernel``. With ``group`` > 1, ``C`` above is
    a group's channels and each group's ``OC / group`` outputs are whole panels (a grouped conv between
    blocked tensors, ``passes/layout.py``).
    """

    def _weight_shape(self, x, wp) -> tuple[int, ...]:
        from .linalg import PANEL

        oc, kern = int(self.attrs["oc"]), tuple(int(k) for k in self.attrs["kernel"])
        group = int(self.attrs.get("group", 1))
        xs = self._x_shape(x)
        c = xs[1] // group if len(xs) >= 3 and group >= 1 and xs[1] % group == 0 else -1
        # groups: each group's output channels whole panels (a panel's columns read one group's K rows)
        if len(kern) != len(xs) - 2 or (group > 1 and (oc % group or (oc // group) % PANEL)) \
                or tuple(wp.shape) != (-(-oc // PANEL), c * math.prod(kern), PANEL):
            raise ShapeError(f"{self.name}: PackedConv takes x [N, C, spatial...] and panels [ceil(OC/{PANEL}), "
                             f"C/group * prod(kernel), {PANEL}] (with groups, OC/group a multiple of {PANEL}), got "
                             f"{x.shape} and {wp.shape} with oc={oc}, group={group}, kernel={kern}")
        return (oc, c) + kern

    def _weight_at(self, wp, oc, ic, k):
        from .linalg import PANEL

        kern = tuple(int(v) for v in self.attrs["kernel"])
        flat = ic
        for kk, n in zip(k, kern):
            flat = flat * n + kk
        return wp[oc // PANEL, flat, oc % PANEL]

    def weight(self, wp: np.ndarray) -> np.ndarray:
        """The conv weight ``[OC, C, *kernel]`` the panels hold."""
        oc, kern = int(self.attrs["oc"]), tuple(int(k) for k in self.attrs["kernel"])
        k = wp.shape[1]
        return np.ascontiguousarray(wp.transpose(1, 0, 2).reshape(k, -1)[:, :oc].T).reshape(
            (oc, k // math.prod(kern)) + kern)

    def numpy(self, x, wp, *bias):
        return super().numpy(x, self.weight(wp), *bias)


#: An integer conv runs the integer GEMM (:class:`PackedConvInteger`) from this many products per output
#: (``C/group * prod(kernel)``, one AMX tile deep) on: below it (depthwise and other thin groups) the GEMM's
#: panels, padded to 64 along K, cost more than the products (a QDQ MobileNetV2, 2 AVX-512/AMX cores: all
#: its convs on it 31.3 ms, from 32 products on 8.8, from 64 on 7.4, all float 7.7; rfcs/0002, "Integer
#: convolutions").
INT8_CONV_MIN_K = 64


def int8_conv_rows(oc: int, group: int) -> int:
    """Rows of a weight packed by :func:`pack_int8_conv`: ``oc`` rounded up to whole AMX tiles of 16,
    and 16 more with groups (each group's tiles read up to 15 rows past its own)."""
    return -(-oc // 16) * 16 + (16 if group > 1 else 0)


def pack_int8_conv(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """An integer conv weight ``w [OC, C/group, *kernel]`` (int32 values, each output channel's within
    a range of 255: int8/uint8 minus a zero point) as :class:`PackedConvInteger` reads it, ``(wa, wc)``:
    ``wa`` (uint8) ``[R, Kp]`` (:func:`int8_conv_rows` rows, ``Kp``: ``K = C/group * prod(kernel)``
    rounded up to :data:`~shardflow.compiler.ops.linalg.INT8_KSTEP`) holds ``a' = w - min`` of each output
    channel's ``K`` taps (zero past them), ``wc`` (int32) ``[2, R]`` row 0 the zero point ``z = -min`` (so
    ``w = a' - z``), row 1 the sums of ``a'``: the integer GEMM's prepared rows (``cpu_library/conv_int8.h``)."""
    from .linalg import INT8_KSTEP

    oc = w.shape[0]
    flat = np.asarray(w).reshape(oc, -1).astype(np.int64)
    k = flat.shape[1]
    lo = flat.min(axis=1) if k else np.zeros(oc, np.int64)
    if k and np.any(flat.max(axis=1) - lo > 255):
        raise ShapeError("pack_int8_conv: an output channel's weights span more than 255 (not bytes minus a "
                         "zero point)")
    rows, kp = int8_conv_rows(oc, group), -(-k // INT8_KSTEP) * INT8_KSTEP
    wa = np.zeros((rows, kp), np.uint8)
    wa[:oc, :k] = flat - lo[:, None]
    wc = np.zeros((2, rows), np.int32)
    wc[0, :oc] = -lo
    wc[1] = wa.sum(axis=1, dtype=np.int64).astype(np.int32)
    return wa, wc


class PackedConvInteger(Conv):
    """An integer :class:`Conv` (``ConvInteger``: int32 sums of ``(x - x_zero_point) * (w - w_zero_point)``)
    of an int8/uint8 image with a constant weight packed by :func:`pack_int8_conv`: the form the cpu target
    gives it (``passes/prepack.py``), computed per image and group as the integer GEMM of the weight's rows
    by the image's im2col matrix, which comes out in the output's layout.

    Inputs ``x [N, C, *in]`` (int8 or uint8), ``wa``, ``wc`` and optionally ``x_zero_point`` (``x``'s dtype,
    one value); taps in the padding read the zero point (0 after the shift, as ONNX pads ConvInteger).
    Attributes: Conv's (1 or 2 spatial dims), ``oc`` and ``kernel``. The output is int32, wrapping around.
    """

    def _weight_shape(self, x, wa) -> tuple[int, ...]:
        from .linalg import INT8_KSTEP

        oc, kern, g = int(self.attrs["oc"]), tuple(int(k) for k in self.attrs["kernel"]), self.attrs.get("group", 1)
        xs = tuple(x.shape)
        c = xs[1] if len(xs) >= 3 else -1
        k = (c // g if g >= 1 else -1) * math.prod(kern)
        if x.dtype not in ("int8", "uint8") or len(kern) != len(xs) - 2 or len(kern) not in (1, 2) \
                or tuple(wa.shape) != (int8_conv_rows(oc, g), -(-k // INT8_KSTEP) * INT8_KSTEP):
            raise ShapeError(f"{self.name}: PackedConvInteger takes x [N, C, spatial...] (int8/uint8, 1 or 2 "
                             f"spatial dims) and rows [{int8_conv_rows(oc, g)}, C/group * prod(kernel) rounded up to "
                             f"{INT8_KSTEP}], got {x.dtype} {xs} and {tuple(wa.shape)} with oc={oc}, kernel={kern}")
        return (oc, c // g) + kern

    def compute(self, x, wa, wc, *xzp):
        kern = tuple(int(v) for v in self.attrs["kernel"])
        zx = Cast(xzp[0][(0,) * xzp[0].ndim], "int32") if xzp else None

        def x_at(x, n, ch, pos):
            v = Cast(x[(n, ch, *pos)], "int32")
            return v - zx if zx is not None else v

        def weight_at(wa, oc, ic, k):
            flat = ic
            for kk, n in zip(k, kern):
                flat = flat * n + kk
            return Cast(wa[oc, flat], "int32") - wc[0, oc]
        return self._conv_compute(x, wa, (), "int32", x_at, weight_at)

    def local_attrs(self, inputs, output_shapes):
        """The rank's own op (the pass runs on a rank's graph): its attributes as they are."""
        return Operator.local_attrs(self, inputs, output_shapes)

    def weight(self, wa: np.ndarray, wc: np.ndarray, c: int) -> np.ndarray:
        """The integer weight ``w - w_zero_point`` (int64 ``[OC, c / group, *kernel]``) the rows hold."""
        oc, kern, g = int(self.attrs["oc"]), tuple(int(k) for k in self.attrs["kernel"]), self.attrs.get("group", 1)
        k = c // g * math.prod(kern)
        w = wa[:oc, :k].astype(np.int64) - wc[0, :oc, None].astype(np.int64)
        return w.reshape((oc, c // g) + kern)

    def numpy(self, x, wa, wc, *xzp):
        zx = np.int64(np.asarray(xzp[0]).reshape(-1)[0]) if xzp else np.int64(0)
        xs = x.astype(np.int64) - zx
        y = self._numpy(xs, self.weight(wa, wc, x.shape[1]), (), self.outputs[0].shape[2:])
        return [y.astype(np.int32)]


def pack_bf16_conv(w: np.ndarray, group: int) -> np.ndarray:
    """A conv weight ``w [OC, C/group, *kernel]`` of bfloat16 values (bfloat16, or float32 holding them) as
    :class:`PackedConvBf16` reads it: bfloat16 rows ``[R, Kp]`` (:func:`int8_conv_rows` rows: whole AMX
    tiles; ``Kp``: ``K = C/group * prod(kernel)`` rounded up to
    :data:`~shardflow.compiler.ops.linalg.BF16_KSTEP`), each output channel's taps, zeros after."""
    from .linalg import BF16_KSTEP

    oc = w.shape[0]
    flat = np.asarray(w).reshape(oc, -1)
    k = flat.shape[1]
    rows = np.zeros((int8_conv_rows(oc, group), -(-k // BF16_KSTEP) * BF16_KSTEP), numpy_type("bfloat16"))
    rows[:oc, :k] = flat.astype(numpy_type("bfloat16"))
    return rows


class PackedConvBf16(Conv):
    """A float32 :class:`Conv` of bfloat16 values (a bfloat16 image widened, a weight holding bfloat16 values):
    the form the cpu target gives it (``passes/prepack.py``), reading the bfloat16 image itself and the
    weight as bfloat16 rows ``[OC, C/group * prod(kernel)]``, computed per image and group as the bfloat16
    GEMM of those rows by the image's im2col matrix (each product exact in float32, float32 sums).

    Inputs ``x [N, C, *in]`` (bfloat16), ``w`` (bfloat16 rows, :func:`pack_bf16_conv`), optional ``bias [OC]``
    (float32). Attributes: Conv's (1 or 2 spatial dims), ``oc`` and ``kernel``; ``lo`` and ``hi`` (the sums plus
    the bias clamped to them, as Clip does, a NaN kept; ``None``, the default: unbounded) and ``to`` (the
    output's type: ``"float32"``, the default, or ``"bfloat16"``, rounded to nearest even: what the next
    bfloat16 conv reads; ``passes/prepack.py`` folds a following Relu or Clip and cast so).
    """

    def _weight_shape(self, x, w) -> tuple[int, ...]:
        from .linalg import BF16_KSTEP

        oc, kern, g = int(self.attrs["oc"]), tuple(int(k) for k in self.attrs["kernel"]), self.attrs.get("group", 1)
        xs = tuple(x.shape)
        c = xs[1] if len(xs) >= 3 else -1
        k = (c // g if g >= 1 else -1) * math.prod(kern)
        if x.dtype != "bfloat16" or w.dtype != "bfloat16" or len(kern) != len(xs) - 2 or len(kern) not in (1, 2) \
                or tuple(w.shape) != (int8_conv_rows(oc, g), -(-k // BF16_KSTEP) * BF16_KSTEP):
            raise ShapeError(f"{self.name}: PackedConvBf16 takes x [N, C, spatial...] and rows "
                             f"[{int8_conv_rows(oc, g)}, C/group * prod(kernel) rounded up to {BF16_KSTEP}] (bfloat16, "
                             f"1 or 2 spatial dims), got "
                             f"{x.dtype} {xs} and {w.dtype} {tuple(w.shape)} with oc={oc}, kernel={kern}")
        return (oc, c // g) + kern

    def compute(self, x, w, *bias):
        kern = tuple(int(v) for v in self.attrs["kernel"])

        def x_at(x, n, ch, pos):
            return Cast(x[(n, ch, *pos)], "float32")

        def weight_at(w, oc, ic, k):
            flat = ic
            for kk, n in zip(k, kern):
                flat = flat * n + kk
            return Cast(w[oc, flat], "float32")

        lo, hi, to = self.attrs.get("lo"), self.attrs.get("hi"), self.attrs.get("to", "float32")

        def finish(v):
            if lo is not None:
                v = maximum(v, Const(float(lo), "float32"))
            if hi is not None:
                v = minimum(v, Const(float(hi), "float32"))
            return Cast(v, to) if to != "float32" else v
        return self._conv_compute(x, w, bias, "float32", x_at, weight_at, finish, to)

    def local_attrs(self, inputs, output_shapes):
        """The rank's own op (the pass runs on a rank's graph): its attributes as they are."""
        return Operator.local_attrs(self, inputs, output_shapes)

    def numpy(self, x, w, *bias):
        oc, kern, g = int(self.attrs["oc"]), tuple(int(k) for k in self.attrs["kernel"]), self.attrs.get("group", 1)
        k = x.shape[1] // g * math.prod(kern)
        wf = np.asarray(w[:oc, :k], np.float32).reshape((oc, -1) + kern)
        y = self._numpy(np.asarray(x, np.float32), wf, bias, self.outputs[0].shape[2:])
        lo, hi = self.attrs.get("lo"), self.attrs.get("hi")
        if lo is not None:
            y = np.maximum(y, np.float32(lo))
        if hi is not None:
            y = np.minimum(y, np.float32(hi))
        return [y.astype(numpy_type(self.attrs.get("to", "float32")))]


#: Winograd's minimal filtering F(m x m, 3 x 3) (Lavin and Gray, 2016) for m = 2 and 4: ``(B^T, G, A^T)``
#: with the interpolation points 0, 1, -1 (and 2, -2 for m = 4) and infinity. A 1-D output tile of m
#: values is ``A^T [(G g) * (B^T d)]`` for the m + 2 inputs ``d`` and the 3 taps ``g``.
WINOGRAD = {
    2: (np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64),
        np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], np.float64),
        np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)),
    4: (np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
                  [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], np.float64),
        np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
                  [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], np.float64),
        np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]], np.float64)),
}
#: A left inverse of each ``G`` (``L @ G = I``), sparse: the taps back from their transform.
_WINOGRAD_LEFT = {2: {0: {0: 1.0}, 1: {1: 1.0, 2: -1.0}, 2: {3: 1.0}},
                  4: {0: {0: 4.0}, 1: {1: -3.0, 2: 3.0}, 2: {5: 1.0}}}


def winograd_weights(w: np.ndarray, m: int) -> np.ndarray:
    """The input :class:`WinogradConv` reads for the 3x3 weights ``w [OC, C, 3, 3]``:
    ``[(m+2)^2, ceil(OC / PANEL), C, PANEL]``, position ``xi = a * (m+2) + b`` holding
    ``U[xi][c, oc] = (G w[oc, c] G^T)[a, b]`` as :func:`~shardflow.compiler.ops.linalg.pack_panels`
    of the ``[C, OC]`` matrix (summed in float64, rounded once to float32)."""
    from .linalg import pack_panels

    g = WINOGRAD[m][1]
    u = np.einsum("ak,ockl,bl->abco", g, np.asarray(w, np.float64), g).astype(np.float32)
    a = m + 2
    return np.stack([pack_panels(u[i, j]) for i in range(a) for j in range(a)])


class WinogradConv(Conv):
    """A 3x3 :class:`Conv` of stride 1, dilation 1 and one group computed by Winograd's minimal filtering
    ``F(m x m, 3 x 3)`` (:data:`WINOGRAD`): the form the cpu target gives such convs where it measured
    faster (``passes/prepack.py``). Each ``m x m`` output tile costs ``(m+2)^2`` products per channel pair
    instead of ``9 m^2``; the rounding differs from a direct sum (the transforms add and scale inputs
    and partial sums; measured on ResNet-50's shapes against a float64 reference: 5e-7 of the output's largest
    value for m = 2, 6e-6 to 7e-6 for m = 4, the direct conv 3.5e-7).

    Inputs ``x [N, C, H, W]``, ``u`` = :func:`winograd_weights` of ``w [OC, C, 3, 3]``, optional
    ``bias [OC]``. Attributes: Conv's ``pads`` (strides and dilations 1, group 1), ``oc`` and ``m`` (2 or 4).
    The compute definition reads the taps back from ``u`` (``G``'s left inverse).
    """

    def _weight_shape(self, x, u) -> tuple[int, ...]:
        from .linalg import PANEL

        oc, m = int(self.attrs["oc"]), int(self.attrs["m"])
        xs = self._x_shape(x)
        c = xs[1] if len(xs) == 4 else -1
        a = m + 2
        unit = tuple(self.attrs.get("strides") or ()) + tuple(self.attrs.get("dilations") or ())
        if m not in WINOGRAD or len(xs) != 4 or self.attrs.get("group", 1) != 1 or any(v != 1 for v in unit) \
                or tuple(u.shape) != (a * a, -(-oc // PANEL), c, PANEL):
            raise ShapeError(f"{self.name}: WinogradConv takes x [N, C, H, W] and u [(m+2)^2, ceil(OC/{PANEL}), C, "
                             f"{PANEL}] with m in {sorted(WINOGRAD)}, stride 1, dilation 1 and one group; got "
                             f"{x.shape} and {u.shape} with oc={oc}, m={m}, attrs {dict(self.attrs)}")
        return (oc, c, 3, 3)

    def _weight_at(self, u, oc, ic, k):
        from .linalg import PANEL

        m = int(self.attrs["m"])
        a, left = m + 2, _WINOGRAD_LEFT[m]
        kh, kw = k

        def tap(r, s):  # w[oc, ic, r, s] = sum_ab L[r, a] L[s, b] u[a, b]
            res = None
            for i, li in left[r].items():
                for j, lj in left[s].items():
                    term = u[i * a + j, oc // PANEL, ic, oc % PANEL]
                    term = term if li * lj == 1 else term * Const(li * lj, u.dtype)
                    res = term if res is None else res + term
            return res

        def row(r):
            return if_then_else(eq(kw, 0), tap(r, 0), if_then_else(eq(kw, 1), tap(r, 1), tap(r, 2)))
        return if_then_else(eq(kh, 0), row(0), if_then_else(eq(kh, 1), row(1), row(2)))

    def weight(self, u: np.ndarray) -> np.ndarray:
        """The 3x3 weights ``[OC, C, 3, 3]`` that ``u`` is the transform of (exact up to rounding)."""
        m, oc = int(self.attrs["m"]), int(self.attrs["oc"])
        a = m + 2
        lm = np.zeros((3, a))
        for r, row in _WINOGRAD_LEFT[m].items():
            for i, v in row.items():
                lm[r, i] = v
        full = u.astype(np.float64).transpose(0, 2, 1, 3).reshape(a, a, u.shape[2], -1)[..., :oc]  # [a, b, C, OC]
        return np.einsum("ka,abco,lb->ockl", lm, full, lm).astype(np.float32)

    def numpy(self, x, u, *bias):
        return super().numpy(x, self.weight(u), *bias)


class ConvTranspose(Operator):
    """N-D transposed convolution (the gradient of :class:`Conv` with respect to its input).

    ``y[n, oc, o] = bias[oc] + sum_{ic, k} x[n, g*ICG + ic, i] * w[g*ICG + ic, oc % OCG, k]`` over the
    ``(ic, k)`` with ``i * s + k * d - pb = o``. Inputs ``x [N, C, *in]``, ``w [C, OC/group, *k]``,
    optional ``bias``; attributes ``group``, ``strides``, ``dilations``, ``pads`` and
    ``output_shape`` (the spatial output extents, already resolved from ``output_padding``).

    Where the windows do not overlap and cover the output exactly (kernel = stride, dilation 1, no
    padding, each output extent its input's times the stride: a UNet's or SAM's 2x2 upsampling),
    the one tap of output ``o`` is ``o % s`` of input ``o // s``: the compute says so (a sum over
    the input channels alone), which the cuda target computes as one product, its rows the input
    pixels and its columns the output channels and taps (rfcs/0005 decision 65). Where the windows
    overlap but every kernel extent is a multiple of its stride (DCGAN's 4x4 at stride 2), output
    ``o`` reads ``kernel / s`` taps a dim of phase ``(o % s + p) % s``: the compute sums those alone,
    a product per phase (decision 69).
    """

    #: as :attr:`Conv.splits_by_blocks`
    splits_by_blocks: ClassVar[bool] = True

    def compute(self, x, w, *bias):
        n_sp = x.ndim - 2
        if n_sp < 1 or w.ndim != x.ndim:
            raise ShapeError(f"{self.name}: ConvTranspose takes x [N, C, spatial...] and w of the same rank, got "
                             f"{x.shape} and {w.shape}")
        g = self.attrs.get("group", 1)
        s, dil, pb, _ = _spatial(self, x, n_sp)
        n, c = x.shape[:2]
        if g < 1 or w.shape[0] != c or c % g:
            raise ShapeError(f"{self.name}: x has {c} channels and w has shape {w.shape}; with group={g} w must be "
                             f"[C, M/group, ...] with C divisible by group")
        icg, ocg = c // g, w.shape[1]
        oc = ocg * g
        kern, ins = w.shape[2:], x.shape[2:]
        out = tuple(self.attrs["output_shape"])
        if len(out) != n_sp or min(out, default=1) < 1:
            raise ShapeError(f"{self.name}: output_shape {out} does not match {n_sp} spatial dims")
        if bias and bias[0].shape != (oc,):
            raise ShapeError(f"{self.name}: bias has shape {bias[0].shape}, expected ({oc},)")
        dt = x.dtype
        tiled = _tiles(kern, s, dil, pb, ins, out)
        # strided, each kernel extent a multiple of its stride: output o's taps are k = s * t + (o % s
        # + p) % s of inputs i = o // s + (o % s + p) // s - t, for t < kernel / s (decision 69)
        phased = not tiled and max(s) > 1 and all(dil[d] == 1 and kern[d] % s[d] == 0 for d in range(n_sp))

        def f(ni, oci, *o):
            # input channel ic of output channel oci's group, and oci's index in its group; written without
            # a division or remainder by 1 (a depthwise one's channels then split as a depthwise Conv's do)
            def chan(ic):
                if g == 1:
                    return ic
                if icg == 1:
                    return oci if ocg == 1 else oci // ocg
                return (oci // ocg) * icg + ic
            wo = oci if g == 1 else (0 if ocg == 1 else oci % ocg)

            def tap(ic):  # (non-overlapping windows: output o reads input o // s at tap o % s)
                ch = chan(ic)
                return x[(ni, ch, *(o[d] // s[d] if s[d] > 1 else o[d] for d in range(n_sp)))] \
                    * w[(ch, wo, *(o[d] % s[d] if s[d] > 1 else 0 for d in range(n_sp)))]

            def phase(ic, *t):
                ch = chan(ic)
                conds, idx, taps = [], [], []
                for d in range(n_sp):
                    sd, p, nt = s[d], pb[d], kern[d] // s[d]
                    if sd == 1:
                        i, k = affine_expr([(o[d], 1), (t[d], -1)], p), t[d]
                        lo, hi = p - (nt - 1), out[d] - 1 + p
                    else:
                        r = o[d] % sd
                        i = affine_expr([(o[d] // sd, 1), ((r + p) // sd, 1), (t[d], -1)])
                        k = affine_expr([(t[d], sd), ((r + p) % sd, 1)])
                        lo, hi = p // sd - (nt - 1), (out[d] - 1) // sd + (sd - 1 + p) // sd
                    if lo < 0:
                        conds.append(i >= 0)
                    if hi > ins[d] - 1:
                        conds.append(i < ins[d])
                    idx.append(i)
                    taps.append(k)
                v = x[(ni, ch, *idx)]
                v = v if not conds else if_then_else(_all(conds), v, Const(0, dt))
                return v * w[(ch, wo, *taps)]

            def body(ic, *k):
                ch = chan(ic)
                conds, idx = [], []
                for d in range(n_sp):
                    num = affine_expr([(o[d], 1), (k[d], -dil[d] if kern[d] > 1 else 0)], pb[d])
                    lo, hi = pb[d] - (kern[d] - 1) * dil[d], out[d] - 1 + pb[d]  # range of num
                    if s[d] == 1:
                        i = num
                    else:
                        i = num // s[d]
                        conds.append(eq(num % s[d], 0))
                    if lo < 0:
                        conds.append(num >= 0)
                    if hi > (ins[d] - 1) * s[d]:
                        conds.append(i < ins[d])
                    idx.append(i)
                v = x[(ni, ch, *idx)] * w[(ch, wo, *k)]
                return v if not conds else if_then_else(_all(conds), v, Const(0, dt))
            if tiled:
                acc = reduce((icg,), tap, "sum")
            elif phased:
                acc = reduce((icg, *(kern[d] // s[d] for d in range(n_sp))), phase, "sum")
            else:
                acc = reduce((icg, *kern), body, "sum")
            return acc + bias[0][oci] if bias else acc
        return compute("y", (n, oc) + out, f, dtype=dt)

    def tiles_output(self) -> bool:
        """Whether the windows do not overlap and cover the output exactly (the compute's one-tap
        form: kernel = stride, dilation 1, no padding before, each output extent the input's times
        the stride)."""
        x = self.inputs[0]
        s, dil, pb, _ = _spatial(self, x, x.ndim - 2)
        return _tiles(self.inputs[1].shape[2:], s, dil, pb, x.shape[2:], tuple(self.attrs["output_shape"]))

    def local_attrs(self, inputs, output_shapes):
        """On spatial shards (windows that do not overlap: each output shard reads its own input
        shard) ``output_shape`` is the shard's; on channel shards (whole groups) the group count is the
        local input channels over the input channels per group."""
        attrs = super().local_attrs(inputs, output_shapes)
        attrs["output_shape"] = tuple(output_shapes[0][2:])
        g = self.attrs.get("group", 1)
        if g != 1:
            attrs["group"] = inputs[0].shape[1] // (self.inputs[0].shape[1] // g)
        return attrs

    def numpy(self, x, w, *bias):
        n_sp = x.ndim - 2
        g = self.attrs.get("group", 1)
        s, dil, pb, _ = _spatial(self, x, n_sp)
        n, c = x.shape[:2]
        icg, ocg = c // g, w.shape[1]
        oc = ocg * g
        kern, ins = w.shape[2:], x.shape[2:]
        out = tuple(self.attrs["output_shape"])
        p, kp = math.prod(ins), math.prod(kern)
        # half values: products and the overlapping taps' sums in float32, rounded once (as Conv's
        # matmul does and the kernels do; summed in the half type, each tap's add would round)
        xm = x.reshape(n, g, icg, p).transpose(0, 1, 3, 2).astype(sum_type(x.dtype))  # (N, G, P, ICG)
        wm = w.reshape(g, icg, ocg * kp).astype(sum_type(w.dtype))
        cols = np.matmul(xm, wm).reshape((n, g) + ins + (ocg,) + kern)  # (N, G, *in, OCG, *k)
        cols = np.moveaxis(cols, 2 + n_sp, 2)  # (N, G, OCG, *in, *k)
        full = tuple((ins[d] - 1) * s[d] + (kern[d] - 1) * dil[d] + 1 for d in range(n_sp))
        lo = [min(0, pb[d]) for d in range(n_sp)]
        hi = [max(full[d], pb[d] + out[d]) for d in range(n_sp)]
        buf = np.zeros((n, g, ocg) + tuple(h - a for a, h in zip(lo, hi)), dtype=cols.dtype)
        for kk in product(*(range(k) for k in kern)):
            dst = tuple(slice(kk[d] * dil[d] - lo[d], kk[d] * dil[d] - lo[d] + (ins[d] - 1) * s[d] + 1, s[d])
                        for d in range(n_sp))
            buf[(slice(None),) * 3 + dst] += cols[(Ellipsis,) + kk]
        y = buf[(slice(None),) * 3 + tuple(slice(pb[d] - lo[d], pb[d] - lo[d] + out[d]) for d in range(n_sp))]
        y = y.reshape((n, oc) + out).astype(x.dtype)
        if bias:
            y = y + bias[0].reshape((oc,) + (1,) * n_sp)
        return [np.ascontiguousarray(y, dtype=x.dtype)]


class Pool(Operator):
    """Windowed pooling over the spatial dims: ``kind`` is ``max``, ``avg`` or ``lp``.

    Attributes: ``kernel``, ``strides``, ``dilations``, ``pads``, ``ceil_mode``;
    ``count_include_pad`` (avg: divide by the taps inside the padded input instead of the real
    one); ``p`` (lp: ``(sum |x|^p)^(1/p)``, padding counts as 0); ``with_indices`` (max: a second
    int64 output with the flat input index of each maximum, row-major or, with
    ``storage_order=1``, column-major over the spatial dims).
    """

    def compute(self, x):
        kind = self.attrs["kind"]
        kern = tuple(self.attrs["kernel"])
        n_sp = len(kern)
        if x.ndim != n_sp + 2:
            raise ShapeError(f"{self.name}: a {n_sp}-D kernel needs an input of rank {n_sp + 2}, got {x.shape}")
        s, dil, pb, pe = _spatial(self, x, n_sp)
        ins = x.shape[2:]
        out = self._out_shape(ins)
        if min(out, default=1) < 1 or min(kern) < 1:
            raise ShapeError(f"{self.name}: the kernel {kern} (dilations {dil}) does not fit the padded input {ins}")
        last = [(out[d] - 1) * s[d] + (kern[d] - 1) * dil[d] - pb[d] for d in range(n_sp)]  # largest position
        dt = x.dtype

        def taps(o, k, lo=(0,) * n_sp, hi=ins):
            """Positions read by window ``o`` at tap ``k`` and the guard ``lo <= pos < hi`` (None if always true)."""
            pos = [_window_pos(o[d], k[d], s[d], dil[d], kern[d], pb[d]) for d in range(n_sp)]
            return pos, _window_guard(pos, list(lo), list(hi), [-pb[d] < lo[d] for d in range(n_sp)],
                                      [last[d] > hi[d] - 1 for d in range(n_sp)])

        def guarded(ni, ci, o, k, fill):
            pos, inside = taps(o, k)
            v = x[(ni, ci, *pos)]
            return v if inside is None else if_then_else(inside, v, fill)

        # avg divides by the taps inside the input, or with count_include_pad inside the padded input
        cnt_lo, cnt_hi = (([-p for p in pb], [ins[d] + pe[d] for d in range(n_sp)])
                          if self.attrs.get("count_include_pad", False) else ([0] * n_sp, list(ins)))
        cnt_const = all(-pb[d] >= cnt_lo[d] and last[d] <= cnt_hi[d] - 1 for d in range(n_sp))

        def f(ni, ci, *o):
            if kind == "max":
                return reduce(kern, lambda *k: guarded(ni, ci, o, k, _lowest(dt)), "max")
            if kind == "lp":
                p = Const(self.attrs["p"], dt)
                total = reduce(kern, lambda *k: BinOp("pow", UnaryOp("abs", guarded(ni, ci, o, k, Const(0, dt))), p),
                               "sum")
                return BinOp("pow", total, Const(1.0 / self.attrs["p"], dt))
            total = reduce(kern, lambda *k: guarded(ni, ci, o, k, Const(0, dt)), "sum")
            if cnt_const:
                return total / Const(float(math.prod(kern)), dt)
            return total / reduce(kern, lambda *k: Cast(taps(o, k, cnt_lo, cnt_hi)[1], dt), "sum")
        y = compute("y", x.shape[:2] + out, f, dtype=dt)
        if not self.attrs.get("with_indices", False):
            return y
        if kind != "max":
            raise ShapeError(f"{self.name}: only max pooling has an indices output")
        return [y, compute("indices", x.shape[:2] + out, lambda ni, ci, *o: self._argmax(x, ni, ci, o, taps),
                           dtype="int64")]

    def _argmax(self, x, ni, ci, o, taps) -> Expr:
        kern = tuple(self.attrs["kernel"])
        n_sp, ins = len(kern), x.shape[2:]
        inner = [math.prod(kern[d + 1:]) for d in range(n_sp)]

        def split(kk):
            return [kk if n_sp == 1 else (kk // inner[d]) % kern[d] if d else kk // inner[0] for d in range(n_sp)]

        def body(kk):
            pos, inside = taps(o, split(kk))
            v = x[(ni, ci, *pos)]
            return v if inside is None else if_then_else(inside, v, _lowest(x.dtype))
        best = reduce((math.prod(kern),), body, "argmax")
        pos = taps(o, split(best))[0]
        col_major = self.attrs.get("storage_order", 0) == 1
        flat = (ni * x.shape[1] + ci) * math.prod(ins)
        for d in range(n_sp):
            stride = math.prod(ins[:d]) if col_major else math.prod(ins[d + 1:])
            flat = flat + pos[d] * stride
        return flat

    def local_attrs(self, inputs, output_shapes):
        """On a split of the window's taps the rank's window is its share of them. The sharding rules
        split the taps of a dilated window that reads its whole unpadded input in blocks (``pos = o +
        dil * k``, ``o < dil``: the input viewed as ``[kernel, dil]``); each rank reduces over its
        block of ``k`` on its block of the input, the output whole (a partial max or mean). An input
        dim shorter on the rank while the output's is whole is such a split: ``kernel`` shrinks by the
        same ratio (``localize`` checks the shapes it then gives)."""
        attrs = super().local_attrs(inputs, output_shapes)
        kern = list(attrs["kernel"])
        dims = zip(inputs[0].shape[2:], self.inputs[0].shape[2:], output_shapes[0][2:], self.outputs[0].shape[2:])
        for d, (local_in, whole_in, local_out, whole_out) in enumerate(dims):
            if local_in != whole_in and local_out == whole_out and kern[d] * local_in % whole_in == 0:
                kern[d] = kern[d] * local_in // whole_in
        attrs["kernel"] = tuple(kern)
        return attrs

    def _out_shape(self, ins) -> tuple[int, ...]:
        kern = tuple(self.attrs["kernel"])
        n_sp = len(kern)
        s, dil, pb, pe = _spatial(self, np.empty((1, 1) + tuple(ins)), n_sp)
        return tuple(pool_output_size(ins[d], kern[d], s[d], dil[d], pb[d], pe[d], self.attrs.get("ceil_mode", False))
                     for d in range(n_sp))

    def numpy(self, x):
        kind = self.attrs["kind"]
        kern = tuple(self.attrs["kernel"])
        n_sp = len(kern)
        s, dil, pb, pe = _spatial(self, x, n_sp)
        ins = x.shape[2:]
        out = self.outputs[0].shape[2:]
        axes = tuple(range(2 + n_sp, 2 + 2 * n_sp))
        if kind == "max":
            lowest = -np.inf if x.dtype.kind == "f" else (False if x.dtype.kind == "b" else np.iinfo(x.dtype).min)
            win = _windows(_pad_for(x, kern, s, dil, pb, out, lowest), kern, s, dil, out)
            y = win.max(axis=axes)
            if not self.attrs.get("with_indices", False):
                return [y]
            return [y, self._indices_np(win, x.shape, s, dil, pb)]
        xs = np.abs(x) ** x.dtype.type(self.attrs["p"]) if kind == "lp" else x
        total = _windows(_pad_for(xs, kern, s, dil, pb, out, 0), kern, s, dil, out).sum(axis=axes)
        if kind == "lp":
            return [np.asarray(total ** x.dtype.type(1.0 / self.attrs["p"]), x.dtype)]
        if self.attrs.get("count_include_pad", False):
            ones = np.ones((1, 1) + tuple(ins[d] + pb[d] + pe[d] for d in range(n_sp)), x.dtype)
            cnt = _windows(_pad_for(ones, kern, s, dil, [0] * n_sp, out, 0), kern, s, dil, out)
        else:
            ones = np.ones((1, 1) + ins, x.dtype)
            cnt = _windows(_pad_for(ones, kern, s, dil, pb, out, 0), kern, s, dil, out)
        return [np.asarray(total / cnt.sum(axis=axes), x.dtype)]

    def _indices_np(self, win, xshape, s, dil, pb) -> np.ndarray:
        n_sp = len(s)
        ins, out, kern = xshape[2:], win.shape[2:2 + n_sp], win.shape[2 + n_sp:]
        best = win.reshape(win.shape[:2 + n_sp] + (-1,)).argmax(axis=-1)
        ks = np.unravel_index(best, kern)
        col_major = self.attrs.get("storage_order", 0) == 1
        flat = (np.arange(xshape[0]).reshape((-1,) + (1,) * (n_sp + 1)) * xshape[1]
                + np.arange(xshape[1]).reshape((1, -1) + (1,) * n_sp)) * math.prod(ins)
        for d in range(n_sp):
            o = np.arange(out[d]).reshape((1, 1) + tuple(-1 if e == d else 1 for e in range(n_sp)))
            pos = o * s[d] + ks[d] * dil[d] - pb[d]
            flat = flat + pos * (math.prod(ins[:d]) if col_major else math.prod(ins[d + 1:]))
        return flat.astype(np.int64)


class GlobalPool(Operator):
    """Pooling over all spatial dims, which are kept with extent 1: ``kind`` is ``avg``, ``max`` or
    ``lp`` (with ``p``)."""

    def compute(self, x):
        if x.ndim < 3:
            raise ShapeError(f"{self.name}: global pooling needs an input [N, C, spatial...], got {x.shape}")
        kind, sp, dt = self.attrs["kind"], x.shape[2:], x.dtype

        def f(ni, ci, *_):
            if kind == "lp":
                p = Const(self.attrs["p"], dt)
                total = reduce(sp, lambda *k: BinOp("pow", UnaryOp("abs", x[(ni, ci, *k)]), p), "sum")
                return BinOp("pow", total, Const(1.0 / self.attrs["p"], dt))
            return reduce(sp, lambda *k: x[(ni, ci, *k)], "mean" if kind == "avg" else "max")
        return compute("y", x.shape[:2] + (1,) * len(sp), f, dtype=dt)

    def numpy(self, x):
        kind, axes = self.attrs["kind"], tuple(range(2, x.ndim))
        if kind == "avg":
            return [np.asarray(x.mean(axis=axes, keepdims=True), x.dtype)]
        if kind == "max":
            return [x.max(axis=axes, keepdims=True)]
        p = x.dtype.type(self.attrs["p"])
        return [np.asarray((np.abs(x) ** p).sum(axis=axes, keepdims=True) ** x.dtype.type(1.0 / self.attrs["p"]),
                           x.dtype)]


# Resize ----------------------------------------------------------------------------------------

_F64 = "float64"


def _f(v: float) -> Const:
    return Const(float(v), _F64)


def _source_coord(mode: str, i: Expr, scale: float, size_in: int, size_out: int, roi: tuple[float, float]):
    """The input coordinate (float64) that output index ``i`` maps to, as in the ONNX reference."""
    y = Cast(i, _F64)
    width = scale * size_in  # the (fractional) output width the scale implies
    if mode == "align_corners":
        return _f(0.0) if width == 1 else y * _f(size_in - 1) / _f(width - 1)
    if mode == "asymmetric":
        return y / _f(scale)
    if mode == "pytorch_half_pixel":
        return _f(-0.5) if width == 1 else (y + _f(0.5)) / _f(scale) - _f(0.5)
    if mode == "half_pixel":
        return (y + _f(0.5)) / _f(scale) - _f(0.5)
    if mode == "tf_half_pixel_for_nn":
        return (y + _f(0.5)) / _f(scale)
    if mode == "half_pixel_symmetric":
        offset = size_in / 2 * (1 - size_out / width)
        return _f(offset) + (y + _f(0.5)) / _f(scale) - _f(0.5)
    if mode == "tf_crop_and_resize":
        r0, r1 = roi
        if width == 1:
            return _f((r1 - r0) * (size_in - 1) / 2 + r0 * (size_in - 1))
        return y * _f(r1 - r0) * _f(size_in - 1) / _f(width - 1) + _f(r0 * (size_in - 1))
    raise ValueError(f"unknown coordinate_transformation_mode {mode!r}")


def _source_coord_np(mode: str, scale: float, size_in: int, size_out: int, roi) -> np.ndarray:
    y = np.arange(size_out, dtype=np.float64)
    width = scale * size_in
    if mode == "align_corners":
        return np.zeros(size_out) if width == 1 else y * float(size_in - 1) / float(width - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "pytorch_half_pixel":
        return np.full(size_out, -0.5) if width == 1 else (y + 0.5) / scale - 0.5
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale
    if mode == "half_pixel_symmetric":
        return size_in / 2 * (1 - size_out / width) + (y + 0.5) / scale - 0.5
    r0, r1 = roi
    if width == 1:
        return np.full(size_out, (r1 - r0) * (size_in - 1) / 2 + r0 * (size_in - 1))
    return y * float(r1 - r0) * float(size_in - 1) / float(width - 1) + r0 * (size_in - 1)


class _ExprOps:
    """Scalar helpers for building tap weights as expressions (see :func:`_taps`)."""

    const = staticmethod(_f)
    abs = staticmethod(lambda e: UnaryOp("abs", e))
    where = staticmethod(if_then_else)
    both = staticmethod(logical_and)


class _NumpyOps:
    """The same helpers on float64 numpy arrays."""

    const = staticmethod(float)
    abs = staticmethod(np.abs)
    where = staticmethod(np.where)
    both = staticmethod(np.logical_and)


def _cubic_weights(t, a: float, ops):
    """The 4 cubic-convolution weights of taps ``floor - 1 .. floor + 2`` at fraction ``t``."""
    A, one = ops.const(a), ops.const(1.0)

    def far(z):  # |z| in [1, 2]
        return ((A * z - ops.const(5 * a)) * z + ops.const(8 * a)) * z - ops.const(4 * a)

    def near(z):  # |z| in [0, 1]
        return (ops.const(a + 2) * z - ops.const(a + 3)) * z * z + one
    return [far(t + one), near(t), near(one - t), far(one - t + one)]


def _taps(attrs: dict, scale: float, t, base, size: int, ops):
    """Offsets (from ``floor(x)``) and weights of the taps interpolating one axis at fraction ``t``.

    Antialiased downsampling (``scale < 1``) widens the linear (tent) or cubic kernel by
    ``1 / scale`` and normalizes its weights, as the ONNX reference does.
    """
    mode, a = attrs["mode"], attrs.get("cubic_coeff_a", -0.75)
    one = ops.const(1.0)
    if attrs.get("antialias", False) and scale < 1:
        start = math.floor((-1 if mode == "linear" else -2) / scale) + 1
        offs = list(range(start, 2 - start))
        args = [(ops.const(o) - t) * ops.const(scale) for o in offs]
        if mode == "linear":
            ws = [ops.where(ops.abs(z) < one, one - ops.abs(z), ops.const(0.0)) for z in args]
        else:
            def kernel(z):
                x = ops.abs(z)
                x2 = x * x
                x3 = x * x2
                inner = ops.const(a + 2) * x3 - ops.const(a + 3) * x2 + one
                outer = ops.const(a) * x3 - ops.const(5 * a) * x2 + ops.const(8 * a) * x - ops.const(4 * a)
                return ops.where(x <= one, inner, ops.where(x < ops.const(2.0), outer, ops.const(0.0)))
            ws = [kernel(z) for z in args]
        total = ws[0]
        for w_ in ws[1:]:
            total = total + w_
        ws = [w_ / total for w_ in ws]
    elif mode == "linear":
        offs, ws = [0, 1], [one - t, t]
    else:
        offs, ws = [-1, 0, 1, 2], _cubic_weights(t, a, ops)
    if mode == "cubic" and attrs.get("exclude_outside", False):
        ws = [ops.where(ops.both(base + o >= 0, base + o < size), w_, ops.const(0.0)) for o, w_ in zip(offs, ws)]
        total = ws[0]
        for w_ in ws[1:]:
            total = total + w_
        ws = [w_ / total for w_ in ws]
    return offs, ws


class Resize(Operator):
    """Resize by interpolation (``mode`` nearest / linear / cubic) to ``sizes`` (every dim).

    ``scales`` (every dim) and ``coordinate_transformation_mode`` map each output index to an input
    coordinate as in the ONNX reference; ``nearest_mode`` rounds it for ``nearest``;
    ``cubic_coeff_a`` and ``exclude_outside`` shape the cubic kernel; ``antialias`` widens the
    linear/cubic kernel on downsampled dims; ``roi`` and ``extrapolation_value`` serve
    ``tf_crop_and_resize``. Dims whose size and scale are unchanged (and whose roi is the full
    range) are copied. Interpolation is computed in float64.
    """

    def _axes(self, in_shape):
        """Per dim: ``(copied unchanged, scale, (roi start, roi end))``."""
        sizes, scales = tuple(self.attrs["sizes"]), tuple(self.attrs["scales"])
        roi = self.attrs.get("roi")
        r = len(in_shape)
        if len(sizes) != r or len(scales) != r or (roi is not None and len(roi) != 2 * r):
            raise ShapeError(f"{self.name}: sizes {sizes}, scales {scales} and roi {roi} must give every dim of "
                             f"the input {in_shape}")
        if min(sizes, default=1) < 1 or min(scales, default=1) <= 0:
            raise ShapeError(f"{self.name}: sizes {sizes} and scales {scales} must be positive")
        res = []
        for d in range(r):
            rd = (0.0, 1.0) if roi is None else (float(roi[d]), float(roi[d + r]))
            copy = sizes[d] == in_shape[d] and math.isclose(scales[d], 1.0) and (
                self.attrs["coordinate_transformation_mode"] != "tf_crop_and_resize"
                or (math.isclose(rd[0], 0.0) and math.isclose(rd[1], 1.0)))
            res.append((copy, float(scales[d]), rd))
        return res

    def compute(self, x):
        mode, ctm = self.attrs["mode"], self.attrs["coordinate_transformation_mode"]
        dt, sizes = x.dtype, tuple(self.attrs["sizes"])
        axes = self._axes(x.shape)
        if mode != "nearest" and dtype_kind(dt) != "f":
            raise ShapeError(f"{self.name}: {mode} interpolation needs a floating-point input, got {dt}")

        def f(*i):
            taps, outside = [], None
            for d, (copy, scale, rd) in enumerate(axes):
                if copy:
                    taps.append([(i[d], None)])
                    continue
                n = x.shape[d]
                xo = _source_coord(ctm, i[d], scale, n, sizes[d], rd)
                if ctm == "tf_crop_and_resize":
                    out_d = (xo < _f(0)) | (xo > _f(n - 1))
                    outside = out_d if outside is None else outside | out_d
                fl = UnaryOp("floor", xo)
                t = xo - fl
                base = Cast(fl, "int64")
                clamp = lambda e: minimum(maximum(e, 0), n - 1)  # noqa: E731
                if mode == "nearest":
                    up = {"round_prefer_floor": t > _f(0.5), "round_prefer_ceil": t >= _f(0.5),
                          "floor": None, "ceil": t > _f(0.0)}[self.attrs.get("nearest_mode", "round_prefer_floor")]
                    taps.append([(clamp(base if up is None else if_then_else(up, base + 1, base)), None)])
                else:
                    offs, ws = _taps(self.attrs, scale, t, base, n, _ExprOps)
                    taps.append([(clamp(base + o if o else base), w_) for o, w_ in zip(offs, ws)])
            if mode == "nearest":
                val = x[tuple(t[0][0] for t in taps)]
            else:
                val = None
                for combo in product(*taps):
                    term = Cast(x[tuple(c[0] for c in combo)], _F64)
                    for _, w_ in combo:
                        if w_ is not None:
                            term = term * w_
                    val = term if val is None else val + term
                val = Cast(val, dt)
            if outside is not None:
                val = if_then_else(outside, Const(self.attrs.get("extrapolation_value", 0.0), dt), val)
            return val
        return compute("y", sizes, f, dtype=dt)

    def axis_taps(self, in_shape) -> list:
        """Per dim of the input: ``None`` where the dim is copied, else ``(index, weight, outside)``:
        ``index[o, t]`` (int64, clamped into the input) and ``weight[o, t]`` (float64) are the taps
        that interpolate output index ``o`` (one tap of weight 1 for ``nearest``), and ``outside[o]``
        (bool, ``tf_crop_and_resize`` only, else ``None``) marks outputs that take
        ``extrapolation_value``. What :meth:`numpy` computes with, and the cpu template's tables."""
        mode, ctm = self.attrs["mode"], self.attrs["coordinate_transformation_mode"]
        sizes, res = tuple(self.attrs["sizes"]), []
        for d, (copy, scale, rd) in enumerate(self._axes(in_shape)):
            if copy:
                res.append(None)
                continue
            n = in_shape[d]
            xo = _source_coord_np(ctm, scale, n, sizes[d], rd)
            outside = ((xo < 0) | (xo > n - 1)) if ctm == "tf_crop_and_resize" else None
            fl = np.floor(xo)
            t = xo - fl
            base = fl.astype(np.int64)
            if mode == "nearest":
                nm = self.attrs.get("nearest_mode", "round_prefer_floor")
                up = {"round_prefer_floor": t > 0.5, "round_prefer_ceil": t >= 0.5, "floor": np.zeros_like(t, bool),
                      "ceil": t > 0}[nm]
                res.append((np.clip(base + up, 0, n - 1)[:, None], np.ones((len(t), 1)), outside))
                continue
            offs, ws = _taps(self.attrs, scale, t, base, n, _NumpyOps)
            idx = np.clip(base[:, None] + np.asarray(offs)[None, :], 0, n - 1)
            res.append((idx, np.stack([np.broadcast_to(w_, t.shape) for w_ in ws], axis=1), outside))
        return res

    def numpy(self, x):
        sizes = tuple(self.attrs["sizes"])
        nearest = self.attrs["mode"] == "nearest"
        res = x if nearest else x.astype(np.float64)
        outside = np.zeros(sizes, bool) if self.attrs["coordinate_transformation_mode"] == "tf_crop_and_resize" \
            else None
        for d, taps in enumerate(self.axis_taps(x.shape)):
            if taps is None:
                continue
            idx, ws, out_d = taps
            if outside is not None:
                shape = [1] * x.ndim
                shape[d] = -1
                outside = outside | out_d.reshape(shape)
            if nearest:
                res = np.take(res, idx[:, 0], axis=d)
                continue
            g = np.take(res, idx, axis=d)  # (..., out, taps, ...)
            wshape = [1] * g.ndim
            wshape[d], wshape[d + 1] = ws.shape
            res = (g * ws.reshape(wshape)).sum(axis=d + 1)
        res = res.astype(x.dtype)
        if outside is not None:
            res = np.where(outside, np.asarray(self.attrs.get("extrapolation_value", 0.0), x.dtype), res)
        return [np.ascontiguousarray(res)]


def _panels(w: np.ndarray) -> np.ndarray:
    """A conv weight ``[OC, C, *kernel]`` as :class:`PackedConv` reads it."""
    from .linalg import pack_panels

    return pack_panels(w.reshape(w.shape[0], -1).T)


def examples(rng: np.random.Generator):
    """Small instances of every op in this module: ``(op class, input arrays, attrs)``."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    res = [
        (Conv, [f(1, 2, 5, 5), f(3, 2, 3, 3)], {}),
        (Conv, [f(2, 4, 6, 5), f(4, 2, 3, 2), f(4)], {"group": 2, "strides": (2, 1), "pads": (1, 0, 1, 1),
                                                     "dilations": (1, 2)}),
        (Conv, [f(1, 3, 5, 5), f(3, 1, 3, 3)], {"group": 3, "pads": (1, 1, 1, 1)}),
        (Conv, [f(1, 2, 5, 5), f(4, 1, 2, 2)], {"group": 2, "strides": (2, 2), "pads": (0, 0, 1, 1)}),
        (Conv, [f(1, 2, 7), f(3, 2, 3), f(3)], {"strides": (2,), "pads": (2, 1), "dilations": (2,)}),
        (Conv, [f(1, 1, 3, 4, 3), f(2, 1, 2, 2, 2)], {"pads": (1, 0, 0, 0, 1, 1)}),
        # int32 (ConvInteger, QLinearConv): exact integer sums
        (Conv, [rng.integers(-128, 128, (1, 3, 6, 5)).astype(np.int32), rng.integers(-128, 128, (4, 3, 3, 3))
                .astype(np.int32), rng.integers(-1000, 1000, (4,)).astype(np.int32)], {"pads": (1, 1, 0, 1)}),
        # (few output channels, as the Conv ones: the generic nest; the cpu template's cases are in
        # tests/codegen/test_cpu_kernels.py)
        (PackedConv, [f(2, 3, 5, 4), _panels(f(3, 3, 3, 2)), f(3)], {"oc": 3, "kernel": (3, 2), "strides": (2, 1),
                                                                    "pads": (1, 0, 1, 1), "dilations": (1, 2)}),
        (PackedConv, [f(1, 4, 6), _panels(f(2, 4, 1))], {"oc": 2, "kernel": (1,)}),
        # the blocked layout (passes/layout.py): in, out, both
        (PackedConv, [f(1, 1, 5, 4, BLOCK), _panels(f(16, 16, 2, 2)), f(16)],
         {"oc": 16, "kernel": (2, 2), "pads": (1, 1, 1, 0), "strides": (2, 1), "blocked_in": True}),
        (PackedConv, [f(2, 3, 4, 5), _panels(f(32, 3, 1, 1))], {"oc": 32, "kernel": (1, 1), "blocked_out": True}),
        (PackedConv, [f(1, 1, 6, 5, BLOCK), _panels(f(32, 16, 1, 1)), f(32)],
         {"oc": 32, "kernel": (1, 1), "strides": (2, 2), "blocked_in": True, "blocked_out": True}),
        (WinogradConv, [f(1, 3, 5, 6), winograd_weights(f(3, 3, 3, 3), 2)], {"oc": 3, "m": 2, "pads": (1, 1, 1, 1)}),
        (WinogradConv, [f(1, 1, 5, 6, BLOCK), winograd_weights(f(16, 16, 3, 3), 2), f(16)],
         {"oc": 16, "m": 2, "pads": (1, 1, 1, 1), "blocked_in": True, "blocked_out": True}),
        (WinogradConv, [f(2, 2, 7, 5), winograd_weights(f(3, 2, 3, 3), 4), f(3)], {"oc": 3, "m": 4,
                                                                                   "pads": (0, 1, 2, 0)}),
        (ConvTranspose, [f(1, 2, 3, 3), f(2, 3, 3, 3)], {"output_shape": (5, 5)}),
        (ConvTranspose, [f(1, 4, 3, 2), f(4, 1, 3, 2), f(2)], {"group": 2, "strides": (3, 2), "pads": (1, 0, 1, 1),
                                                               "dilations": (1, 2), "output_shape": (8, 5)}),
        (ConvTranspose, [f(2, 1, 4), f(1, 2, 3)], {"strides": (2,), "pads": (0, 0), "output_shape": (10,)}),
        (ConvTranspose, [f(1, 4, 3, 2), f(4, 3, 2, 2), f(3)], {"strides": (2, 2), "output_shape": (6, 4)}),
        (ConvTranspose, [f(2, 4, 3, 2), f(4, 1, 2, 1), f(2)], {"group": 2, "strides": (2, 1), "output_shape": (6, 2)}),
        (ConvTranspose, [f(1, 3, 3, 4), f(3, 2, 4, 4), f(2)], {"strides": (2, 2), "pads": (1, 1, 1, 1),
                                                               "output_shape": (6, 8)}),
        (ConvTranspose, [f(2, 4, 3), f(4, 1, 6), f(2)], {"group": 2, "strides": (3,), "pads": (2, 1),
                                                         "output_shape": (7,)}),
        (Pool, [f(1, 2, 5, 5)], {"kind": "max", "kernel": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}),
        (Pool, [f(1, 2, 5, 6)], {"kind": "max", "kernel": (2, 3), "strides": (2, 2), "dilations": (1, 2),
                                 "ceil_mode": True, "with_indices": True}),
        (Pool, [f(1, 2, 5, 6)], {"kind": "max", "kernel": (2, 2), "pads": (1, 0, 0, 1), "with_indices": True,
                                 "storage_order": 1}),
        (Pool, [f(1, 1, 7)], {"kind": "max", "kernel": (3,), "strides": (2,), "with_indices": True}),
        # dilated windows exactly as long as their input: the taps split in blocks (local_attrs)
        (Pool, [f(1, 2, 6, 6)], {"kind": "max", "kernel": (2, 3), "dilations": (3, 2)}),
        (Pool, [f(1, 1, 4, 6)], {"kind": "avg", "kernel": (2, 3), "dilations": (2, 2)}),
        (Pool, [rng.integers(0, 255, (1, 2, 4, 4)).astype(np.uint8)], {"kind": "max", "kernel": (2, 2),
                                                                      "pads": (1, 1, 0, 0)}),
        (Pool, [f(1, 2, 5, 5)], {"kind": "avg", "kernel": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}),
        (Pool, [f(1, 2, 5, 5)], {"kind": "avg", "kernel": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1),
                                 "count_include_pad": True, "ceil_mode": True}),
        (Pool, [f(1, 2, 6, 5)], {"kind": "avg", "kernel": (2, 2), "strides": (2, 2), "ceil_mode": True}),
        (Pool, [f(1, 1, 4, 4, 4)], {"kind": "avg", "kernel": (2, 2, 2)}),
        (Pool, [f(1, 2, 5, 5)], {"kind": "lp", "kernel": (2, 2), "p": 3, "pads": (1, 1, 0, 0)}),
        (Pool, [f(1, 2, 5)], {"kind": "lp", "kernel": (2,), "p": 2, "strides": (2,)}),
        (GlobalPool, [f(2, 3, 4, 5)], {"kind": "avg"}),
        (GlobalPool, [f(2, 3, 4)], {"kind": "max"}),
        (GlobalPool, [f(1, 2, 3, 3)], {"kind": "lp", "p": 2}),
    ]
    base = {"coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_floor"}
    x = f(1, 2, 3, 4)
    res += [
        (Resize, [x], {**base, "mode": "nearest", "sizes": (1, 2, 6, 8), "scales": (1.0, 1.0, 2.0, 2.0)}),
        (Resize, [x], {**base, "mode": "nearest", "sizes": (1, 2, 5, 3), "scales": (1.0, 1.0, 5 / 3, 0.75),
                       "coordinate_transformation_mode": "asymmetric", "nearest_mode": "ceil"}),
        (Resize, [x], {**base, "mode": "nearest", "sizes": (1, 2, 4, 7), "scales": (1.0, 1.0, 4 / 3, 7 / 4),
                       "coordinate_transformation_mode": "align_corners", "nearest_mode": "floor"}),
        (Resize, [x], {**base, "mode": "linear", "sizes": (1, 2, 5, 7), "scales": (1.0, 1.0, 5 / 3, 7 / 4)}),
        (Resize, [x], {**base, "mode": "linear", "sizes": (1, 2, 2, 2), "scales": (1.0, 1.0, 0.6, 0.6),
                       "coordinate_transformation_mode": "pytorch_half_pixel"}),
        (Resize, [x], {**base, "mode": "linear", "sizes": (1, 2, 3, 6), "scales": (1.0, 1.0, 1.0, 1.5),
                       "coordinate_transformation_mode": "half_pixel_symmetric"}),
        (Resize, [x], {**base, "mode": "cubic", "sizes": (1, 2, 6, 5), "scales": (1.0, 1.0, 2.0, 1.25),
                       "cubic_coeff_a": -0.5, "exclude_outside": True}),
        (Resize, [x], {**base, "mode": "cubic", "sizes": (1, 2, 2, 6), "scales": (1.0, 1.0, 0.8, 1.5),
                       "coordinate_transformation_mode": "align_corners"}),
        (Resize, [x], {**base, "mode": "linear", "sizes": (1, 2, 2, 2), "scales": (1.0, 1.0, 0.6, 0.6),
                       "antialias": True}),
        (Resize, [x], {**base, "mode": "cubic", "sizes": (1, 2, 2, 3), "scales": (1.0, 1.0, 0.7, 0.75),
                       "antialias": True, "exclude_outside": True}),
        (Resize, [x], {**base, "mode": "linear", "sizes": (1, 2, 3, 3), "scales": (1.0, 1.0, 1.0, 0.75),
                       "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 5.0,
                       "roi": (0.0, 0.0, 0.0, 0.2, 1.0, 1.0, 1.0, 1.3)}),
    ]
    # integer convs with packed weights: bytes minus zero points (last, so that adding them moved no other
    # example's random values)
    u8 = lambda *s: rng.integers(0, 256, s).astype(np.uint8)  # noqa: E731
    i8 = lambda *s: rng.integers(-128, 128, s).astype(np.int8)  # noqa: E731
    wz = lambda w, z: w.astype(np.int32) - np.asarray(z, np.int32).reshape((-1,) + (1,) * (w.ndim - 1))  # noqa: E731
    res += [
        (PackedConvInteger, [u8(1, 4, 6, 5), *pack_int8_conv(wz(i8(8, 4, 3, 3), i8(8)), 1), np.array(117, np.uint8)],
         {"oc": 8, "kernel": (3, 3), "pads": (1, 1, 1, 1)}),
        (PackedConvInteger, [i8(2, 4, 7, 6), *pack_int8_conv(wz(u8(6, 2, 2, 3), 130), 2)],
         {"oc": 6, "kernel": (2, 3), "group": 2, "strides": (2, 1), "dilations": (1, 2), "pads": (0, 1, 1, 0)}),
        (PackedConvInteger, [u8(1, 3, 9), *pack_int8_conv(wz(i8(20, 3, 3), 0), 1), np.array([5], np.uint8)],
         {"oc": 20, "kernel": (3,), "strides": (2,), "pads": (1, 1)}),
    ]
    # bfloat16 convs (values and rows of bfloat16)
    bf = lambda *s: rng.standard_normal(s).astype(np.float32).astype(numpy_type("bfloat16"))  # noqa: E731
    res += [
        (PackedConvBf16, [bf(1, 4, 6, 5), pack_bf16_conv(bf(8, 4, 3, 3), 1), f(8)],
         {"oc": 8, "kernel": (3, 3), "pads": (1, 1, 1, 1)}),
        (PackedConvBf16, [bf(2, 4, 7, 6), pack_bf16_conv(bf(6, 2, 2, 3), 2)],
         {"oc": 6, "kernel": (2, 3), "group": 2, "strides": (2, 1), "dilations": (1, 2), "pads": (0, 1, 1, 0)}),
        (PackedConvBf16, [bf(1, 3, 9), pack_bf16_conv(bf(20, 3, 3), 1), f(20)],
         {"oc": 20, "kernel": (3,), "strides": (2,), "pads": (1, 1)}),
        # a Relu and the rounding to bfloat16 as it stores (34 channels: a partial tile of rows; few pixels, or
        # the cuda target takes its compute for a bfloat16 GEMM, which the host emulation lacks); a Clip
        (PackedConvBf16, [bf(1, 5, 4, 3), pack_bf16_conv(bf(34, 5, 3, 3), 1), f(34)],
         {"oc": 34, "kernel": (3, 3), "pads": (1, 1, 1, 1), "lo": 0.0, "to": "bfloat16"}),
        (PackedConvBf16, [bf(2, 4, 5, 5), pack_bf16_conv(bf(6, 2, 1, 1), 2)],
         {"oc": 6, "kernel": (1, 1), "group": 2, "to": "bfloat16"}),
        (PackedConvBf16, [bf(1, 4, 6, 5), pack_bf16_conv(bf(8, 4, 3, 3), 1), f(8)],
         {"oc": 8, "kernel": (3, 3), "pads": (1, 1, 1, 1), "lo": -0.5, "hi": 0.75}),
    ]
    return res
