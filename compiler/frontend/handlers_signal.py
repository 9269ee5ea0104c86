"""Handlers for the ONNX signal ops ``DFT`` (opsets 17 and 20), ``STFT`` and ``MelWeightMatrix`` (opset 17; a
constant, computed at import as the ONNX reference does).

Shapes are static, so a transform of length ``N`` is a product with a constant matrix: the cos and
sin tables are computed in float64 at import and stored in the input's float type. Complex values
keep the ONNX layout ``[..., 2]`` (real, imaginary); with the signal axis moved next to that last
dimension and both flattened, one real ``MatMul`` by a block matrix does the complex product::

    [yr, yi] = [xr, xi] @ [[ Wr, Wi],        (W = cos(2πkn/N) ∓ j·sin(2πkn/N), scaled by 1/N
                           [-Wi, Wr]]         for the inverse transform)

Padding and truncation to ``dft_length``, ``onesided`` (the first ``N // 2 + 1`` bins), the inverse
scale and an STFT window known at import are all folded into that matrix. Everything is built from
``Transpose``, ``Slice``, ``Reshape``, ``Gather``, ``Mul`` and ``MatMul`` nodes through the other
handlers, so the ops get compute definitions, sharding rules and kernels like any other.

As the specification says (and the ONNX reference computes):

* ``DFT`` with ``onesided=1`` is a real-to-complex transform (RFFT) when forward and a one-sided
  complex-to-real transform (IRFFT, default ``dft_length = 2 * (n - 1)``, output ``[..., 1]``) when
  inverse; a complex input to the first or a real one to the second is refused;
* ``STFT`` defaults to ``onesided=1``, which a complex signal cannot have;
* ``dft_length``, ``axis``, ``frame_step`` and ``frame_length`` must be known at import.
"""
from __future__ import annotations

import logging

import numpy as np

from ..ir.expr import numpy_type
from ..ir.graph import Tensor
from .registry import FLOATS, REQUIRED, NodeContext, onnx_dtype, onnx_op

_OPSET = 13  # of the nodes emitted
_LARGE_MATRIX_BYTES = 64 << 20

log = logging.getLogger(__name__)


# helpers -------------------------------------------------------------------------------------
def _scalar(ctx: NodeContext, i: int, what: str, default: int | object = REQUIRED) -> int:
    """Input ``i``, an integer scalar known at import (``default`` when it is left out)."""
    if not ctx.has_input(i) and default is not REQUIRED:
        return default
    arr = np.asarray(ctx.const(i))
    if arr.size != 1 or arr.dtype.kind not in "iu":
        raise ctx.invalid(f"{what} must be one integer, got {arr.dtype} of shape {list(arr.shape)}")
    return int(arr.ravel()[0])


def _signal(ctx: NodeContext) -> tuple[Tensor, int]:
    """The input signal and its number of components (1: real, 2: complex)."""
    x = ctx.input(0)
    if x.dtype not in FLOATS:
        raise ctx.unsupported(f"input type {x.dtype} ({', '.join(FLOATS)} are)")
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise ctx.shape_error(f"the input of shape {list(x.shape)} is neither real [..., 1] nor complex [..., 2]")
    return x, x.shape[-1]


def _phase(n: np.ndarray, k: np.ndarray, length: int) -> np.ndarray:
    """``2π·n·k / length`` (float64) with ``n·k`` reduced modulo ``length`` first, for exact tables."""
    return 2.0 * np.pi * (np.multiply.outer(n, k) % length) / length


def dft_matrix(rows: int, comps: int, bins: int, length: int, inverse: bool,
               window: np.ndarray | None = None) -> np.ndarray:
    """The real ``[rows * comps, bins * 2]`` matrix of a complex DFT of ``length`` points.

    Row ``n * comps + c`` takes component ``c`` (real, imaginary) of sample ``n``; column ``k * 2 + d``
    gives component ``d`` of bin ``k``. Samples ``n >= rows`` (zero padding) have no rows; the inverse
    transform carries the ``1 / length`` scale and ``window[n]`` (if given) weights sample ``n``.
    """
    ang = _phase(np.arange(rows), np.arange(bins), length)
    scale = 1.0 / length if inverse else 1.0
    wr, wi = np.cos(ang) * scale, np.sin(ang) * (scale if inverse else -scale)
    if window is not None:
        wr, wi = wr * window[:rows, None], wi * window[:rows, None]
    m = np.empty((rows, comps, bins, 2))
    m[:, 0, :, 0], m[:, 0, :, 1] = wr, wi
    if comps == 2:
        m[:, 1, :, 0], m[:, 1, :, 1] = -wi, wr
    return m.reshape(rows * comps, bins * 2)


def irfft_matrix(rows: int, length: int) -> np.ndarray:
    """The real ``[rows * 2, length]`` matrix of a one-sided complex-to-real inverse DFT (numpy's
    ``irfft``): bin ``k < rows`` (``rows <= length // 2 + 1``) counts twice for its mirror image, except
    bin 0 and, for an even ``length``, bin ``length / 2``; their imaginary parts drop out."""
    k = np.arange(rows)
    weight = np.where((k == 0) | (2 * k == length), 1.0, 2.0) / length
    ang = _phase(k, np.arange(length), length)
    m = np.empty((rows, 2, length))
    m[:, 0, :] = np.cos(ang) * weight[:, None]
    m[:, 1, :] = -np.sin(ang) * weight[:, None]
    return m.reshape(rows * 2, length)


def _reshape(ctx: NodeContext, x: Tensor, shape) -> Tensor:
    return ctx.emit("Reshape", [x, ctx.constant(np.array(shape, np.int64))], _OPSET)


def _apply(ctx: NodeContext, x: Tensor, axis: int, rows: int, matrix: np.ndarray, comps_out: int) -> Tensor:
    """Transform axis ``axis`` of ``x`` (``[..., n, ..., comps]``) by ``matrix`` (``[rows * comps,
    bins * comps_out]``, from :func:`dft_matrix` or :func:`irfft_matrix`) reading its first ``rows``
    samples; the result has ``bins`` entries on ``axis`` and ``comps_out`` components."""
    last = x.ndim - 1
    perm = [d for d in range(last) if d != axis] + [axis, last]
    if perm != list(range(x.ndim)):
        x = ctx.emit("Transpose", [x], _OPSET, perm=perm)
    if x.shape[-2] > rows:
        x = ctx.emit("Slice", [x, *(ctx.constant(np.array([v], np.int64)) for v in (0, rows, last - 1))], _OPSET)
    lead = list(x.shape[:-2])
    nbytes = matrix.size * numpy_type(x.dtype).itemsize
    if nbytes > _LARGE_MATRIX_BYTES:
        log.warning("node %s: the transform matrix %s takes %.0f MiB (a DFT of static length costs O(N^2))",
                    ctx.name, list(matrix.shape), nbytes / 2**20)
    flat = _reshape(ctx, x, [int(np.prod(lead, dtype=np.int64)), matrix.shape[0]])
    y = ctx.emit("MatMul", [flat, ctx.constant(matrix.astype(x.dtype))], _OPSET)
    y = _reshape(ctx, y, lead + [matrix.shape[1] // comps_out, comps_out])
    if perm != list(range(x.ndim)):
        y = ctx.emit("Transpose", [y], _OPSET, perm=[int(p) for p in np.argsort(perm)])
    return y


# DFT -----------------------------------------------------------------------------------------
def _dft(ctx: NodeContext, axis: int) -> list[Tensor]:
    x, comps = _signal(ctx)
    rank = x.ndim
    if not (-rank <= axis <= -2 or 0 <= axis <= rank - 2):
        raise ctx.invalid(f"axis {axis} is out of range for an input of rank {rank} (the last dimension holds "
                          "the real and imaginary parts)")
    axis %= rank
    inverse, onesided = ctx.flag("inverse", 0), ctx.flag("onesided", 0)
    n = x.shape[axis]
    length = _scalar(ctx, 1, "dft_length", 2 * (n - 1) if inverse and onesided else n)
    if length < 1:
        raise ctx.invalid(f"dft_length must be positive, got {length}")
    if onesided and inverse:
        if comps != 2:
            raise ctx.invalid("an inverse one-sided DFT (IRFFT) needs a complex input [..., 2]")
        rows = min(n, length // 2 + 1)
        return [_apply(ctx, x, axis, rows, irfft_matrix(rows, length), 1)]
    if onesided and comps != 1:
        raise ctx.invalid("a forward one-sided DFT (RFFT) needs a real input [..., 1]")
    rows = min(n, length)
    bins = length // 2 + 1 if onesided else length
    return [_apply(ctx, x, axis, rows, dft_matrix(rows, comps, bins, length, inverse), 2)]


@onnx_op("DFT", since=17, until=19)
def dft17(ctx):
    return _dft(ctx, int(ctx.attr("axis", 1)))


@onnx_op("DFT", since=20)
def dft20(ctx):
    return _dft(ctx, _scalar(ctx, 2, "axis", -2))


# STFT ----------------------------------------------------------------------------------------
@onnx_op("STFT", since=17)
def stft(ctx):
    x, comps = _signal(ctx)
    if x.ndim != 3:
        raise ctx.shape_error(f"the signal must have rank 3 [batch, length, 1 or 2], got {list(x.shape)}")
    onesided = ctx.flag("onesided", 1)
    if onesided and comps == 2:
        raise ctx.invalid("a complex signal has no one-sided STFT (onesided defaults to 1; set it to 0)")
    step = _scalar(ctx, 1, "frame_step")
    if step < 1:
        raise ctx.invalid(f"frame_step must be positive, got {step}")
    window = ctx.input(2) if ctx.has_input(2) else None
    if window is not None and (window.ndim != 1 or window.dtype != x.dtype):
        raise ctx.invalid(f"the window must be a 1-D tensor of the signal's type {x.dtype}, got {window.dtype} "
                          f"of shape {list(window.shape)}")
    signal_len = x.shape[1]
    frame = _scalar(ctx, 3, "frame_length", window.shape[0] if window is not None else signal_len)
    if window is not None and window.shape[0] != frame:
        raise ctx.invalid(f"the window has {window.shape[0]} entries but frame_length is {frame}")
    if not 1 <= frame <= signal_len:
        raise ctx.shape_error(f"frame_length {frame} must be between 1 and the signal length {signal_len}")
    frames = (signal_len - frame) // step + 1
    if frame < signal_len:
        starts = np.arange(frames, dtype=np.int64)[:, None] * step
        x = ctx.emit("Gather", [x, ctx.constant(starts + np.arange(frame, dtype=np.int64))], _OPSET, axis=1)
    else:
        x = _reshape(ctx, x, [x.shape[0], 1, frame, comps])
    weights = None
    if window is not None and window.value is not None:
        weights = np.asarray(window.value, np.float64)
    elif window is not None:
        x = ctx.emit("Mul", [x, _reshape(ctx, window, [1, 1, frame, 1])], _OPSET)
    bins = frame // 2 + 1 if onesided else frame
    return [_apply(ctx, x, 2, frame, dft_matrix(frame, comps, bins, frame, False, weights), 2)]


# MelWeightMatrix -------------------------------------------------------------------------------
def mel_weight_matrix(num_mel_bins: int, dft_length: int, sample_rate: np.ndarray, lower_edge_hertz: np.ndarray,
                      upper_edge_hertz: np.ndarray) -> np.ndarray | None:
    """The ``[dft_length // 2 + 1, num_mel_bins]`` matrix of triangular mel filters, in float64, computed in
    the order of the ONNX reference's operations (the band edges are truncated to spectrogram bins, so they
    follow its numpy types: the 0-d arrays given as inputs); ``None`` when an edge falls outside the bins."""
    bins = dft_length // 2 + 1
    f = np.arange(0, num_mel_bins + 2)
    low_mel = 2595 * np.log1p(lower_edge_hertz / 700) / np.log(10)
    high_mel = 2595 * np.log1p(upper_edge_hertz / 700) / np.log(10)
    f = f * ((high_mel - low_mel) / f.shape[0]) + low_mel
    f = 700 * np.expm1(f / 2595 * np.log(10))
    edges = (((dft_length + 1) * f) // sample_rate).astype(np.int64)
    if edges.min() < 0 or edges.max() >= bins:
        return None
    out = np.zeros((bins, num_mel_bins))
    for i in range(num_mel_bins):
        lo, mid, hi = (int(e) for e in edges[i:i + 3])
        if mid == lo:
            out[mid, i] = 1.0
        else:
            out[lo:mid + 1, i] = (np.arange(lo, mid + 1) - lo) / float(mid - lo)
        if hi > mid:
            out[mid:hi, i] = (hi - np.arange(mid, hi)) / float(hi - mid)
    return out


@onnx_op("MelWeightMatrix", since=17)
def mel_weight_matrix_(ctx):
    """A constant: all five inputs must be known at import."""
    n_mel, length = _scalar(ctx, 0, "num_mel_bins"), _scalar(ctx, 1, "dft_length")
    rate = np.asarray(ctx.const(2))
    lo, hi = np.asarray(ctx.const(3)), np.asarray(ctx.const(4))
    if rate.size != 1 or rate.dtype.kind not in "iu":
        raise ctx.invalid(f"sample_rate must be one integer, got {rate.dtype} of shape {list(rate.shape)}")
    for what, v in (("lower_edge_hertz", lo), ("upper_edge_hertz", hi)):
        if v.size != 1 or v.dtype.kind != "f":
            raise ctx.invalid(f"{what} must be one float, got {v.dtype} of shape {list(v.shape)}")
    if n_mel < 1 or length < 1 or int(rate.ravel()[0]) < 1:
        raise ctx.invalid(f"num_mel_bins ({n_mel}), dft_length ({length}) and sample_rate "
                          f"({int(rate.ravel()[0])}) must be positive")
    if not 0 <= float(lo.ravel()[0]) < float(hi.ravel()[0]):
        raise ctx.invalid(f"the edges must satisfy 0 <= lower_edge_hertz < upper_edge_hertz, got "
                          f"{float(lo.ravel()[0])} and {float(hi.ravel()[0])}")
    m = mel_weight_matrix(n_mel, length, rate.reshape(()), lo.reshape(()), hi.reshape(()))
    if m is None:
        raise ctx.invalid(f"the filters' edges fall outside the {length // 2 + 1} spectrogram bins (upper_edge_hertz "
                          f"{float(hi.ravel()[0])} above sample_rate / 2?)")
    dtype = onnx_dtype(int(ctx.attr("output_datatype", 1)), f"node {ctx.name} attribute 'output_datatype'")
    return [ctx.constant(m.astype(dtype))]
