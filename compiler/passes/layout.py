"""The blocked layout between the convs of the cpu target.

A conv's kernel (``cpu_library/conv.h``, ``sf_conv2d_packed``) computes 16 output channels of a pixel
as one vector and reads its image blocked by 16 channels. In the plain layout ``[N, C, H, W]`` it
therefore blocks its image on entry and transposes its output on the way out, on every call; when
one conv feeds another, both passes are wasted. :class:`BlockedLayout` keeps such tensors in the
blocked layout ``[N, C / 16, H, W, 16]`` (:data:`~shardflow.compiler.ops.conv.BLOCK`): real 5-D
tensors of the graph, so shapes, buffers and fusion need nothing new.

Which tensors: a float32 4-D tensor of a multiple of 16 channels (not a graph output) is blocked when its
producer can write the layout and one of its readers reads it natively (both computed over the graph).
Writers and native readers are the 2-D convs of one group (or of groups of whole blocks of 16 channels) with a
constant weight and a row stride of 1 or 2
(they become :class:`~shardflow.compiler.ops.conv.PackedConv` with ``blocked_in`` / ``blocked_out``), the
:class:`~shardflow.compiler.ops.conv.WinogradConv` (its transforms read and write either layout), the 2-D
depthwise convs (``group = C = OC``; Convs with ``blocked_in`` / ``blocked_out``, their weights as they are:
``sf_conv_depthwise`` computes 16 channels of a pixel as one vector), and, when their output is blocked too,
max and average pools (a 3-D pool whose last window is one lane), concatenations of channels (the block
axis), slices of whole blocks of channels (the block axis sliced by blocks) and element-wise ops whose other
operands are blocked alike or constants of one value per channel (stored blocked, ``[1, C/16, 1, 1, 16]``) or
computed values of one value per channel (a squeeze and excitation's scale: viewed as ``[N, C/16, 1, 1, 16]``,
the same order), a BatchNorm of constant parameters as the three element-wise ops it computes. A global
average or max pool, or a 2-D one of a single whole-plane window, reads the layout natively too (a pool of the
whole plane and one lane, its ``[N, C/16, 1, 1, 16]`` result viewed as ``[N, C, 1, 1]``). Any other op whose
output stays plain reads a blocked input through a reorder (a ``Transpose`` to ``[N, C/16, 16, H, W]`` and a
``Reshape``), made once per tensor.
Convs whose input and output both stay plain keep their form (prepack's choice: the conv template, a
PackedConv, Winograd's).

A conv weight that another op also reads plainly is packed a second time (the rank stores both);
equal weights are packed once.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from .base import GraphPass, per_channel

__all__ = ["BlockedLayout"]

log = logging.getLogger(__name__)


def _plain_2d(op: Operator) -> bool:
    """Whether ``op`` has one output, float32 inputs and output, a non-empty 4-D image and neither side blocked
    yet (what both kinds of blocked conv below need)."""
    x = op.inputs[0]
    return len(op.outputs) == 1 and x.ndim == 4 and 0 not in x.shape \
        and all(t.dtype == "float32" for t in list(op.inputs) + op.outputs) \
        and not op.attrs.get("blocked_in") and not op.attrs.get("blocked_out")


def _conv_ok(op: Operator) -> bool:
    """Whether ``op`` is a conv the blocked kernels run: a float32 2-D Conv with a constant weight, of one
    group or of groups of whole blocks of 16 input and output channels (RegNet's), or a 2-D PackedConv, at a
    row stride of 1 or 2; or a WinogradConv."""
    group = int(op.attrs.get("group", 1))
    if op.op_type not in ("Conv", "PackedConv", "WinogradConv") or not _plain_2d(op) \
            or (group != 1 and (op.op_type == "WinogradConv" or not _whole_block_groups(op, group))):
        return False
    x, w = op.inputs[0], op.inputs[1]
    if op.op_type == "Conv" and (not w.is_constant or w.ndim != 4):
        return False
    # an image of channels not a multiple of 16 is read plain and the conv may write the layout: a stem's
    # window (3 channels) reads the image padded plane by plane (sf_conv2d_packed_direct's planar form; blocked,
    # the 3-channel image was 16/3 larger: ResNet-50's stem 0.88 -> 1.40 ms; planar 0.86 -> 0.74, and the max
    # pool and 1x1 after it follow the layout), MobileNetV2's 1x1 24->144 expansions at 56x56 0.13 -> 0.10 ms
    # (their depthwise convs reading blocked 0.17 -> 0.13); a 1x1 of fewer than 16 channels stays as it is
    if x.shape[1] < 16 and math.prod(w.shape[2:] if op.op_type == "Conv" else op.attrs["kernel"]) == 1:
        return False
    strides = tuple(op.attrs.get("strides") or (1, 1))
    return strides[1] in (1, 2)


def _whole_block_groups(op: Operator, group: int) -> bool:
    """Whether each of ``op``'s ``group`` groups has a multiple of 16 input and output channels (its
    blocks of the image and its panels its own: ``sf_conv2d_packed_direct``'s grouped form). RegNetY-4GF's
    grouped 3x3s (64 channels a group) ran on the conv template at 1.3-2.4x onnxruntime's time."""
    c, oc = op.inputs[0].shape[1], op.outputs[0].shape[1]  # (a plain 2-D conv's: _conv_ok asks _plain_2d first)
    return c % group == 0 and oc % group == 0 and (c // group) % 16 == 0 and (oc // group) % 16 == 0


def _depthwise_ok(op: Operator) -> bool:
    """Whether ``op`` is a depthwise conv the blocked kernels run: a float32 2-D Conv of one input and one
    output channel per group (``group = C = OC``, a multiple of 16) with a constant weight, any stride."""
    if op.op_type != "Conv" or not _plain_2d(op):
        return False
    x, w = op.inputs[0], op.inputs[1]
    return w.is_constant and w.ndim == 4 and w.shape[1] == 1 \
        and int(op.attrs.get("group", 1)) == x.shape[1] == w.shape[0] and x.shape[1] % 16 == 0


def _global_pool(op: Operator) -> bool:
    """Whether ``op`` is a global average or max pool of a 4-D float32 tensor, or a 2-D pool of one window of
    the whole plane (ResNet-50's 7x7 AveragePool) that way (it reads the layout natively: a pool of a window
    of the whole plane and one lane)."""
    if op.op_type not in ("Pool", "GlobalPool") or op.attrs.get("kind") not in ("avg", "max") or not op.inputs:
        return False
    x = op.inputs[0]
    if x.ndim != 4 or x.dtype != "float32" or len(op.outputs) != 1:
        return False
    if op.op_type == "Pool":
        return not op.attrs.get("with_indices") and len(op.inputs) == 1 \
            and tuple(op.attrs["kernel"]) == tuple(x.shape[2:]) and not any(op.attrs.get("pads") or ()) \
            and all(d == 1 for d in op.attrs.get("dilations") or ()) and tuple(op.outputs[0].shape[2:]) == (1, 1)
    return op.op_type == "GlobalPool"


def _follower(op: Operator) -> bool:
    """Whether ``op`` computes in the layout of its output: an element-wise op, a max or average 2-D pool, a
    concatenation of channels or a slice of whole blocks of channels."""
    t = op.op_type
    if len(op.outputs) != 1:
        return False
    if t == "Pool":
        return op.attrs.get("kind") in ("max", "avg") and not op.attrs.get("with_indices") \
            and len(op.attrs["kernel"]) == 2 and len(op.inputs) == 1
    if t == "Concat":
        return op.attrs.get("axis") == 1
    if t == "Slice":  # whole blocks of channels (a C2f block's split halves): a slice of the block axis
        st, sz = op.attrs["starts"], op.attrs["sizes"]
        return op.inputs[0].ndim == 4 and st[1] % 16 == 0 and sz[1] % 16 == 0 and sz[1] > 0 \
            and op.attrs["steps"][1] == 1
    if t == "BatchNorm":
        c = op.inputs[0].shape[1] if op.inputs[0].ndim == 4 else -1
        return all(p.is_constant and tuple(p.shape) == (c,) and p.dtype == "float32" for p in op.inputs[1:])
    return t in ("Activation", "Unary", "Binary", "Clip", "Identity", "RoundHalf")


def _channel_vector(t: Tensor, y: Tensor) -> bool:
    """Whether ``t`` is a computed value of one value per channel (and image) that an element-wise op broadcasts
    against its 4-D ``y [N, C, H, W]``: ``[N or 1, C, 1, 1]`` (or fewer leading dims) but not ``y``'s shape (an
    operand of ``y``'s shape is one of its activations), a squeeze and excitation's scale. Its order is the
    blocked order's ``[N or 1, C/16, 1, 1, 16]``: read as that view, it leaves the op blocked (RegNetY's and
    EfficientNet's scales had their image unblocked for the product: a reorder per block)."""
    if t.is_constant or t.dtype != y.dtype or y.ndim != 4 or not 1 <= t.ndim <= 4:
        return False
    full = (1,) * (4 - t.ndim) + tuple(t.shape)
    return full[0] in (1, y.shape[0]) and full[1] == y.shape[1] and full[2:] == (1, 1) and full != tuple(y.shape)


def _activations(op: Operator) -> list[Tensor]:
    """The inputs of a follower laid out as its output (the others: a BatchNorm's parameters, constants of
    one value per channel, computed values of one value per channel)."""
    if op.op_type in ("Pool", "Concat", "Slice"):
        return list(op.inputs)
    if op.op_type == "BatchNorm":
        return op.inputs[:1]
    y = op.outputs[0]
    return [t for t in op.inputs if not per_channel(t, y) and not _channel_vector(t, y)]


def _aligned(op: Operator, t: Tensor, out: Tensor) -> bool:
    """Whether a follower's activation ``t`` is indexed as its output ``out`` (but for a pool's window, a
    concatenation's channels and a slice's ranges)."""
    if op.op_type in ("Pool", "Slice"):
        return True
    if op.op_type == "Concat":
        return t.shape[0] == out.shape[0] and tuple(t.shape[2:]) == tuple(out.shape[2:])
    return tuple(t.shape) == tuple(out.shape) and t.dtype == out.dtype


def _blocked_value(value: np.ndarray, name: str) -> Tensor:
    """A constant of one value per channel (of any shape holding C values) as ``[1, C/16, 1, 1, 16]``."""
    from ..ops.conv import block_channels

    return const_tensor(block_channels(np.ascontiguousarray(value).reshape(1, -1, 1, 1)), name)


def _batch_norm(op: Operator, x: Tensor, blocked_const) -> list[Operator]:
    """A float32 BatchNorm of the blocked ``x`` as the element-wise ops it computes, its parameters blocked
    (``blocked_const``: one blocked copy per constant): ``(x - mean) * (scale / sqrt(var + epsilon)) +
    bias``, the factor computed here in float32 as its kernel computes it once per channel."""
    from ..ops.elementwise import Binary

    scale, var = (np.asarray(t.value, np.float32) for t in (op.inputs[1], op.inputs[4]))
    factor = _blocked_value(scale / np.sqrt(var + np.float32(op.attrs["epsilon"])), f"{op.name}.factor")
    sub = Binary([x, blocked_const(op.inputs[3])], name=f"{op.name}.sub", fn="sub")
    mul = Binary([sub.outputs[0], factor], name=f"{op.name}.mul", fn="mul")
    add = Binary([mul.outputs[0], blocked_const(op.inputs[2])], name=op.name, fn="add")
    return [sub, mul, add]


def _shape_ok(t: Tensor, outputs: set[int]) -> bool:
    return t.ndim == 4 and t.dtype == "float32" and t.shape[1] % 16 == 0 and 0 not in t.shape \
        and id(t) not in outputs and not t.is_constant


class BlockedLayout(GraphPass):
    """Keep the tensors between the convs of a cpu rank's graph in the blocked layout (module docstring).

    Parameters
    ----------
    repack
        Make PackedConvs of plain Convs (their weights packed anew); ``False`` (a memory budget, whose plan
        counted the weights as they are) lays out the PackedConvs and WinogradConvs only.
    """

    def __init__(self, repack: bool = True):
        self.repack = repack

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.conv import BLOCK, PackedConv, Pool
        from ..ops.linalg import pack_panels
        from ..ops.transform import Reshape, Transpose

        outputs = {id(t) for t in graph.outputs}
        convs = {id(op) for op in graph.nodes if _conv_ok(op) and (self.repack or op.op_type != "Conv")}
        depthwise = {id(op) for op in graph.nodes if _depthwise_ok(op)}  # they keep their weights
        convs |= depthwise
        # can: the producer can write the layout (forward)
        can: set[int] = set()
        for op in graph.nodes:
            if len(op.outputs) != 1 or not _shape_ok(op.outputs[0], outputs):
                continue
            out = op.outputs[0]
            # a concatenation takes its plain parts through a reorder when one part is blocked (DenseNet's
            # first block: the stem's pool beside the layers' convs)
            concat = op.op_type == "Concat" and _follower(op) and any(id(t) in can for t in op.inputs) \
                and all(id(t) in can or _shape_ok(t, set()) for t in op.inputs)
            # a plain Conv of a plain image writes the layout only when the image has no more channels than
            # the output: the blocked kernel blocks the image first, and the conv template, reading it where
            # it lies, beat that for 1x1 256->64 at 56x56 (0.49 against 0.65 ms; blocked in and out: 0.34)
            # a depthwise conv writes it only from a blocked image: from a plain one its blocks transpose the
            # image (MobileNetV2's 32 channels at 112x112: 0.165 ms, the flat kernel writing plain 0.113)
            if (id(op) in convs and (op.op_type != "Conv" or id(op.inputs[0]) in can
                                     or (op.inputs[0].shape[1] <= out.shape[1] and id(op) not in depthwise))) \
                    or (_follower(op) and all(id(t) in can and _aligned(op, t, out) for t in _activations(op))) \
                    or (concat and all(_aligned(op, t, out) for t in op.inputs)):
                can.add(id(out))
        # blocked: can, and some reader reads it natively (backward; a follower reads natively when its
        # output is blocked)
        want: set[int] = set()
        blocked: set[int] = set()
        for op in reversed(graph.nodes):
            if len(op.outputs) == 1 and id(op.outputs[0]) in can and id(op.outputs[0]) in want:
                blocked.add(id(op.outputs[0]))
            if id(op) in convs or _global_pool(op):
                want.add(id(op.inputs[0]))
            elif _follower(op) and len(op.outputs) == 1 and id(op.outputs[0]) in blocked:
                want.update(id(t) for t in _activations(op))
        if not blocked:
            return graph

        new_of: dict[int, Tensor] = {}  # old tensor -> its replacement
        plain_of: dict[int, Tensor] = {}  # blocked old tensor -> its reorder to the plain layout
        panels: dict[int, Tensor] = {}  # conv weight -> its panels
        channel_consts: dict[int, Tensor] = {}  # constant of one value per channel -> [1, C/16, 1, 1, 16]
        nodes: list[Operator] = []

        def blocked_const(t: Tensor) -> Tensor:
            if id(t) not in channel_consts:
                channel_consts[id(t)] = _blocked_value(np.asarray(t.value), f"{t.name}.blocked")
            return channel_consts[id(t)]

        def read(t: Tensor, native: bool) -> Tensor:
            if id(t) not in blocked or native:
                return new_of.get(id(t), t)
            if id(t) not in plain_of:
                b = new_of[id(t)]
                n, cb, h, w, lanes = b.shape
                tr = Transpose([b], name=f"{t.producer.name}.unblock", perm=(0, 1, 4, 2, 3))
                rs = Reshape([tr.outputs[0]], name=f"{t.producer.name}.unblock.view", shape=(n, cb * lanes, h, w))
                nodes.extend([tr, rs])
                plain_of[id(t)] = rs.outputs[0]
            return plain_of[id(t)]

        def to_blocked(t: Tensor) -> Tensor:
            if id(t) not in blocked_of:
                n, c, h, w = t.shape
                base = t.producer.name if t.producer is not None else t.name
                rs = Reshape([new_of.get(id(t), t)], name=f"{base}.block.view", shape=(n, c // 16, 16, h, w))
                tr = Transpose([rs.outputs[0]], name=f"{base}.block", perm=(0, 1, 3, 4, 2))
                nodes.extend([rs, tr])
                blocked_of[id(t)] = tr.outputs[0]
            return blocked_of[id(t)]

        blocked_of: dict[int, Tensor] = {}  # plain old tensor -> its reorder to the blocked layout

        def channels_view(t: Tensor) -> Tensor:
            """A computed value of one value per channel as ``[N or 1, C/16, 1, 1, 16]`` (the same order)."""
            if id(t) in blocked:
                return new_of[id(t)]
            if id(t) not in views:
                n, c = ((1,) * (4 - t.ndim) + tuple(t.shape))[:2]
                base = t.producer.name if t.producer is not None else t.name
                rs = Reshape([new_of.get(id(t), t)], name=f"{base}.channels.view", shape=(n, c // BLOCK, 1, 1, BLOCK))
                nodes.append(rs)
                views[id(t)] = rs.outputs[0]
            return views[id(t)]

        views: dict[int, Tensor] = {}  # plain channel vector -> its view as [N, C/16, 1, 1, 16]
        n_conv = 0
        for op in graph.nodes:
            out_b = len(op.outputs) == 1 and id(op.outputs[0]) in blocked
            if id(op) in convs and (out_b or id(op.inputs[0]) in blocked):
                x, w = op.inputs[0], op.inputs[1]
                attrs = dict(op.attrs, blocked_in=id(x) in blocked, blocked_out=out_b)
                if op.op_type == "Conv" and id(op) not in depthwise:
                    if id(w) not in panels:
                        value = np.asarray(w.value, np.float32)
                        panels[id(w)] = const_tensor(pack_panels(value.reshape(value.shape[0], -1).T),
                                                     f"{w.name}.panels")
                    w = panels[id(w)]
                    attrs.update(oc=int(op.inputs[1].shape[0]), kernel=tuple(int(k) for k in op.inputs[1].shape[2:]))
                inputs = [read(x, id(x) in blocked), w] + [read(t, False) for t in op.inputs[2:]]
                new = (PackedConv if op.op_type == "Conv" and id(op) not in depthwise else type(op))(
                    inputs, name=op.name, **attrs)
                n_conv += 1
            elif _global_pool(op) and id(op.inputs[0]) in blocked and not out_b:
                # a window of the whole plane and one lane, then the [N, C/16, 1, 1, 16] result viewed as
                # [N, C, 1, 1] (the same order): no reorder of the whole tensor
                b = read(op.inputs[0], True)
                n, cb, h, w, lanes = b.shape
                pool = Pool([b], name=f"{op.name}.blocked", kind=op.attrs["kind"], kernel=(h, w, 1), strides=(1, 1, 1),
                            dilations=(1, 1, 1), pads=(0,) * 6)
                nodes.append(pool)
                new = Reshape([pool.outputs[0]], name=op.name, shape=(n, cb * lanes, 1, 1))
            elif out_b and op.op_type == "BatchNorm":
                *steps, new = _batch_norm(op, read(op.inputs[0], True), blocked_const)
                nodes.extend(steps)
            elif out_b:
                # activations blocked (a concatenation's plain parts through a reorder), single values as
                # they are, constants of one value per channel blocked
                acts = {id(t) for t in _activations(op)}
                inputs = [(read(t, True) if id(t) in blocked else to_blocked(t)) if id(t) in acts
                          else t if math.prod(t.shape) == 1
                          else blocked_const(t) if t.is_constant else channels_view(t) for t in op.inputs]
                if op.op_type == "Pool":
                    attrs = dict(op.attrs)
                    pads = tuple(attrs.get("pads") or (0,) * 4)
                    attrs.update(kernel=tuple(attrs["kernel"]) + (1,),
                                 strides=tuple(attrs.get("strides") or (1, 1)) + (1,),
                                 dilations=tuple(attrs.get("dilations") or (1, 1)) + (1,),
                                 pads=(pads[0], pads[1], 0, pads[2], pads[3], 0))
                    new = Pool(inputs, name=op.name, **attrs)
                elif op.op_type == "Slice":  # (the block axis sliced by whole blocks, the lanes whole)
                    st, steps, sz = op.attrs["starts"], op.attrs["steps"], op.attrs["sizes"]
                    new = type(op)(inputs, name=op.name, **dict(
                        op.attrs, starts=(st[0], st[1] // 16, st[2], st[3], 0),
                        steps=(steps[0], 1, steps[2], steps[3], 1), sizes=(sz[0], sz[1] // 16, sz[2], sz[3], 16)))
                else:
                    new = type(op)(inputs, name=op.name, **op.attrs)
            else:
                op.inputs = [read(t, False) for t in op.inputs]
                nodes.append(op)
                continue
            new.outputs[0].name = op.outputs[0].name  # the model's name for it (buffers, profiles)
            new_of[id(op.outputs[0])] = new.outputs[0]
            nodes.append(new)
        graph.nodes = nodes
        graph.outputs = [new_of.get(id(t), t) for t in graph.outputs]
        log.debug("blocked layout: %d tensors of %d channel blocks, %d convs, %d + %d reorders", len(blocked), BLOCK,
                  n_conv, len(plain_of), len(blocked_of))
        from .simplify import EliminateDeadCode

        return EliminateDeadCode().run(graph)
