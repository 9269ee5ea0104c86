"""Handlers for linear algebra, convolution, pooling and resize ONNX ops.

Window geometry (``auto_pad``, ``pads``, ``output_shape``...) is resolved here, so the ops see
explicit per-dim strides, dilations and pads.
"""
from __future__ import annotations

import math

import numpy as np

from ..ops.conv import Conv, ConvTranspose, GlobalPool, Pool, Resize
from ..ops.elementwise import Identity
from ..ops.linalg import Attention, Det, Einsum, Gemm, MatMul, MatMulInteger, QLinearMatMul
from ..ops.transform import Concat, Reshape, Transpose
from .registry import FLOATS, onnx_dtype, onnx_op

_AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _same_dtype(ctx, *ts):
    dts = {t.dtype for t in ts if t is not None}
    if len(dts) > 1:
        raise ctx.invalid(f"inputs have different dtypes ({', '.join(sorted(dts))})")


# matmul family ---------------------------------------------------------------------------------

@onnx_op("MatMul")
def matmul(ctx):
    a, b = ctx.input(0), ctx.input(1)
    _same_dtype(ctx, a, b)
    return [ctx.add(MatMul([a, b], name=ctx.name))]


@onnx_op("Gemm")
def gemm(ctx):
    a, b = ctx.input(0), ctx.input(1)
    c = ctx.inputs[2] if ctx.has_input(2) else None
    _same_dtype(ctx, a, b, c)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    if a.dtype not in FLOATS and not (alpha.is_integer() and beta.is_integer()):
        raise ctx.unsupported(f"non-integral alpha={alpha} or beta={beta} with {a.dtype} inputs")
    ta, tb = ctx.flag("transA", 0), ctx.flag("transB", 0)
    if c is not None and ctx.opset < 7 and not ctx.flag("broadcast", 0) and a.ndim == b.ndim == 2:
        m, n = a.shape[1 if ta else 0], b.shape[0 if tb else 1]
        if c.shape != (m, n):
            raise ctx.shape_error(f"C of shape {c.shape} must be exactly ({m}, {n}) when broadcast=0")
    ins = [a, b] + ([c] if c is not None else [])
    return [ctx.add(Gemm(ins, name=ctx.name, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb))]


@onnx_op("Det", since=11)
def det(ctx):
    x = ctx.input(0)
    if x.dtype not in ("float16", "float32", "float64"):
        raise ctx.unsupported(f"Det of {x.dtype} (float16, float32 and float64 are)")
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise ctx.shape_error(f"X must be square matrices [..., M, M], got shape {list(x.shape)}")
    return [ctx.add(Det([x], name=ctx.name))]


@onnx_op("Einsum", since=12)
def einsum(ctx):
    ins = [ctx.input(i) for i in range(ctx.num_inputs)]
    if not ins:
        raise ctx.invalid("needs at least one input")
    _same_dtype(ctx, *ins)
    eq = ctx.attr("equation")
    if not isinstance(eq, str) or not eq.strip():
        raise ctx.invalid(f"equation must be a non-empty string, got {eq!r}")
    return [ctx.add(Einsum(ins, name=ctx.name, equation=eq.replace(" ", "")))]


def _int8(ctx, *ts):
    for t in ts:
        if t is not None and t.dtype not in ("int8", "uint8"):
            raise ctx.unsupported(f"{t.dtype} operand (int8/uint8 expected)")


@onnx_op("MatMulInteger", since=10)
def matmul_integer(ctx):
    a, b = ctx.input(0), ctx.input(1)
    azp = ctx.inputs[2] if ctx.has_input(2) else None
    bzp = ctx.inputs[3] if ctx.has_input(3) else None
    _int8(ctx, a, b, azp, bzp)
    for zp, t in ((azp, a), (bzp, b)):
        if zp is not None and zp.dtype != t.dtype:
            raise ctx.invalid(f"zero point dtype {zp.dtype} differs from its operand's {t.dtype}")
    ins = [a, b] + [t for t in (azp, bzp) if t is not None]
    return [ctx.add(MatMulInteger(ins, name=ctx.name, has_azp=azp is not None))]


@onnx_op("QLinearMatMul", since=10)
def qlinear_matmul(ctx):
    ins = [ctx.input(i) for i in range(8)]
    a, a_s, azp, b, b_s, bzp, y_s, yzp = ins
    _int8(ctx, a, b, azp, bzp, yzp)
    if azp.dtype != a.dtype or bzp.dtype != b.dtype:
        raise ctx.invalid("zero points must have their operand's dtype")
    if any(t.dtype not in FLOATS for t in (a_s, b_s, y_s)):
        raise ctx.invalid("scales must be floating point")
    return [ctx.add(QLinearMatMul(ins, name=ctx.name))]


# window geometry ---------------------------------------------------------------------------------

def _ints(ctx, name: str, n: int, default: int) -> tuple[int, ...]:
    v = ctx.attr(name, None)
    if v is None:
        return (default,) * n
    v = tuple(int(e) for e in v)
    if len(v) != n:
        raise ctx.invalid(f"{name}={list(v)} must have {n} values (one per spatial dim)")
    if name in ("strides", "dilations", "kernel_shape") and min(v, default=1) < 1:
        raise ctx.invalid(f"{name}={list(v)} must be positive")
    return v


def _auto_pad(ctx) -> str:
    ap = ctx.attr("auto_pad", "NOTSET")
    if ap not in _AUTO_PADS:
        raise ctx.invalid(f"auto_pad must be one of {', '.join(_AUTO_PADS)}, got {ap!r}")
    return ap


def _explicit_pads(ctx, n: int) -> tuple[int, ...]:
    pads = ctx.attr("pads", None)
    if pads is None:
        return (0,) * (2 * n)
    pads = tuple(int(p) for p in pads)
    if len(pads) != 2 * n or min(pads, default=0) < 0:
        raise ctx.invalid(f"pads={list(pads)} must have {2 * n} non-negative values")
    return pads


def _forward_pads(ctx, ins, kernel, strides, dil) -> tuple[int, ...]:
    """Explicit ``(begins..., ends...)`` pads of a convolution or pooling window sweep."""
    n = len(ins)
    ap = _auto_pad(ctx)
    if ap == "VALID":
        return (0,) * (2 * n)
    if ap == "NOTSET":
        return _explicit_pads(ctx, n)
    begins, ends = [], []
    for d in range(n):
        out = -(-ins[d] // strides[d])
        total = max(0, (out - 1) * strides[d] + (kernel[d] - 1) * dil[d] + 1 - ins[d])
        small, big = total // 2, total - total // 2
        begins.append(small if ap == "SAME_UPPER" else big)
        ends.append(big if ap == "SAME_UPPER" else small)
    return tuple(begins + ends)


def _spatial_input(ctx, x, dtypes=FLOATS) -> int:
    """The number of spatial dims of ``x`` (``[N, C, spatial...]``), checking its dtype."""
    if x.ndim < 3:
        raise ctx.shape_error(f"input must be [N, C, spatial...], got shape {x.shape}")
    if x.dtype not in dtypes:
        raise ctx.unsupported(f"dtype {x.dtype}")
    return x.ndim - 2


# convolution -------------------------------------------------------------------------------------

def _conv_operands(ctx, operands=None, dtypes=FLOATS):
    """Conv/ConvTranspose: x, w, optional bias (the node's inputs, or ``operands``), spatial rank,
    kernel, strides and dilations, checked."""
    if operands is None:
        operands = ctx.input(0), ctx.input(1), (ctx.inputs[2] if ctx.has_input(2) else None)
    x, w, bias = operands
    _same_dtype(ctx, x, w, bias)
    n = _spatial_input(ctx, x, dtypes)
    if w.ndim != x.ndim:
        raise ctx.shape_error(f"weight of shape {w.shape} must have the input's rank {x.ndim}")
    kernel = _ints(ctx, "kernel_shape", n, 0) if ctx.has_attr("kernel_shape") else w.shape[2:]
    if tuple(kernel) != w.shape[2:]:
        raise ctx.shape_error(f"kernel_shape={list(kernel)} does not match the weight's shape {w.shape}")
    return x, w, bias, n, kernel, _ints(ctx, "strides", n, 1), _ints(ctx, "dilations", n, 1)


@onnx_op("Conv")
def conv(ctx):
    x, w, bias, n, kernel, strides, dil = _conv_operands(ctx)
    pads = _forward_pads(ctx, x.shape[2:], kernel, strides, dil)
    group = int(ctx.attr("group", 1))
    ins = [x, w] + ([bias] if bias is not None else [])
    return [ctx.add(Conv(ins, name=ctx.name, group=group, strides=strides, dilations=dil, pads=pads))]


@onnx_op("ConvTranspose")
def conv_transpose(ctx):
    x, w, bias, n, kernel, strides, dil = _conv_operands(ctx)
    out_pad = _ints(ctx, "output_padding", n, 0)
    bad = [d for d in range(n) if not 0 <= out_pad[d] < max(strides[d], dil[d])]
    if bad:  # (the spec's bound, which onnxruntime and PyTorch enforce: a larger one is a bad export)
        raise ctx.invalid(f"output_padding {list(out_pad)} must be at least 0 and less than the stride or the "
                          f"dilation of its axis (strides {list(strides)}, dilations {list(dil)})")
    ins_sp = x.shape[2:]
    natural = [strides[d] * (ins_sp[d] - 1) + out_pad[d] + (kernel[d] - 1) * dil[d] + 1 for d in range(n)]
    ap = _auto_pad(ctx)
    out_shape = ctx.attr("output_shape", None)
    if out_shape is not None:
        out_shape = tuple(int(v) for v in out_shape)
        if len(out_shape) == n + 2:  # some exporters give the full shape
            out_shape = out_shape[2:]
        if len(out_shape) != n:
            raise ctx.invalid(f"output_shape={list(out_shape)} must have {n} values")
    elif ap in ("SAME_UPPER", "SAME_LOWER"):
        out_shape = tuple(ins_sp[d] * strides[d] for d in range(n))
    if out_shape is not None:
        # the spec's equations: pads from the total padding, the odd one at the end for SAME_UPPER
        begins, ends = [], []
        for d in range(n):
            total = natural[d] - out_shape[d]
            small, big = total // 2, total - total // 2
            b = small if ap == "SAME_UPPER" else big
            begins.append(max(b, 0))
            ends.append(total - max(b, 0))
        pads = tuple(begins + ends)
    else:
        pads = _explicit_pads(ctx, n) if ap == "NOTSET" else (0,) * (2 * n)
        out_shape = tuple(natural[d] - pads[d] - pads[n + d] for d in range(n))
    if min(out_shape, default=1) < 1:
        raise ctx.shape_error(f"the output spatial shape {list(out_shape)} is empty")
    group = int(ctx.attr("group", 1))
    ins = [x, w] + ([bias] if bias is not None else [])
    return [ctx.add(ConvTranspose(ins, name=ctx.name, group=group, strides=strides, dilations=dil, pads=pads,
                                  output_shape=out_shape))]


# pooling ------------------------------------------------------------------------------------------

def _pool_attrs(ctx, x, dtypes=FLOATS) -> dict:
    n = _spatial_input(ctx, x, dtypes)
    if not ctx.has_attr("kernel_shape"):
        raise ctx.invalid("required attribute 'kernel_shape' is missing")
    kernel = _ints(ctx, "kernel_shape", n, 1)
    strides, dil = _ints(ctx, "strides", n, 1), _ints(ctx, "dilations", n, 1)
    ceil_mode = ctx.flag("ceil_mode", 0)
    pads = _forward_pads(ctx, x.shape[2:], kernel, strides, dil)
    return dict(kernel=kernel, strides=strides, dilations=dil, pads=pads, ceil_mode=ceil_mode)


@onnx_op("MaxPool")
def max_pool(ctx):
    x = ctx.input(0)
    attrs = _pool_attrs(ctx, x, FLOATS + ("int8", "uint8"))
    order = int(ctx.flag("storage_order", 0))
    if order not in (0, 1):
        raise ctx.invalid(f"storage_order must be 0 or 1, got {order}")
    with_indices = len(ctx.node.output) > 1 and bool(ctx.node.output[1])
    op = Pool([x], name=ctx.name, kind="max", with_indices=with_indices, storage_order=order, **attrs)
    ctx.add(op)
    return list(op.outputs)


@onnx_op("AveragePool")
def average_pool(ctx):
    x = ctx.input(0)
    attrs = _pool_attrs(ctx, x)
    cip = ctx.flag("count_include_pad", 0)
    return [ctx.add(Pool([x], name=ctx.name, kind="avg", count_include_pad=cip, **attrs))]


def _p(ctx) -> float:
    p = float(ctx.attr("p", 2))
    if p <= 0:
        raise ctx.invalid(f"p must be positive, got {p}")
    return int(p) if p.is_integer() else p


@onnx_op("LpPool")
def lp_pool(ctx):
    x = ctx.input(0)
    attrs = _pool_attrs(ctx, x)
    return [ctx.add(Pool([x], name=ctx.name, kind="lp", p=_p(ctx), **attrs))]


def _global(kind):
    def handler(ctx):
        x = ctx.input(0)
        _spatial_input(ctx, x)
        extra = {"p": _p(ctx)} if kind == "lp" else {}
        return [ctx.add(GlobalPool([x], name=ctx.name, kind=kind, **extra))]
    return handler


onnx_op("GlobalAveragePool")(_global("avg"))
onnx_op("GlobalMaxPool")(_global("max"))
onnx_op("GlobalLpPool")(_global("lp"))


# resize -------------------------------------------------------------------------------------------

_COORD_MODES = {"half_pixel": 11, "pytorch_half_pixel": 11, "align_corners": 11, "asymmetric": 11,
                "tf_crop_and_resize": 11, "tf_half_pixel_for_nn": 11, "half_pixel_symmetric": 19}
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _resize_op(ctx, x, *, mode, ctm, scales, sizes, roi=None, nearest_mode="floor", **extra):
    """Add a :class:`Resize` after checking the resolved per-dim ``scales`` and ``sizes``."""
    if mode not in ("nearest", "linear", "cubic"):
        raise ctx.invalid(f"mode must be nearest, linear or cubic, got {mode!r}")
    if mode != "nearest" and x.dtype not in FLOATS:
        raise ctx.unsupported(f"{mode} interpolation of {x.dtype} data")
    if any(not math.isfinite(s) or s <= 0 for s in scales):
        raise ctx.invalid(f"scales {list(scales)} must be positive")
    if min(sizes, default=1) < 1:
        raise ctx.unsupported(f"an empty output (sizes {list(sizes)})")
    return ctx.add(Resize([x], name=ctx.name, mode=mode, coordinate_transformation_mode=ctm,
                          scales=tuple(scales), sizes=tuple(sizes), roi=roi, nearest_mode=nearest_mode, **extra))


def _legacy_resize(ctx, x, scales: np.ndarray):
    """Upsample-7/9 and Resize-10: asymmetric coordinates; nearest truncates when upsampling and
    rounds up when downsampling (onnxruntime's behaviour for these opsets)."""
    mode = ctx.attr("mode", "nearest")
    scales = [float(s) for s in np.asarray(scales, np.float32).reshape(-1)]
    if len(scales) != x.ndim:
        raise ctx.shape_error(f"scales has {len(scales)} values for an input of rank {x.ndim}")
    sizes = [int(s * n) for s, n in zip(scales, x.shape)]
    changed = [s for s, n, o in zip(scales, x.shape, sizes) if not (o == n and math.isclose(s, 1.0))]
    nearest_mode = "floor"
    if mode == "nearest" and any(s < 1 for s in changed):
        if any(s > 1 for s in changed):
            raise ctx.unsupported("nearest resizing that upsamples some dims and downsamples others (opset < 11)")
        nearest_mode = "ceil"
    return [_resize_op(ctx, x, mode=mode, ctm="asymmetric", scales=scales, sizes=sizes, nearest_mode=nearest_mode)]


@onnx_op("Upsample", since=7, until=7)
def upsample7(ctx):
    return _legacy_resize(ctx, ctx.input(0), np.asarray(ctx.attr("scales")))


@onnx_op("Upsample", since=9, until=9)
def upsample9(ctx):
    return _legacy_resize(ctx, ctx.input(0), ctx.const(1))


@onnx_op("Resize", since=10, until=10)
def resize10(ctx):
    return _legacy_resize(ctx, ctx.input(0), ctx.const(1))


@onnx_op("Resize", since=11)
def resize(ctx):
    x = ctx.input(0)
    r = x.ndim
    mode = ctx.attr("mode", "nearest")
    ctm = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if ctm not in _COORD_MODES or ctx.opset < _COORD_MODES[ctm] or (ctm == "tf_half_pixel_for_nn" and ctx.opset >= 13):
        raise ctx.invalid(f"coordinate_transformation_mode {ctm!r} is not valid at opset {ctx.opset}")
    nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
    if nearest_mode not in _NEAREST_MODES:
        raise ctx.invalid(f"nearest_mode must be one of {', '.join(_NEAREST_MODES)}, got {nearest_mode!r}")
    axes = ctx.attr("axes", None)
    if axes is None:
        axes = list(range(r))
    else:
        axes = [int(a) + r if int(a) < 0 else int(a) for a in axes]
        if any(not 0 <= a < r for a in axes) or len(set(axes)) != len(axes):
            raise ctx.invalid(f"axes {ctx.attr('axes')} are not distinct dims of a rank-{r} input")
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    if policy not in ("stretch", "not_larger", "not_smaller"):
        raise ctx.invalid(f"keep_aspect_ratio_policy must be stretch, not_larger or not_smaller, got {policy!r}")

    scales_in = ctx.const(2) if ctx.has_input(2) else None
    sizes_in = ctx.const(3) if ctx.has_input(3) else None
    if scales_in is not None and scales_in.size == 0:
        scales_in = None
    if sizes_in is not None and sizes_in.size == 0:
        sizes_in = None
    if (scales_in is None) == (sizes_in is None):
        raise ctx.invalid("exactly one of scales and sizes must be given")
    given = scales_in if scales_in is not None else sizes_in
    given = given.reshape(-1)
    if given.size != len(axes):
        raise ctx.shape_error(f"{'scales' if scales_in is not None else 'sizes'} has {given.size} values for "
                              f"{len(axes)} resized dims")
    scales, sizes = [1.0] * r, list(x.shape)
    if scales_in is not None:
        for a, s in zip(axes, given.astype(np.float32)):
            scales[a], sizes[a] = float(s), int(float(s) * x.shape[a])
    else:
        for a, s in zip(axes, given.astype(np.int64)):
            sizes[a] = int(s)
            scales[a] = int(s) / x.shape[a] if x.shape[a] else 1.0
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            scale = pick(scales[a] for a in axes)
            for a in axes:
                scales[a], sizes[a] = scale, int(scale * x.shape[a] + 0.5)

    roi = None
    if ctm == "tf_crop_and_resize":
        roi_in = np.asarray(ctx.const(1), np.float64).reshape(-1)
        if roi_in.size != 2 * len(axes):
            raise ctx.shape_error(f"roi has {roi_in.size} values, expected {2 * len(axes)}")
        full = [0.0] * r + [1.0] * r
        for i, a in enumerate(axes):
            full[a], full[r + a] = float(roi_in[i]), float(roi_in[len(axes) + i])
        roi = tuple(full)
    extra = dict(antialias=ctx.flag("antialias", 0) and mode != "nearest",
                 cubic_coeff_a=float(ctx.attr("cubic_coeff_a", -0.75)),
                 exclude_outside=ctx.flag("exclude_outside", 0),
                 extrapolation_value=float(ctx.attr("extrapolation_value", 0.0)))
    return [_resize_op(ctx, x, mode=mode, ctm=ctm, scales=scales, sizes=sizes, roi=roi, nearest_mode=nearest_mode,
                       **extra)]


# attention ----------------------------------------------------------------------------------------

@onnx_op("Attention", since=23)
def attention(ctx):
    q, k, v = ctx.input(0), ctx.input(1), ctx.input(2)
    _same_dtype(ctx, q, k, v)
    if q.dtype not in FLOATS:
        raise ctx.unsupported(f"dtype {q.dtype}")
    mask = ctx.inputs[3] if ctx.has_input(3) else None
    past_k = ctx.inputs[4] if ctx.has_input(4) else None
    past_v = ctx.inputs[5] if ctx.has_input(5) else None
    nonpad = ctx.inputs[6] if ctx.has_input(6) else None
    if (past_k is None) != (past_v is None):
        raise ctx.invalid("past_key and past_value must be given together")
    if nonpad is not None and past_k is not None:
        raise ctx.invalid("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    if mask is not None and mask.dtype not in ("bool", q.dtype):
        raise ctx.invalid(f"attn_mask must be bool or {q.dtype}, got {mask.dtype}")
    if nonpad is not None and nonpad.dtype != "int64":
        raise ctx.invalid(f"nonpad_kv_seqlen must be int64, got {nonpad.dtype}")
    if not (q.ndim == k.ndim == v.ndim) or q.ndim not in (3, 4):
        raise ctx.shape_error(f"Q, K and V must all be 3-D or all 4-D, got {q.shape}, {k.shape}, {v.shape}")
    qh, kvh = ctx.attr("q_num_heads", None), ctx.attr("kv_num_heads", None)
    if q.ndim == 3 and (not qh or not kvh):
        raise ctx.invalid("3-D inputs need the q_num_heads and kv_num_heads attributes")
    if q.ndim == 4 and ctx.opset >= 25 and (qh is not None or kvh is not None):
        raise ctx.invalid("q_num_heads and kv_num_heads must not be given with 4-D inputs")
    if q.ndim == 3 and (q.shape[2] % qh or k.shape[2] % kvh or v.shape[2] % kvh):
        raise ctx.shape_error(f"hidden sizes {q.shape[2]}, {k.shape[2]}, {v.shape[2]} are not divisible by the "
                              f"head counts ({qh}, {kvh})")
    head = q.shape[3] if q.ndim == 4 else q.shape[2] // qh
    scale = float(ctx.attr("scale", 1.0 / math.sqrt(head)))
    mode = int(ctx.attr("qk_matmul_output_mode", 0))
    if mode not in (0, 1, 2, 3):
        raise ctx.invalid(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {mode}")
    left, right = int(ctx.attr("left_window_size", -1)), int(ctx.attr("right_window_size", -1))
    if left < -1 or right < -1:
        raise ctx.invalid(f"window sizes must be -1 or non-negative, got {left} and {right}")
    sp = ctx.attr("softmax_precision", None)
    sdt = onnx_dtype(sp, f"node {ctx.name} attribute softmax_precision") if sp is not None else None
    if sdt is not None and sdt not in FLOATS:
        raise ctx.invalid(f"softmax_precision must be a floating-point type, got {sdt}")
    wants = [i < len(ctx.node.output) and bool(ctx.node.output[i]) for i in range(4)]

    def as4d(t, heads, what):
        if t.ndim == 4:
            return t
        b, n, hid = t.shape
        r = ctx.add(Reshape([t], name=f"{ctx.name}/{what}_heads", shape=(b, n, heads, hid // heads)))
        return ctx.add(Transpose([r], name=f"{ctx.name}/{what}_bhsd", perm=(0, 2, 1, 3)))

    presents = []
    for t, past, what in ((k, past_k, "key"), (v, past_v, "value")):
        if past is not None:
            presents.append(ctx.add(Concat([past, as4d(t, kvh, what)], name=f"{ctx.name}/present_{what}", axis=2)))
        elif wants[1 if what == "key" else 2]:
            t4 = as4d(t, kvh, what)
            presents.append(t4 if t4 is not t else ctx.add(Identity([t], name=f"{ctx.name}/present_{what}")))
        else:
            presents.append(None)
    k_in = presents[0] if past_k is not None else k
    v_in = presents[1] if past_v is not None else v
    ins = [q, k_in, v_in] + [t for t in (mask, nonpad) if t is not None]
    op = Attention(ins, name=ctx.name, q_heads=qh, kv_heads=kvh, scale_sqrt=math.sqrt(scale), scale=scale,
                   is_causal=ctx.flag("is_causal", 0), past_len=past_k.shape[2] if past_k is not None else 0,
                   softcap=float(ctx.attr("softcap", 0.0)), has_mask=mask is not None, has_nonpad=nonpad is not None,
                   left_window=left, right_window=right, qk_mode=mode if wants[3] else None,
                   softmax_dtype=None if sdt == q.dtype else sdt)
    ctx.add(op)
    return [op.outputs[0], presents[0], presents[1], op.outputs[1] if wants[3] else None]
