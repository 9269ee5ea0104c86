"""Handlers for the ONNX sampling ops ``GridSample`` (opsets 16, 20, 22), ``RoiAlign`` (10, 16, 22) and
``DeformConv`` (19, 22, 2-D).

None has an operator of its own: each is composed (through ``ctx.emit``) from element-wise
arithmetic, ``Floor``/``Round``/``Clip``/``Where``/``Cast``, a row ``Gather`` and a reduction,
following the ONNX specification and its reference implementation (``onnx/reference/ops``) step
for step, so that they get compute definitions, sharding rules and kernels like any other chain.

All three sample an image at data-dependent positions. For each spatial axis they compute the
integer positions of the taps around a sampling point with one weight per tap (per-axis, so that a
d-dimensional sample needs ``m ** d`` taps from ``d`` small tensors); :func:`_gather_taps` turns
the per-axis taps into row indices of the image laid out as ``[batch * pixels, channels]``,
gathers the rows and weights them. GridSample then sums the taps; RoiAlign sums (``avg``) or
takes the maximum (``max``) over the taps and the samples of each bin; DeformConv sums them (its
bilinear samples are GridSample's with zeros padding at pixel coordinates, as the reference
computes them), scales them by the mask and convolves them as an im2col MatMul.

GridSample: modes nearest (round half to even), linear (``2 ** d`` taps) and cubic (``4 ** d``
taps, A = -0.75) over any number d >= 1 of spatial axes (opset 16: 2-D only, modes bilinear /
nearest / bicubic), padding modes zeros / border / reflection, ``align_corners`` 0 and 1. The
sampling coordinates are computed in float32 (the denormalization in the grid's type) as the
reference does, in float64 for a float64 grid (as onnxruntime; the reference rounds them to
float32); linear and cubic need a floating-point image, nearest takes any type. Cubic with border
padding clamps the coordinate before taking the taps, as the reference does (onnxruntime clamps
each tap instead, as PyTorch does, and differs near the borders).

RoiAlign: modes avg and max (the maximum over the weighted taps, as the reference computes it),
``coordinate_transformation_mode`` half_pixel / output_half_pixel (opset 16+; opset 10 is
output_half_pixel, as its spec and onnxruntime have it; the reference evaluator shifts it by half a
pixel). With ``sampling_ratio`` = 0 the number of samples per bin, ``ceil(roi size /
output size)``, depends on the roi values: the rois must then be known at import (a constant, or
bound with ``input_values``), otherwise the node is refused.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedOperatorError
from ..ir.graph import Tensor
from ..ops.transform import Reshape, Transpose, ValuesInRange
from .registry import FLOATS, NodeContext, onnx_op

log = logging.getLogger(__name__)

_OPSET = 13  # of the nodes emitted
_CUBIC_A = -0.75
#: Adaptive RoiAlign sampling (``sampling_ratio`` = 0): samples per bin axis above which a warning is
#: logged, and above which the node is refused (the taps of a bin grow with the square).
_MANY_SAMPLES = 64
_MAX_SAMPLES = 1024


# small emitting helpers -----------------------------------------------------------------------------

def _e(ctx: NodeContext, op: str, *inputs: Tensor, **attrs) -> Tensor:
    return ctx.emit(op, list(inputs), _OPSET, **attrs)


def _c(ctx: NodeContext, value, dtype: str) -> Tensor:
    return ctx.constant(np.asarray(value, dtype=dtype))


def _reshape(ctx: NodeContext, t: Tensor, shape) -> Tensor:
    shape = tuple(int(s) for s in shape)
    return t if t.shape == shape else _e(ctx, "Reshape", t, _c(ctx, shape, "int64"))


def _unsqueeze_last(ctx: NodeContext, t: Tensor) -> Tensor:
    return _e(ctx, "Unsqueeze", t, _c(ctx, [-1], "int64"))


def _clip(ctx: NodeContext, t: Tensor, lo, hi) -> Tensor:
    return _e(ctx, "Clip", t, _c(ctx, lo, t.dtype), _c(ctx, hi, t.dtype))


# tap gathering (shared) -----------------------------------------------------------------------------

@dataclass
class _Taps:
    """The taps of one spatial axis: ``index`` (int64, in range) times ``stride`` addresses the
    image row, ``weight`` (float, or None for 1) scales the tap, ``valid`` (bool, or None) zeroes
    it. All three broadcast against the full tap shape."""

    index: Tensor
    stride: int
    weight: Tensor | None = None
    valid: Tensor | None = None


def _image_table(ctx: NodeContext, x: Tensor) -> Tensor:
    """``x`` ``[N, C, *spatial]`` as rows ``[N * prod(spatial), C]`` (pixel-major, channels last)."""
    perm = [0] + list(range(2, x.ndim)) + [1]
    rows = _e(ctx, "Transpose", x, perm=perm)
    return _reshape(ctx, rows, (int(np.prod(x.shape[:1] + x.shape[2:])), x.shape[1]))


def _gather_taps(ctx: NodeContext, table: Tensor, base: Tensor, taps: list[_Taps], shape: tuple) -> Tensor:
    """Gather the image rows the taps address and weight them.

    ``table`` is the image as rows ``[rows, C]`` (:func:`_image_table`); ``base`` (int64,
    broadcastable to ``shape``) is the first row of each sample's image; each entry of ``taps``
    holds one spatial axis' tap indices, stride, weights and validity, broadcastable to ``shape``.
    Returns ``[*shape, C]``: row ``base + sum(index * stride)`` times the product of the weights,
    0 where a tap is not valid.
    """
    flat = base
    weight = valid = None
    for t in taps:
        idx = t.index if t.stride == 1 else _e(ctx, "Mul", t.index, _c(ctx, t.stride, "int64"))
        flat = _e(ctx, "Add", flat, idx)
        if t.weight is not None:
            weight = t.weight if weight is None else _e(ctx, "Mul", weight, t.weight)
        if t.valid is not None:
            valid = t.valid if valid is None else _e(ctx, "And", valid, t.valid)
    if flat.shape != tuple(shape):
        flat = _e(ctx, "Expand", flat, _c(ctx, shape, "int64"))
    values = _e(ctx, "Gather", table, flat, axis=0)
    if weight is not None:
        values = _e(ctx, "Mul", values, _unsqueeze_last(ctx, ctx.cast(weight, table.dtype)))
    if valid is not None:
        values = _e(ctx, "Where", _unsqueeze_last(ctx, valid), values, _c(ctx, 0, table.dtype))
    return values


# GridSample -----------------------------------------------------------------------------------------

_GRID_MODES_16 = {"bilinear": "linear", "nearest": "nearest", "bicubic": "cubic"}
_GRID_MODES_20 = {"linear": "linear", "nearest": "nearest", "cubic": "cubic"}
_PADDING_MODES = ("zeros", "border", "reflection")


def _denormalize(ctx: NodeContext, g: Tensor, length: int, align_corners: bool) -> Tensor:
    """Grid values in [-1, 1] to pixel coordinates, in the grid's type, as the reference orders it."""
    dt = g.dtype
    one = _c(ctx, 1, dt)
    if align_corners:                                   # (n + 1) / 2 * (length - 1)
        u = _e(ctx, "Div", _e(ctx, "Add", g, one), _c(ctx, 2, dt))
        return _e(ctx, "Mul", u, _c(ctx, length - 1, dt))
    u = _e(ctx, "Mul", _e(ctx, "Add", g, one), _c(ctx, length, dt))   # ((n + 1) * length - 1) / 2
    return _e(ctx, "Div", _e(ctx, "Sub", u, one), _c(ctx, 2, dt))


def _reflect(ctx: NodeContext, v: Tensor, lo: float, hi: float) -> Tensor:
    """Reflect ``v`` by the borders ``lo`` and ``hi`` until it is within them (the reference's
    ``_gs_reflect``: ``n = int(dx / range)`` whole ranges, then the remainder from the border
    that an even (odd) number of reflections lands on)."""
    dt = v.dtype
    span = hi - lo
    if span <= 0:                                       # one pixel with align_corners: only lo remains
        return _clip(ctx, v, lo, lo)
    c_lo, c_hi = _c(ctx, lo, dt), _c(ctx, hi, dt)
    below, above = _e(ctx, "Less", v, c_lo), _e(ctx, "Greater", v, c_hi)
    dx = _e(ctx, "Where", below, _e(ctx, "Sub", c_lo, v), _e(ctx, "Sub", v, c_hi))
    n = _e(ctx, "Floor", _e(ctx, "Div", dx, _c(ctx, span, dt)))
    r = _e(ctx, "Sub", dx, _e(ctx, "Mul", n, _c(ctx, span, dt)))
    half = _e(ctx, "Mul", n, _c(ctx, 0.5, dt))
    odd = _e(ctx, "Not", _e(ctx, "Equal", _e(ctx, "Floor", half), half))
    from_lo = _e(ctx, "Xor", below, odd)                # below & even, or above & odd: lo + r
    fx = _e(ctx, "Where", from_lo, _e(ctx, "Add", c_lo, r), _e(ctx, "Sub", c_hi, r))
    return _e(ctx, "Where", _e(ctx, "Or", below, above), fx, v)


def _pad_coordinate(ctx: NodeContext, u: Tensor, length: int, lo: float, hi: float, padding: str) -> Tensor:
    """The reference's treatment of a coordinate outside ``[lo, hi]`` before interpolation:
    border clamps it to ``[0, length - 1]``, reflection reflects it, zeros keeps it."""
    if padding == "border":
        u = _e(ctx, "Where", _e(ctx, "Less", u, _c(ctx, lo, u.dtype)), _c(ctx, 0, u.dtype), u)
        return _e(ctx, "Where", _e(ctx, "Greater", u, _c(ctx, hi, u.dtype)), _c(ctx, length - 1, u.dtype), u)
    if padding == "reflection":
        return _reflect(ctx, u, lo, hi)
    return u


def _cubic_weights(ctx: NodeContext, t: Tensor) -> Tensor:
    """The four cubic-convolution coefficients (Keys, A = -0.75) of taps ``x0 - 1 .. x0 + 2`` for a
    fraction ``t = x - x0`` ``[..., 1]``: ``[..., 4]``, each polynomial as the reference writes it."""
    dt = t.dtype
    a = _CUBIC_A
    s = _e(ctx, "Abs", _e(ctx, "Sub", t, _c(ctx, [-1, 0, 1, 2], dt)))      # t + 1, t, 1 - t, 2 - t

    def c(v):
        return _c(ctx, v, dt)

    near = _e(ctx, "Sub", _e(ctx, "Mul", c(a + 2), s), c(a + 3))            # ((A+2)s - (A+3)) s s + 1
    near = _e(ctx, "Add", _e(ctx, "Mul", _e(ctx, "Mul", near, s), s), c(1))
    far = _e(ctx, "Sub", _e(ctx, "Mul", c(a), s), c(5 * a))                 # ((A s - 5A) s + 8A) s - 4A
    far = _e(ctx, "Add", _e(ctx, "Mul", far, s), c(8 * a))
    far = _e(ctx, "Sub", _e(ctx, "Mul", far, s), c(4 * a))
    return _e(ctx, "Where", _c(ctx, [False, True, True, False], "bool"), near, far)


def _grid_axis_taps(ctx: NodeContext, u: Tensor, length: int, mode: str, padding: str, align: bool,
                    stride: int, shape: tuple) -> _Taps:
    """The taps of one spatial axis of length ``length`` for coordinates ``u`` ``[N, Q]``:
    ``[N, Q, m]`` indices and weights (m = 1, 2, 4 for nearest, linear, cubic), reshaped to ``shape``."""
    lo, hi = (0.0, length - 1.0) if align else (-0.5, length - 0.5)
    ft = u.dtype
    if mode == "nearest":
        u = _e(ctx, "Round", u)                          # half to even, as np.rint
    u = _pad_coordinate(ctx, u, length, lo, hi, padding)
    weight = None
    if mode == "nearest":
        pos = _unsqueeze_last(ctx, u)
    else:
        x0 = _e(ctx, "Floor", u)
        t = _unsqueeze_last(ctx, _e(ctx, "Sub", u, x0))
        offsets = [0, 1] if mode == "linear" else [-1, 0, 1, 2]
        pos = _e(ctx, "Add", _unsqueeze_last(ctx, x0), _c(ctx, offsets, ft))
        if mode == "linear":                             # 1 - t, t
            weight = _e(ctx, "Where", _c(ctx, [True, False], "bool"), _e(ctx, "Sub", _c(ctx, 1, ft), t), t)
        else:
            weight = _cubic_weights(ctx, t)
    valid = None
    if padding == "zeros":
        valid = _e(ctx, "And", _e(ctx, "GreaterOrEqual", pos, _c(ctx, 0, ft)),
                   _e(ctx, "LessOrEqual", pos, _c(ctx, length - 1, ft)))
    elif padding == "reflection":
        pos = _reflect(ctx, pos, lo, hi)
    index = ctx.cast(_clip(ctx, pos, 0, length - 1), "int64")   # truncation, as int() in the reference
    index, weight, valid = (None if v is None else _reshape(ctx, v, shape) for v in (index, weight, valid))
    return _Taps(index, stride, weight, valid)


def _grid_sample_attrs(ctx: NodeContext) -> tuple[str, str, bool]:
    modes = _GRID_MODES_16 if ctx.opset < 20 else _GRID_MODES_20
    mode = ctx.attr("mode", "bilinear" if ctx.opset < 20 else "linear")
    if mode not in modes:
        raise ctx.invalid(f"mode must be one of {', '.join(modes)} at opset {ctx.opset}, got {mode!r}")
    padding = ctx.attr("padding_mode", "zeros")
    if padding not in _PADDING_MODES:
        raise ctx.invalid(f"padding_mode must be one of {', '.join(_PADDING_MODES)}, got {padding!r}")
    align = int(ctx.flag("align_corners", 0))
    if align not in (0, 1):
        raise ctx.invalid(f"align_corners must be 0 or 1, got {align}")
    return modes[mode], padding, bool(align)


@onnx_op("GridSample", since=16)
def grid_sample(ctx):
    """``GridSample``: ``Y[n, c, *o] = X[n, c]`` interpolated at the normalized position
    ``grid[n, *o]`` (its last axis lists the coordinates innermost axis first: x, y, z)."""
    x, grid = ctx.input(0), ctx.input(1)
    mode, padding, align = _grid_sample_attrs(ctx)
    if x.ndim < 3 or (ctx.opset < 20 and x.ndim != 4):
        raise ctx.shape_error(f"X must be {'4-D' if ctx.opset < 20 else 'at least 3-D'} [N, C, *spatial], "
                              f"got shape {x.shape}")
    d = x.ndim - 2
    if grid.ndim != d + 2 or grid.shape[0] != x.shape[0] or grid.shape[-1] != d:
        raise ctx.shape_error(f"grid of shape {grid.shape} does not fit X of shape {x.shape} (expected "
                              f"[{x.shape[0]}, {', '.join(['*'] * d)}, {d}])")
    if grid.dtype not in FLOATS:
        raise ctx.invalid(f"grid must be floating point, got {grid.dtype}")
    if mode != "nearest" and x.dtype not in FLOATS:
        raise ctx.unsupported(f"{mode} interpolation of a {x.dtype} input (floating-point inputs are)")
    if x.size == 0 or grid.size == 0:
        raise ctx.unsupported(f"empty tensors (X {x.shape}, grid {grid.shape})")
    n, c, spatial, out = x.shape[0], x.shape[1], x.shape[2:], grid.shape[1:-1]
    q = int(np.prod(out))
    m = {"nearest": 1, "linear": 2, "cubic": 4}[mode]
    log.debug("%s: %s GridSample over %d-D, %d taps per output", ctx.name, mode, d, m ** d)

    g = _reshape(ctx, grid, (n, q, d))
    coord = "float64" if grid.dtype == "float64" else "float32"
    shape = (n, q) + (m,) * d
    taps = []
    for k, length in enumerate(spatial):                 # grid[..., d - 1 - k] addresses spatial axis k
        comp = _e(ctx, "Gather", g, _c(ctx, d - 1 - k, "int64"), axis=2)
        u = ctx.cast(_denormalize(ctx, comp, length, align), coord)
        taps.append(_grid_axis_taps(ctx, u, length, mode, padding, align, int(np.prod(spatial[k + 1:])),
                                    (n, q) + (1,) * k + (m,) + (1,) * (d - 1 - k)))
    base = _c(ctx, (np.arange(n) * int(np.prod(spatial))).reshape((n,) + (1,) * (d + 1)), "int64")
    values = _gather_taps(ctx, _image_table(ctx, x), base, taps, shape)        # [N, Q, m.., C]
    if m == 1:
        values = _reshape(ctx, values, (n, q, c))
    else:
        values = _e(ctx, "ReduceSum", values, _c(ctx, list(range(2, 2 + d)), "int64"), keepdims=0)
    y = _e(ctx, "Transpose", values, perm=[0, 2, 1])
    return [ctx.add(Reshape([y], name=ctx.name, shape=(n, c) + tuple(out)))]


# RoiAlign -------------------------------------------------------------------------------------------

def _roi_axis_taps(ctx: NodeContext, start: Tensor, bin_size: Tensor, grid: Tensor, outputs: int, samples: int,
                   length: int) -> tuple[Tensor, Tensor]:
    """The bilinear taps of one image axis (the reference's ``pre_calc_for_bilinear_interpolate``):
    ``start``, ``bin_size`` and ``grid`` (samples per bin, at least 1) per roi ``[R, 1, 1]`` give the
    sample positions ``[R, outputs, samples]``; returns the low/high indices (int64) and weights,
    ``[R, outputs, samples, 2]``, the weights 0 for samples outside ``[-1, length]``."""
    dt = start.dtype
    bins = _c(ctx, np.arange(outputs).reshape(1, outputs, 1), dt)
    steps = _c(ctx, (np.arange(samples) + 0.5).reshape(1, 1, samples), dt)
    v = _e(ctx, "Add", _e(ctx, "Add", start, _e(ctx, "Mul", bins, bin_size)),
           _e(ctx, "Div", _e(ctx, "Mul", steps, bin_size), grid))
    outside = _e(ctx, "Or", _e(ctx, "Less", v, _c(ctx, -1, dt)), _e(ctx, "Greater", v, _c(ctx, length, dt)))
    v = _e(ctx, "Max", v, _c(ctx, 0, dt))
    low = _e(ctx, "Floor", v)
    edge = _e(ctx, "GreaterOrEqual", low, _c(ctx, length - 1, dt))
    low = _e(ctx, "Where", edge, _c(ctx, length - 1, dt), low)
    v = _e(ctx, "Where", edge, low, v)
    high = _e(ctx, "Min", _e(ctx, "Add", low, _c(ctx, 1, dt)), _c(ctx, length - 1, dt))
    frac = _unsqueeze_last(ctx, _e(ctx, "Sub", v, low))
    weight = _e(ctx, "Where", _c(ctx, [True, False], "bool"), _e(ctx, "Sub", _c(ctx, 1, dt), frac), frac)
    weight = _e(ctx, "Where", _unsqueeze_last(ctx, outside), _c(ctx, 0, dt), weight)
    index = _e(ctx, "Concat", _unsqueeze_last(ctx, low), _unsqueeze_last(ctx, high), axis=-1)
    return ctx.cast(index, "int64"), weight


def _roi_attrs(ctx: NodeContext) -> tuple[str, int, int, int, float, bool]:
    mode = ctx.attr("mode", "avg")
    if mode not in ("avg", "max"):
        raise ctx.invalid(f"mode must be 'avg' or 'max', got {mode!r}")
    oh, ow = int(ctx.attr("output_height", 1)), int(ctx.attr("output_width", 1))
    ratio = int(ctx.attr("sampling_ratio", 0))
    if oh < 1 or ow < 1 or ratio < 0:
        raise ctx.invalid(f"output_height={oh} and output_width={ow} must be positive and sampling_ratio={ratio} "
                          "not negative")
    half_pixel = False
    if ctx.opset >= 16:
        ctm = ctx.attr("coordinate_transformation_mode", "half_pixel")
        if ctm not in ("half_pixel", "output_half_pixel"):
            raise ctx.invalid(f"coordinate_transformation_mode must be 'half_pixel' or 'output_half_pixel', "
                              f"got {ctm!r}")
        half_pixel = ctm == "half_pixel"
    return mode, oh, ow, ratio, float(ctx.attr("spatial_scale", 1.0)), half_pixel


def _adaptive_grid(starts_ends: list[np.ndarray], outputs: tuple[int, int],
                   half_pixel: bool) -> tuple[np.ndarray, np.ndarray]:
    """Samples per bin along y and x for each roi with ``sampling_ratio`` = 0, from the roi values
    known at import: ``ceil(roi size / output size)`` computed in the rois' type as the reference."""
    sw, sh, ew, eh = starts_ends
    res = []
    for size, out in ((eh - sh, outputs[0]), (ew - sw, outputs[1])):
        if not half_pixel:
            size = np.maximum(size, size.dtype.type(1.0))
        res.append(np.ceil(size / size.dtype.type(out)).astype(np.int64))
    return res[0], res[1]


def _known_rois(ctx: NodeContext) -> np.ndarray:
    try:
        return np.asarray(ctx.const(1))
    except UnsupportedOperatorError as exc:
        raise UnsupportedOperatorError(
            f"{exc}. (With sampling_ratio=0 the number of samples per bin, ceil(roi size / output size), "
            "depends on the roi values; give sampling_ratio > 0 to pool rois known only at run time.)",
            exc.unsupported) from None


@onnx_op("RoiAlign", since=10)
def roi_align(ctx):
    """``RoiAlign``: pool each roi of ``X`` ``[N, C, H, W]`` into ``output_height x output_width``
    bins by averaging (or taking the maximum of) bilinearly interpolated samples."""
    x, rois, batch = ctx.input(0), ctx.input(1), ctx.input(2)
    mode, oh, ow, ratio, scale, half_pixel = _roi_attrs(ctx)
    if x.dtype not in FLOATS or rois.dtype != x.dtype:
        raise ctx.unsupported(f"X of type {x.dtype} with rois of type {rois.dtype} (equal floating-point types are)")
    if x.ndim != 4:
        raise ctx.shape_error(f"X must be 4-D [N, C, H, W], got shape {x.shape}")
    if rois.ndim != 2 or rois.shape[1] != 4 or batch.shape != rois.shape[:1]:
        raise ctx.shape_error(f"rois must be [num_rois, 4] and batch_indices [num_rois], got shapes {rois.shape} "
                              f"and {batch.shape}")
    if batch.dtype not in ("int64", "int32"):
        raise ctx.invalid(f"batch_indices must be integers, got {batch.dtype}")
    n, c, h, w = x.shape
    r = rois.shape[0]
    if x.size == 0 or r == 0:
        raise ctx.unsupported(f"empty tensors (X {x.shape}, rois {rois.shape})")
    dt = rois.dtype
    offset = np.asarray(0.5 if half_pixel else 0.0, dt)

    # roi corners, sizes and bins, [R, 1, 1] each (x1, y1, x2, y2 scaled, then shifted)
    rois3 = _reshape(ctx, rois, (r, 4, 1))
    corners = [_e(ctx, "Sub", _e(ctx, "Mul", _e(ctx, "Gather", rois3, _c(ctx, [k], "int64"), axis=1),
                                  _c(ctx, scale, dt)), _c(ctx, offset, dt)) for k in range(4)]
    sw, sh, ew, eh = corners
    size_h, size_w = _e(ctx, "Sub", eh, sh), _e(ctx, "Sub", ew, sw)
    if not half_pixel:                                   # malformed rois are forced to 1 x 1
        size_h, size_w = (_e(ctx, "Max", s, _c(ctx, 1, dt)) for s in (size_h, size_w))
    bin_h, bin_w = _e(ctx, "Div", size_h, _c(ctx, oh, dt)), _e(ctx, "Div", size_w, _c(ctx, ow, dt))

    if ratio > 0:
        grid_h = grid_w = np.full(r, ratio, np.int64)
    else:
        rv = _known_rois(ctx).astype(dt)
        if not np.isfinite(rv).all():
            raise ctx.invalid("rois must be finite")
        grid_h, grid_w = _adaptive_grid([rv[:, k] * np.asarray(scale, dt) - offset for k in range(4)], (oh, ow),
                                        half_pixel)
    sh_n, sw_n = max(1, int(grid_h.max())), max(1, int(grid_w.max()))
    if max(sh_n, sw_n) > _MAX_SAMPLES:
        raise ctx.unsupported(f"adaptive sampling with {sh_n} x {sw_n} samples per bin (rois far larger than the "
                              f"output; at most {_MAX_SAMPLES} per axis); give sampling_ratio > 0")
    if max(sh_n, sw_n) > _MANY_SAMPLES:
        log.warning("%s: up to %d x %d samples per bin (%d taps per output value)", ctx.name, sh_n, sw_n,
                    4 * sh_n * sw_n)
    fixed = bool((grid_h == sh_n).all() and (grid_w == sw_n).all())
    counts = np.maximum(grid_h * grid_w, 1)

    def per_roi(v: np.ndarray, kind: str) -> Tensor:
        return _c(ctx, v.reshape(r, 1, 1), kind)

    ty, wy = _roi_axis_taps(ctx, sh, bin_h, per_roi(np.maximum(grid_h, 1), dt), oh, sh_n, h)
    tx, wx = _roi_axis_taps(ctx, sw, bin_w, per_roi(np.maximum(grid_w, 1), dt), ow, sw_n, w)
    in_y = in_x = None
    if not fixed:                                        # samples beyond a roi's own grid take no part
        in_y = _e(ctx, "Less", _c(ctx, np.arange(sh_n).reshape(1, 1, sh_n), "int64"), per_roi(grid_h, "int64"))
        in_x = _e(ctx, "Less", _c(ctx, np.arange(sw_n).reshape(1, 1, sw_n), "int64"), per_roi(grid_w, "int64"))
        if mode == "avg":
            wy = _e(ctx, "Where", _unsqueeze_last(ctx, in_y), wy, _c(ctx, 0, dt))
            wx = _e(ctx, "Where", _unsqueeze_last(ctx, in_x), wx, _c(ctx, 0, dt))

    # taps laid out [R, OH, OW, Sh, Sw, 2 (y), 2 (x)]
    shape = (r, oh, ow, sh_n, sw_n, 2, 2)
    y_axis, x_axis = (r, oh, 1, sh_n, 1, 2, 1), (r, 1, ow, 1, sw_n, 1, 2)
    taps = [_Taps(_reshape(ctx, ty, y_axis), w, _reshape(ctx, wy, y_axis)),
            _Taps(_reshape(ctx, tx, x_axis), 1, _reshape(ctx, wx, x_axis))]
    # batch_indices outside [0, N) are an error (the spec's range; onnxruntime refuses them), not rows
    # counted from the end as the gather below would take them
    batch = ctx.add(ValuesInRange([ctx.cast(batch, "int64")], name=f"{ctx.name}/batch_indices_in_range", lo=0,
                                  hi=n - 1, what="batch_indices"))
    base = _e(ctx, "Mul", batch, _c(ctx, h * w, "int64"))
    values = _gather_taps(ctx, _image_table(ctx, x), _reshape(ctx, base, (r,) + (1,) * 6), taps, shape)

    if mode == "avg":
        pooled = _e(ctx, "ReduceSum", values, _c(ctx, [3, 4, 5, 6], "int64"), keepdims=0)
        pooled = _e(ctx, "Div", pooled, _c(ctx, counts.reshape(r, 1, 1, 1), x.dtype))
    else:
        pooled = _e(ctx, "ReduceMax", values, axes=[5, 6], keepdims=0)       # [R, OH, OW, Sh, Sw, C]
        if in_y is not None:
            taking = _e(ctx, "And", _reshape(ctx, in_y, (r, 1, 1, sh_n, 1, 1)),
                        _reshape(ctx, in_x, (r, 1, 1, 1, sw_n, 1)))
            pooled = _e(ctx, "Where", taking, pooled, _c(ctx, -np.inf, x.dtype))
        pooled = _e(ctx, "ReduceMax", pooled, axes=[3, 4], keepdims=0)
        empty = (grid_h <= 0) | (grid_w <= 0)
        if empty.any():                                  # no samples at all: the reference gives 0
            pooled = _e(ctx, "Where", _c(ctx, empty.reshape(r, 1, 1, 1), "bool"), _c(ctx, 0, x.dtype), pooled)
    return [ctx.add(Transpose([pooled], name=ctx.name, perm=(0, 3, 1, 2)))]


# DeformConv -----------------------------------------------------------------------------------------

@onnx_op("DeformConv", since=19)
def deform_conv(ctx):
    """``DeformConv`` (2-D, as the ONNX reference and onnxruntime implement it): each kernel tap of
    each output pixel samples the image bilinearly (zero outside, as GridSample with zeros padding
    at pixel coordinates) at its regular position plus a learned offset, scaled by an optional mask;
    then a grouped convolution of the samples with ``W``, plus ``B``.

    Composed like GridSample: the taps' positions ``[N * offset_group, kH * kW * oH * oW]`` per
    axis, the image of each offset group as rows (its channels only), the four taps gathered and
    summed; the samples laid out as an im2col ``[N, group, C / group * kH * kW, oH * oW]`` and one
    batched MatMul with the weights ``[group, oC / group, C / group * kH * kW]``."""
    x, w, offset = ctx.input(0), ctx.input(1), ctx.input(2)
    if x.ndim != 4 or w.ndim != 4:
        raise ctx.unsupported(f"a {x.ndim - 2}-D DeformConv (X {list(x.shape)}, W {list(w.shape)}; the 2-D one is)")
    if x.dtype not in FLOATS or w.dtype != x.dtype or offset.dtype != x.dtype:
        raise ctx.invalid(f"X, W and offset must share one floating-point type, got {x.dtype}, {w.dtype}, "
                          f"{offset.dtype}")
    n, c, h, wd = x.shape
    oc, cg = w.shape[0], w.shape[1]
    kh, kw = (int(v) for v in ctx.attr("kernel_shape", list(w.shape[2:])))
    if (kh, kw) != tuple(w.shape[2:]):
        raise ctx.shape_error(f"kernel_shape {[kh, kw]} differs from W's {list(w.shape[2:])}")
    group, og = int(ctx.attr("group", 1)), int(ctx.attr("offset_group", 1))
    sh, sw = (int(v) for v in ctx.attr("strides", [1, 1]))
    dh, dw = (int(v) for v in ctx.attr("dilations", [1, 1]))
    pt, pl, pb, pr = (int(v) for v in ctx.attr("pads", [0, 0, 0, 0]))
    if min(group, og, sh, sw, dh, dw) < 1 or min(pt, pl, pb, pr) < 0:
        raise ctx.invalid("group, offset_group, strides and dilations must be positive and pads not negative")
    if c != cg * group or oc % group or c % og:
        raise ctx.shape_error(f"X's {c} channels, W {list(w.shape)}, group {group} and offset_group {og} do not "
                              "fit (C = W.shape[1] * group, oC and C divisible by group and offset_group)")
    oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    taps, pixels = kh * kw, oh * ow
    if oh < 1 or ow < 1 or offset.shape != (n, og * 2 * taps, oh, ow):
        raise ctx.shape_error(f"offset of shape {list(offset.shape)}, expected {[n, og * 2 * taps, oh, ow]}")
    mask = ctx.input(4) if ctx.has_input(4) else None
    if mask is not None and (mask.shape != (n, og * taps, oh, ow) or mask.dtype != x.dtype):
        raise ctx.shape_error(f"mask of shape {list(mask.shape)} ({mask.dtype}), expected "
                              f"{[n, og * taps, oh, ow]} ({x.dtype})")
    bias = ctx.input(3) if ctx.has_input(3) else None
    if bias is not None and bias.shape != (oc,):
        raise ctx.shape_error(f"B of shape {list(bias.shape)}, expected [{oc}]")
    ng, q, ft = n * og, taps * pixels, x.dtype

    # sampling positions: the regular grid [kH, kW, oH, oW] plus the offsets, per axis
    off = _reshape(ctx, offset, (ng, taps, 2, pixels))
    at_h = np.arange(kh)[:, None, None, None] * dh + np.arange(oh)[None, None, :, None] * sh - pt
    at_w = np.arange(kw)[None, :, None, None] * dw + np.arange(ow)[None, None, None, :] * sw - pl
    axis_taps = []
    for a, (base, length, stride, shape) in enumerate(((at_h, h, wd, (ng, q, 2, 1)), (at_w, wd, 1, (ng, q, 1, 2)))):
        grid = np.broadcast_to(base, (kh, kw, oh, ow)).reshape(1, taps, pixels)
        u = _e(ctx, "Add", _e(ctx, "Gather", off, _c(ctx, a, "int64"), axis=2), _c(ctx, grid, ft))
        axis_taps.append(_grid_axis_taps(ctx, _reshape(ctx, u, (ng, q)), length, "linear", "zeros", True, stride,
                                         shape))
    # each offset group samples its own channels: the image as [N * og, C / og, H, W]
    table = _image_table(ctx, _reshape(ctx, x, (ng, c // og, h, wd)))
    first = _c(ctx, (np.arange(ng) * h * wd).reshape(ng, 1, 1, 1), "int64")
    values = _gather_taps(ctx, table, first, axis_taps, (ng, q, 2, 2))            # [N og, Q, 2, 2, C/og]
    sampled = _e(ctx, "ReduceSum", values, _c(ctx, [2, 3], "int64"), keepdims=0)  # [N og, Q, C/og]
    if mask is not None:
        sampled = _e(ctx, "Mul", sampled, _reshape(ctx, mask, (ng, q, 1)))
    # im2col [N, group, C/group * kH * kW, oH * oW]: channel c = g * C/og + c' of offset group g
    cols = _reshape(ctx, sampled, (n, og, taps, pixels, c // og))
    cols = _e(ctx, "Transpose", cols, perm=[0, 1, 4, 2, 3])
    cols = _reshape(ctx, cols, (n, group, cg * taps, pixels))
    wm = _reshape(ctx, w, (1, group, oc // group, cg * taps))
    y = _reshape(ctx, _e(ctx, "MatMul", wm, cols), (n, oc, oh, ow))
    if bias is not None:
        y = _e(ctx, "Add", y, _reshape(ctx, bias, (1, oc, 1, 1)))
    return [ctx.add(Reshape([y], name=ctx.name, shape=(n, oc, oh, ow)))]
