"""Channels-last convolutions for the cuda target on Hopper (RFC 0005 decision 57).

The wgmma GEMM template copies its operands 16 bytes (8 half values) at a time. An NCHW image read
through a convolution's window has no such runs: along ``w`` a tap shifts the row by one element
(the copy would not be 16-byte aligned), along ``c`` the values are ``H * W`` apart. So every conv
with a window wider than 1x1, a stride, padding, or ``H * W`` not a multiple of 8 took the portable
``wmma`` template. :class:`ChannelsLastConvs` gives such a conv:

* its image copied channels-last, ``[N, *spatial, C]`` (a Transpose whose output the cuda target
  writes, :func:`channels_last_copy`: one copy per image, shared by the convs that read it; the
  image's cast to the half type fuses into the copy), read through a Transpose back to
  ``[N, C, *spatial]`` that fuses into the conv's kernel; where ``C`` is not a multiple of 8 (a
  model's first conv, of 3 or 4 channels), the copy has zero channels after the image's up to the
  next multiple (the products by them add nothing);
* its weight stored ``[OC, *kernel, C]`` at compile time (zeros in the channels added), read
  through a Transpose back likewise.

The conv computes the same values (the graph is equivalent op for op); its kernel now reads runs
of 8 channels at each tap, which :func:`shardflow.compiler.codegen.cuda._gather_operand` turns into
the template's gathered operand (K in the order ``(*kernel, C)``, a tap in the padding copied as
zeros). The output stays ``[N, OC, *spatial]`` (the template stores four consecutive pixels at a
time), unless a copy is its only reader: the cuda target's fusion then makes the conv's kernel
store its output channels-last (RFC 0005 decision 60). A grouped conv whose groups have multiples of
8 channels in and out (16 or more out) is such a conv too: the cuda target computes it as a product
per group, each gathering runs of its own channels (decision 62); depthwise convs, and groups of
fewer channels, are left as they are.

:class:`KeepChannelsLast` then keeps the values between such convs channels-last (the convs store
``[N, *spatial, C]``, the element-wise ops, pools and concatenations between them follow), so that
most copies are not needed at all (RFC 0005 decision 61).
``optimization_config["channels_last"] = False`` turns both passes off.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from .base import GraphPass, take_over

__all__ = ["ChannelsLastConvs", "KeepChannelsLast", "channels_last_copy", "channels_last_output",
           "channels_last_read"]

log = logging.getLogger(__name__)

_HALF = ("float16", "bfloat16")


def channels_last_copy(op: Operator) -> bool:
    """Whether ``op`` is an image's channels-last copy made by :class:`ChannelsLastConvs` (its
    output is written, not fused into the convs that read it)."""
    return op.op_type == "Transpose" and bool(op.attrs.get("channels_last"))


def _direct(op: Operator) -> bool:
    """A 1x1 conv, stride 1, no padding, over ``H * W`` a multiple of 8 pixels: the wgmma template
    reads its NCHW image as it is (RFC 0005 decision 55)."""
    x = op.inputs[0]
    k = op.inputs[1].shape[2:]
    return all(v == 1 for v in k) and all(s == 1 for s in op.attrs.get("strides") or ()) \
        and not any(op.attrs.get("pads") or ()) and math.prod(x.shape[2:]) % 8 == 0


def _gathered_in_nchw(op: Operator) -> bool:
    """A patch embedding (ViT's 16x16 windows at stride 16, no padding, ``W`` a multiple of 8):
    each window row is a run of a multiple of 8 values at a 16-byte aligned place of the NCHW image,
    which the wgmma template gathers as it is (RFC 0005 decision 57)."""
    x, kw = op.inputs[0], op.inputs[1].shape[-1]
    sw = (op.attrs.get("strides") or (1,) * (x.ndim - 2))[-1]
    dw = (op.attrs.get("dilations") or (1,) * (x.ndim - 2))[-1]
    pads = op.attrs.get("pads") or (0,) * (2 * (x.ndim - 2))
    return kw % 8 == 0 and sw % 8 == 0 and dw == 1 and pads[x.ndim - 3] == 0 and pads[-1] == 0 \
        and x.shape[-1] % 8 == 0


def _tiled_transpose(op: Operator) -> bool:
    """A transposed conv of non-overlapping windows (kernel = stride, no padding or dilation, one
    group, the output the input's extents times the stride) of multiples of 8 channels in and out:
    the cuda target computes it as one product (RFC 0005 decision 65), which reads a channels-last
    image as the matrix ``[N * H * W, C]`` and, with its weight stored ``[C, *kernel, OC]``, stores
    its output channels-last four channels at a time (decision 67)."""
    return op.op_type == "ConvTranspose" and int(op.attrs.get("group", 1)) == 1 and len(op.inputs) >= 2 \
        and op.inputs[0].ndim >= 3 and op.inputs[0].shape[1] % 8 == 0 and op.outputs[0].shape[1] % 8 == 0 \
        and op.tiles_output()


def _depthwise(op: Operator) -> bool:
    """A depthwise conv (one input channel a group): each output channel's window reads its own
    channel, so its kernel (not a product) reads and writes channels-last values as well as NCHW
    ones (RFC 0005 decision 68)."""
    if op.op_type != "Conv" or type(op).__name__ != "Conv" or len(op.inputs) < 2 or op.inputs[0].ndim < 3 \
            or op.attrs.get("blocked_in") or op.attrs.get("blocked_out"):
        return False
    groups = int(op.attrs.get("group", 1))
    return groups > 1 and groups == op.inputs[0].shape[1] and op.inputs[1].shape[1] == 1


def _half_operands(op: Operator, producer: dict, readers: dict) -> tuple[tuple, tuple] | None:
    """For a conv the wgmma template computes from half operands (a constant weight, at least 16
    output channels a group and 16 output pixels; a grouped conv's channels a group multiples of
    8: each group's product gathers runs of 8 of its own channels, RFC 0005 decision 62): the
    (half image, its float32 cast or None) and (half weight, cast or None) behind its operands;
    else None. The precision pass's form reads a half value through a ``Cast`` to float32 that
    only this conv reads. (A :func:`_tiled_transpose` too, its weight ``[C, OC, *kernel]``.)"""
    if not (op.op_type == "Conv" and type(op).__name__ == "Conv" or _tiled_transpose(op)) \
            or op.attrs.get("blocked_in") or op.attrs.get("blocked_out") or len(op.inputs) < 2:
        return None
    groups = int(op.attrs.get("group", 1))
    if groups != 1 and (op.inputs[0].shape[1] // groups % 8 or op.outputs[0].shape[1] // groups % 8):
        return None

    def half_source(t: Tensor):
        if t.dtype in _HALF:
            return t, None
        p = producer.get(id(t))
        if p is not None and p.op_type == "Cast" and p.inputs[0].dtype in _HALF and len(readers.get(id(t), ())) == 1:
            return p.inputs[0], p
        return None

    def constant(t: Tensor) -> bool:  # (or the [OC, *kernel, C] weight of a channels-last conv)
        p = producer.get(id(t))
        return t.is_constant or (p is not None and p.op_type == "Transpose" and p.inputs[0].is_constant)

    x, y = op.inputs[0], op.outputs[0]
    sx, sw = half_source(x), half_source(op.inputs[1])
    if sx is None or sw is None or not constant(sw[0]) or x.ndim < 3 or y.shape[1] // groups < 16 \
            or y.shape[0] * math.prod(y.shape[2:]) < 16:
        return None
    return sx, sw


def _readers(graph: FlowGraph) -> dict[int, list[Operator]]:
    """``id(tensor)`` -> the ops that read it (each once)."""
    readers: dict[int, list[Operator]] = {}
    for op in graph.nodes:
        for t in {id(t): t for t in op.inputs}.values():
            readers.setdefault(id(t), []).append(op)
    return readers


class ChannelsLastConvs(GraphPass):
    """Convs of half images by a constant weight (:func:`_half_operands`) that the wgmma template
    cannot read in NCHW: the image copied channels-last (its channels padded with zeros to a
    multiple of 8; a grouped conv's are), the weight stored ``[OC, *kernel, C / group]`` (module
    docstring). Run after the precision pass: the image
    is a half tensor, read directly or through a ``Cast`` to float32 that only this conv reads (the
    precision pass's form), and so is the weight (a constant)."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        producer = {id(t): op for op in graph.nodes for t in op.outputs}
        readers = _readers(graph)
        before: dict[int, list[Operator]] = {}  # id(op) -> new ops to place just before it
        replaced: dict[int, Operator] = {}  # id(conv) -> the conv that takes over its output
        dropped: set[int] = set()  # the float32 casts of the convs' operands (replaced too)
        copies: dict[int, Tensor] = {}  # id(image) -> its channels-last copy
        weights: dict[int, Tensor] = {}  # id(weight) -> its values stored [OC, *kernel, C]

        for op in graph.nodes:
            found = _half_operands(op, producer, readers)
            if found is None or op.op_type != "Conv" or _direct(op) or _gathered_in_nchw(op):
                continue  # (a transposed conv reads its NCHW image as it is: KeepChannelsLast's)
            sx, sw = found
            x = op.inputs[0]
            nd = x.ndim
            img, wt = sx[0], sw[0]
            extra = -x.shape[1] % 8  # zero channels that make runs of 8 (a model's first conv: 3 or 4)
            if id(img) not in copies:
                src, ops = img, []
                if extra:
                    ops.append(_pad_channels(img, extra))
                    src = ops[-1].outputs[0]
                ops.append(_transpose(src, (0, *range(2, nd), 1), f"{img.name}.channels_last", channels_last=True))
                before.setdefault(id(op), []).extend(ops)  # (before the first conv that reads it)
                copies[id(img)] = ops[-1].outputs[0]
            if id(wt) not in weights:
                value = np.moveaxis(np.asarray(wt.value), 1, -1)
                value = np.pad(value, [(0, 0)] * (nd - 1) + [(0, extra)])
                weights[id(wt)] = const_tensor(np.ascontiguousarray(value), f"{wt.name}.ohwi")
            back = (0, nd - 1, *range(1, nd - 1))
            new, inputs = [], list(op.inputs)
            for src, (_, cast), k in ((copies[id(img)], sx, 0), (weights[id(wt)], sw, 1)):
                new.append(_transpose(src, back, f"{op.name}.in{k}.nchw", nchw=k == 0))
                if cast is not None:  # (a new cast: the operand may have more channels than before)
                    new.append(type(cast)([new[-1].outputs[0]], name=cast.name, **cast.attrs))
                    dropped.add(id(cast))
                inputs[k] = new[-1].outputs[0]
            before.setdefault(id(op), []).extend(new)
            replaced[id(op)] = take_over(op, type(op)(inputs, name=op.name, **op.attrs), "channels-last conv")
        if replaced:
            nodes: list[Operator] = []
            for op in graph.nodes:
                nodes.extend(before.get(id(op), []))
                if id(op) not in dropped:
                    nodes.append(replaced.get(id(op), op))
            graph.nodes = nodes
            log.info("cuda: %d convs read channels-last copies of %d images", len(replaced), len(copies))
        return graph


def channels_last_output(op: Operator) -> bool:
    """Whether ``op`` is the transpose by which :class:`KeepChannelsLast` makes a conv write its
    output channels-last (the conv's kernel stores it so; element-wise ops after it join that
    kernel as usual)."""
    return op.op_type == "Transpose" and bool(op.attrs.get("nhwc"))


def channels_last_read(op: Operator) -> bool:
    """Whether ``op`` is the transpose through which a conv (or the precision pass's float32 cast
    before one) reads a channels-last image as NCHW: it is computed in the conv's kernel (which
    gathers the channels-last values), never in the kernel that writes the image."""
    return op.op_type == "Transpose" and bool(op.attrs.get("nchw"))


#: ops that compute each output element from a window of their image (the same NCHW op between a
#: transpose back and one forward: the kernel reads and writes channels-last)
_SPATIAL = ("Pool", "Resize")
#: element-wise ops that compute the same in any layout of their operands
_LAYOUT_FREE = ("Unary", "Activation", "Binary", "Cast", "Where", "Clip", "Identity")


class KeepChannelsLast(GraphPass):
    """Activations kept channels-last between convs (RFC 0005 decision 61). Run after
    :class:`ChannelsLastConvs`.

    A conv the wgmma template computes stores its output ``[N, *spatial, C]`` (a transpose of its
    NCHW result, :func:`channels_last_output`, which the cuda target fuses as the GEMM's
    epilogue), and the ops after it run on the channels-last values: element-wise ops (ReLU, a
    residual add, casts, a per-channel scale: constants are transposed at compile time, other
    operands of the same rank read through a transpose; a BatchNorm no conv took, as a per-channel
    affine map), pools and resizes (their kernels read and write channels-last) and
    concatenations (along the axis where theirs is now). Where a conv reads such a value it
    gathers it as it is (the image's channels-last copy of :class:`ChannelsLastConvs` is dropped;
    a 1x1 conv reads it as the matrix ``[N * H * W, C]``), and a global pool reads it through a
    transpose in its kernel.

    A value some reader would read worse channels-last (a reshape, a graph output, a conv off the
    tensor cores, a collective, an element-wise op that stays NCHW) is written NCHW, as before
    this pass, and so, in turn, are the values only such ops lead to. Tensors connected by the ops
    above form a region; a region changes layout only when a conv reads it (a copy made
    needless). A ResNet's trunk, from its stem to its global pool, is one region: no copy kernel
    is left in it but the stem's image."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        producer = {id(t): op for op in graph.nodes for t in op.outputs}
        readers = _readers(graph)
        cands: dict[int, Operator] = {}  # id(NCHW tensor) -> the op writing it, if it may store it channels-last
        seeds = set()  # id(op): the convs among them
        for op in graph.nodes:
            y = op.outputs[0] if len(op.outputs) == 1 else None
            if y is None:
                continue
            if _half_operands(op, producer, readers) is not None and y.shape[1] % 8 == 0 \
                    and not _gathered_in_nchw(op) or _depthwise(op):
                seeds.add(id(op))
                cands[id(y)] = op
            elif (op.op_type in _LAYOUT_FREE and not _widening(op) and self._sinkable(op, cands)) \
                    or (op.op_type in _SPATIAL and len(op.inputs) == 1 and id(op.inputs[0]) in cands) \
                    or (op.op_type == "Concat" and any(id(t) in cands for t in op.inputs)
                        and all(t.ndim == y.ndim for t in op.inputs)) \
                    or (_affine_batch_norm(op) and id(op.inputs[0]) in cands):
                cands[id(y)] = op
        # an op whose output a reader would read worse channels-last (a reshape, a graph output...)
        # writes NCHW, and so, then, does one left without a channels-last input; until none is left
        outputs = {id(t) for t in graph.outputs}

        def reads(r: Operator, i: int) -> str | None:  # what r reading candidate i channels-last means
            follows = id(r) not in seeds and len(r.outputs) == 1 and cands.get(id(r.outputs[0])) is r
            return None if follows else self._reader(r, i, producer, readers)

        changed = True
        while changed:
            changed = False
            for i, op in list(cands.items()):
                if i in outputs or (id(op) not in seeds and not any(id(t) in cands for t in op.inputs)) \
                        or any(reads(r, i) == "lose" for r in readers.get(i, ())):
                    del cands[i]
                    changed = True
        parent = {i: i for i in cands}  # union-find: the regions that change layout together

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i, op in cands.items():
            for t in op.inputs:
                p = producer.get(id(t))
                if _depthwise(op) and id(t) not in parent and p is not None and _widening(p):
                    t = p.inputs[0]  # (its image through the precision pass's cast: one region)
                if id(t) in parent:
                    parent[root(id(t))] = root(i)
        gain: set[int] = set()
        for i in cands:
            if any(reads(r, i) == "gain" for r in readers.get(i, ())):
                gain.add(root(i))
        keep = {root(i) for i in cands} & gain
        if not keep:
            return graph

        twin: dict[int, Tensor] = {}  # id(NCHW tensor) -> its channels-last twin
        replace: dict[int, Tensor] = {}  # id(a dropped copy's output) -> the twin it copied
        consts: dict[int, Tensor] = {}
        nodes: list[Operator] = []
        moved = 0
        # a transposed conv that stores channels-last reads its weight stored [C, *kernel, OC] (the
        # product's columns (*kernel, OC) in the order of the output's), through a transpose back
        for i, op in cands.items():
            if op.op_type == "ConvTranspose" and root(i) in keep:
                wt = _half_operands(op, producer, readers)[1][0]
                if wt.is_constant and id(wt) not in replace:
                    nd = wt.ndim
                    value = np.ascontiguousarray(np.moveaxis(np.asarray(wt.value), 1, -1))
                    nodes.append(_transpose(const_tensor(value, f"{wt.name}.iohw"), (0, nd - 1, *range(1, nd - 1)),
                                            f"{wt.name}.oi"))
                    replace[id(wt)] = nodes[-1].outputs[0]

        def nchw(op: Operator) -> None:  # op's reads of twins through transposes back (one each)
            inputs = [replace.get(id(t), t) for t in op.inputs]
            for k, t in enumerate(inputs):
                if id(t) in twin:
                    nd = t.ndim
                    nodes.append(_transpose(twin[id(t)], (0, nd - 1, *range(1, nd - 1)), f"{op.name}.in{k}.nchw",
                                            nchw=op.op_type in ("Conv", "ConvTranspose") or _widening(op)))
                    inputs[k] = nodes[-1].outputs[0]
            op.inputs = inputs
            nodes.append(op)

        for op in graph.nodes:
            y = op.outputs[0]
            if id(y) in parent and root(id(y)) in keep:
                nd = y.ndim
                fwd = (0, *range(2, nd), 1)
                if id(op) in seeds or op.op_type in _SPATIAL:  # (its kernel reads and writes channels-last)
                    nchw(op)
                    nodes.append(_transpose(y, fwd, f"{y.name}.nhwc", nhwc=True))
                elif op.op_type == "BatchNorm":
                    nodes.extend(_batch_norm_nhwc(op, twin[id(op.inputs[0])]))
                    moved += 1
                else:
                    inputs = []
                    for k, t in enumerate(op.inputs):
                        if id(t) in twin:
                            inputs.append(twin[id(t)])
                        elif t.is_constant:
                            if id(t) not in consts:
                                full = np.reshape(np.asarray(t.value), (1,) * (nd - t.ndim) + tuple(t.shape))
                                consts[id(t)] = const_tensor(np.ascontiguousarray(np.transpose(full, fwd)),
                                                             f"{t.name}.nhwc")
                            inputs.append(consts[id(t)])
                        else:
                            nodes.append(_transpose(t, fwd, f"{op.name}.in{k}.nhwc"))
                            inputs.append(nodes[-1].outputs[0])
                    attrs = dict(op.attrs)
                    if op.op_type == "Concat":  # (the axis where it is now)
                        attrs["axis"] = fwd.index(attrs["axis"])
                    nodes.append(type(op)(inputs, name=f"{op.name}.nhwc", **attrs))
                    moved += 1
                twin[id(y)] = nodes[-1].outputs[0]
                continue
            if channels_last_copy(op) and id(op.inputs[0]) in twin:
                replace[id(y)] = twin[id(op.inputs[0])]
                continue
            nchw(op)
        graph.nodes = nodes
        log.info("cuda: %d convs store channels-last, %d element-wise ops follow, %d copies dropped",
                 sum(1 for op in nodes if channels_last_output(op)), moved, len(replace))
        return graph

    @staticmethod
    def _sinkable(op: Operator, cand: dict) -> bool:
        """An element-wise op reading a candidate, each one of the output's shape; its other
        operands constants (any broadcast) or tensors of the output's rank."""
        if len(op.outputs) != 1 or not any(id(t) in cand for t in op.inputs):
            return False
        y = op.outputs[0]
        return all(t.shape == y.shape if id(t) in cand else (t.is_constant and t.ndim <= y.ndim) or t.ndim == y.ndim
                   for t in op.inputs)

    @staticmethod
    def _reader(r: Operator, i: int, producer: dict, readers: dict) -> str:
        """What reading candidate ``i`` channels-last means for ``r``: ``"gain"`` (a copy made
        needless, or a 1x1 conv reading it as a matrix, possibly through the precision pass's cast
        to float32), ``"same"`` (a global pool reading it through a transpose) or ``"lose"``."""
        if channels_last_copy(r):
            return "gain"
        if r.op_type == "GlobalPool" or (r.op_type == "Pool" and all(d == 1 for d in r.outputs[0].shape[2:])):
            return "same"
        conv, t = r, r.outputs[0]
        if _widening(r) and len(readers.get(id(t), ())) == 1:
            conv = readers[id(t)][0]
        else:
            t = next(t for t in r.inputs if id(t) == i)
        if _depthwise(conv) and conv.inputs[0] is t:  # (its kernel reads the windows either way)
            return "same"
        if conv.inputs[0] is t and all(u is not t for u in conv.inputs[1:]) and t.shape[1] % 8 == 0 \
                and _half_operands(conv, producer, readers) is not None \
                and (_direct(conv) or conv.op_type == "ConvTranspose"):
            return "gain"
        return "lose"


def _affine_batch_norm(op: Operator) -> bool:
    """An inference BatchNorm of an image by constant parameters of one value per channel (one a
    conv's weights did not take, e.g. after a concatenation in a DenseNet), all of the image's
    type, float32 or float16 (the op computes in that type)."""
    return op.op_type == "BatchNorm" and len(op.inputs) == 5 and op.inputs[0].dtype in ("float32", "float16") \
        and op.inputs[0].ndim >= 3 and all(t.is_constant and t.ndim == 1 and t.dtype == op.inputs[0].dtype
                                           for t in op.inputs[1:])


def _batch_norm_nhwc(op: Operator, x: Tensor) -> list[Operator]:
    """``op`` (:func:`_affine_batch_norm`) on the channels-last image ``x``: ``(x - mean) * factor +
    bias``, the factor ``scale / sqrt(var + epsilon)`` computed at compile time in the op's type, as
    the op's kernel computes it (each step correctly rounded, as numpy's), so the values are the
    op's: three element-wise ops, each rounded to that type as the op's steps are."""
    from ..ops.elementwise import Binary

    dt = np.dtype(x.dtype)
    scale, bias, mean, var = (np.asarray(t.value, dt) for t in op.inputs[1:])
    factor = scale / np.sqrt(var + dt.type(op.attrs["epsilon"]))
    shape = (1,) * (x.ndim - 1) + (x.shape[-1],)
    res, v = [], x
    for fn, value, what in (("sub", mean, "mean"), ("mul", factor, "factor"), ("add", bias, "bias")):
        res.append(Binary([v, const_tensor(np.reshape(value, shape).astype(dt), f"{op.name}.{what}.nhwc")],
                          name=f"{op.name}.{fn}.nhwc", fn=fn))
        v = res[-1].outputs[0]
    return res


def _widening(op: Operator) -> bool:
    """The precision pass's cast of a half value to float32 for a product (it stays with the
    product: the product reads the half values)."""
    return op.op_type == "Cast" and op.attrs.get("to") == "float32" and op.inputs[0].dtype in _HALF

def _transpose(t: Tensor, perm: tuple[int, ...], name: str, **attrs) -> Operator:
    from ..ops.transform import Transpose

    return Transpose([t], name=name, perm=tuple(perm), **attrs)


def _pad_channels(t: Tensor, extra: int) -> Operator:
    """``t [N, C, *spatial]`` with ``extra`` channels of zeros after its own."""
    from ..ops.transform import Pad

    return Pad([t], name=f"{t.name}.pad{t.shape[1] + extra}", begin=(0,) * t.ndim,
               end=(0, extra) + (0,) * (t.ndim - 2), mode="constant", value=0.0)

