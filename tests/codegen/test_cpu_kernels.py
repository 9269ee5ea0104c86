"""Generated C++ kernels (target="cpu") agree with the ops' numpy implementations.

Every op example of every ``shardflow.compiler.ops`` module (``tests/op_examples.py``, as in
``tests/ops/test_compute_definitions.py``) plus larger cases that reach the GEMM tiling, the
threaded loops and the AVX2/AVX-512 clones are compiled into ONE library per test session and run
through the kernel ABI with ctypes.
"""
import ctypes
import os
import platform
import re
import subprocess
import time

import ml_dtypes  # noqa: F401  (names bfloat16 for numpy)
import numpy as np
import pytest
from op_examples import op_examples

from shardflow.compiler.codegen import (CompileError, build_cpu_library, generate_cpu_source, lower_task, lowerable,
                                        why_not_lowerable)
from shardflow.compiler.codegen import lower as lower_mod
from shardflow.compiler.codegen import toolchain
from shardflow.compiler.codegen.templates_cpu import prebuilt_needs, prebuilt_tables
from shardflow.compiler.errors import ShardflowError
from shardflow.compiler.ir import Operator, Tensor, const_tensor
from shardflow.compiler.ir.expr import BinOp, UnaryOp
from shardflow.compiler.ir.task import compute
from shardflow.compiler.ops.conv import (Conv, ConvTranspose, GlobalPool, PackedConv, PackedConvBf16, PackedConvInteger,
                                         Pool, Resize, WinogradConv, int8_conv_rows, pack_bf16_conv, pack_int8_conv,
                                         winograd_weights)
from shardflow.compiler.ops.elementwise import Activation, Binary, CastOp, RoundHalf, Unary, Where
from shardflow.compiler.ops.linalg import (INT8_KSTEP, INT8_PANEL, PANEL, Attention, Einsum, ExpertMatMul, Gemm, MatMul,
                                           MatMulNBits, PackedMatMul, PackedMatMulBf16, PackedMatMulInteger,
                                           pack_bf16_panels, pack_int8_panels)
from shardflow.compiler.ops.norm import LRN, LayerNorm
from shardflow.compiler.ops.reduce import ArgReduce, CumProd, CumSum, Reduce, Softmax, TopK
from shardflow.compiler.ops.transform import Concat, Gather, Pad, Transpose
from shardflow.compiler.parallel.comm_ops import AllReduce

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the cpu kernels are built with a POSIX C++ toolchain")


# --------------------------------------------------------------------------- cases
def _examples():
    res = []
    for mod, k, cls, arrays, attrs in op_examples():
        desc = ",".join(f"{a}={v}" for a, v in sorted(attrs.items()) if not isinstance(v, np.ndarray))
        res.append((f"{cls.op_type}-{mod}-{k}-{desc[:40]}", cls, arrays, attrs))
    return res


def _t(shape, dtype="float32"):
    return Tensor("t", shape, dtype)


def _panels(k, n, dtype="float32"):
    """The packed form of a [k, n] weight (ops.linalg.pack_panels)."""
    return _t((-(-n // PANEL), k, PANEL), dtype)


def _wino(c, oc, m):
    """The Winograd form of a [oc, c, 3, 3] weight (ops.conv.winograd_weights)."""
    return _t(((m + 2) ** 2, -(-oc // PANEL), c, PANEL))


def _i8mm(a_shape, n, dtype, zp):
    """A PackedMatMulInteger of ``a`` (``dtype``) times a packed int8 weight of ``n`` columns; ``zp``: the
    shape of ``a``'s zero point (``None``: none)."""
    k = a_shape[-1]
    ins = [_t(a_shape, dtype), _t((-(-n // INT8_PANEL), -(-k // INT8_KSTEP) * INT8_KSTEP // 4, INT8_PANEL, 4), "int8"),
           _t((2, INT8_PANEL * -(-n // INT8_PANEL)), "int32")]
    return PackedMatMulInteger(ins + ([_t(zp, dtype)] if zp is not None else []), n=n)


def _i8conv(x_shape, oc, kernel, dtype, zp, **attrs):
    """A PackedConvInteger of an image ``x_shape`` (``dtype``) with ``oc`` outputs, window ``kernel``,
    and the image's zero point when ``zp``."""
    g = attrs.get("group", 1)
    k = x_shape[1] // g * int(np.prod(kernel))
    ins = [_t(x_shape, dtype), _t((int8_conv_rows(oc, g), -(-k // INT8_KSTEP) * INT8_KSTEP), "uint8"),
           _t((2, int8_conv_rows(oc, g)), "int32")]
    return PackedConvInteger(ins + ([_t((), dtype)] if zp else []), oc=oc, kernel=kernel, **attrs)


def _bfconv(x_shape, oc, kernel, bias=False, **attrs):
    """A PackedConvBf16 of a bfloat16 image ``x_shape`` with ``oc`` outputs and window ``kernel``."""
    g = attrs.get("group", 1)
    k = x_shape[1] // g * int(np.prod(kernel))
    ins = [_t(x_shape, "bfloat16"), _t((int8_conv_rows(oc, g), -(-k // 32) * 32), "bfloat16")]
    return PackedConvBf16(ins + ([_t((oc,))] if bias else []), oc=oc, kernel=kernel, **attrs)


def _bfmm(a_shape, n, bias=None, **attrs):
    """A PackedMatMulBf16 of a bfloat16 ``a`` times a packed bfloat16 weight of ``n`` columns (plus a
    float32 bias of shape ``bias``)."""
    k = a_shape[-1]
    ins = [_t(a_shape, "bfloat16"), _t((-(-n // 16), -(-k // 32) * 16, 16, 2), "bfloat16")]
    return PackedMatMulBf16(ins + ([_t(bias)] if bias is not None else []), n=n, **attrs)


def _nbits(a_shape, n, bits, block, zp):
    """A MatMulNBits of ``a`` times ``n`` columns of ``bits``-bit codes in blocks of ``block``."""
    blocks = -(-a_shape[-1] // block)
    ins = [_t(a_shape), _t((n, blocks, block * bits // 8), "uint8"), _t((n, blocks))]
    return MatMulNBits(ins + ([_t((n, blocks))] if zp else []), bits=bits, block_size=block)


def _rand(rng, t):
    if t.dtype == "bool":
        return rng.random(t.shape) > 0.4
    if t.dtype == "uint8":  # bytes of packed codes (every bit pattern)
        return rng.integers(0, 256, t.shape).astype(t.dtype)
    if np.dtype(t.dtype).kind in "iu":
        return rng.integers(-3, 4, t.shape).astype(t.dtype)
    return rng.standard_normal(t.shape).astype(t.dtype)


def _resize(x, out, mode, ctm, **attrs):
    """A Resize of ``x`` (a tensor or a shape) to ``out`` with the scales ``out / x.shape`` (every dim)."""
    x = x if isinstance(x, Tensor) else _t(x)
    return Resize([x], mode=mode, coordinate_transformation_mode=ctm, sizes=out,
                  scales=tuple(o / i for o, i in zip(out, x.shape)), **attrs)


def _large():
    """Shapes past the GEMM blocking (K > 256, M and N off the 12x32 / 6x16 tiles), threaded loops
    and reductions long enough to use the vectorized paths."""
    ops = [
        MatMul([_t((2, 37, 300)), _t((300, 77))]),                    # batch folded into M, two K blocks
        MatMul([_t((3, 1, 29, 40)), _t((5, 40, 33))]),                # broadcast batch dims
        MatMul([_t((1, 300)), _t((300, 129))]),                       # M == 1 (no packing)
        MatMul([_t((300,)), _t((4, 300, 50))]),                       # vector @ batched matrix
        MatMul([_t((50, 300)), _t((300,))]),                          # matrix @ vector
        Gemm([_t((300, 45)), _t((70, 300)), _t((70,))], trans_a=True, trans_b=True, alpha=0.5, beta=2.0),
        Gemm([_t((64, 96)), _t((96, 80)), _t((64, 1))], beta=0.25),
        # one row times a transposed weight: dot products, four columns at a time (a tail of 3), threads
        Gemm([_t((1, 1000)), _t((203, 1000)), _t((203,))], trans_b=True, alpha=0.5, beta=2.0),
        Gemm([_t((1, 37)), _t((6, 37))], trans_b=True),
        # weights packed at compile time: panels of PANEL (16) columns, which the AVX2 kernel reads
        # whole, the portable one by halves and the AVX-512 one two at a time (an odd count: the last
        # tile reads one); column tails, two K blocks, M == 1, biases, every row tail of the 6-row
        # AVX2 kernel (M mod 6 = 1..5: 7, 74, 9, 64, 11)
        PackedMatMul([_t((2, 37, 300)), _panels(300, 77)], n=77),
        PackedMatMul([_t((1, 300)), _panels(300, 129)], n=129),
        PackedMatMul([_t((300,)), _panels(300, 50)], n=50),
        PackedMatMul([_t((64, 96)), _panels(96, 80), _t((64, 1))], n=80, alpha=0.5, beta=0.25),
        PackedMatMul([_t((130, 520)), _panels(520, 280), _t((280,))], n=280),
        PackedMatMul([_t((7, 40)), _panels(40, 33)], n=33),
        PackedMatMul([_t((9, 40)), _panels(40, 48), _t((48,))], n=48),
        PackedMatMul([_t((11, 600)), _panels(600, 20)], n=20),
        # low-bit weights: one row (the GEMV on 4-bit codes four columns at a time, a tail of 1, threads;
        # blocks of 32 and 128 codes, K past the last whole block; zero points default or given), two
        # rows, 2- and 8-bit codes (the portable loop), and rows through the GEMM (dequantizing panels
        # of K blocks and column tails)
        _nbits((1, 300), 203, 4, 32, True),
        _nbits((1, 1, 512), 64, 4, 128, False),
        _nbits((2, 64), 13, 4, 16, True),
        _nbits((1, 100), 9, 2, 16, True),
        _nbits((2, 40), 7, 8, 32, False),
        _nbits((3, 37, 300), 77, 4, 32, True),
        _nbits((5, 600), 40, 2, 64, False),
        _nbits((9, 70), 33, 8, 16, True),
        # rows through the GEMM, each panel dequantized straight into its layout (AVX-512: 16 columns'
        # codes transposed as bytes) where a tile uses it: blocks of 64 and 128 (two and four to a K
        # block of 256), a column group of 16 past the last column, K past the last whole block
        _nbits((20, 1000), 70, 4, 128, False),
        _nbits((16, 520), 48, 4, 64, True),
        _nbits((150, 300), 40, 4, 32, True),  # more rows than one row of tiles: a chunk packed ahead
        _nbits((3, 200), 37, 4, 32, True),  # the GEMV's tiles of 3 and 4 rows
        _nbits((4, 256), 20, 4, 64, False),
        Conv([_t((2, 8, 17, 15)), _t((12, 4, 3, 3)), _t((12,))], group=2, pads=(1, 2, 0, 1), strides=(2, 1),
             dilations=(1, 2)),
        Conv([_t((1, 16, 9, 9)), _t((24, 16, 1, 1))]),                # 1x1: no im2col
        Conv([_t((2, 6, 40)), _t((10, 6, 5)), _t((10,))], pads=(2, 2), strides=(3,)),
        # one input channel per group but fewer than 16 groups (a signal's first conv): the GEMM of each
        # group, not the depthwise kernel
        Conv([_t((1, 1, 300)), _t((48, 1, 10)), _t((48,))], strides=(5,)),
        Conv([_t((2, 4, 90)), _t((32, 1, 5))], group=4, strides=(2,), pads=(1, 2)),
        # depthwise (sf_conv_depthwise): strides 1, 2 and 3, dilation, uneven pads, 7x7, two outputs per
        # channel (in blocks: an output row wider than the input's), 1-D (a causal conv's left pad), images
        Conv([_t((1, 6, 8, 8)), _t((6, 1, 3, 3))], group=6, pads=(1, 1, 1, 1)),
        Conv([_t((2, 5, 17, 23)), _t((5, 1, 3, 3)), _t((5,))], group=5, pads=(1, 0, 2, 1), strides=(2, 2)),
        Conv([_t((1, 4, 20, 31)), _t((8, 1, 3, 3)), _t((8,))], group=4, pads=(2, 2, 2, 3), dilations=(2, 2)),
        Conv([_t((1, 3, 30, 29)), _t((3, 1, 7, 7)), _t((3,))], group=3, pads=(3, 3, 3, 3)),
        Conv([_t((1, 4, 19, 40)), _t((4, 1, 3, 5))], group=4, pads=(0, 1, 1, 2), strides=(1, 3)),
        Conv([_t((2, 6, 50)), _t((6, 1, 4)), _t((6,))], group=6, pads=(3, 0)),
        Conv([_t((1, 96, 14, 14)), _t((96, 1, 3, 3)), _t((96,))], group=96, pads=(1, 1, 1, 1)),  # threads
        # blocks of 16 channels (strided, or output rows not as wide as the input's): a block of 4 left
        # over and bands of rows (two images); stride 2 with uneven pads; strides 3x2, dilations and a
        # 5x3 kernel; 7x7 on 8 channels (half a block); 1-D; planes narrower than a run of 8 columns
        # (three blocks); a last input column no tap reads
        Conv([_t((2, 20, 100, 37)), _t((20, 1, 3, 3)), _t((20,))], group=20, pads=(1, 1, 1, 2)),
        Conv([_t((1, 24, 31, 29)), _t((24, 1, 3, 3))], group=24, pads=(1, 0, 2, 1), strides=(2, 2)),
        Conv([_t((1, 16, 40, 45)), _t((16, 1, 5, 3)), _t((16,))], group=16, pads=(4, 2, 3, 1), strides=(3, 2),
             dilations=(2, 3)),
        Conv([_t((1, 8, 30, 29)), _t((8, 1, 7, 7)), _t((8,))], group=8, pads=(3, 3, 3, 2)),
        Conv([_t((2, 32, 70)), _t((32, 1, 4)), _t((32,))], group=32, pads=(3, 1)),
        Conv([_t((1, 40, 5, 5)), _t((40, 1, 3, 3))], group=40, pads=(1, 1, 1, 0)),
        Conv([_t((1, 16, 12, 30)), _t((16, 1, 3, 3))], group=16, strides=(2, 2)),
        # 3x3, stride 1, output rows as wide as the input's (sf_conv_depthwise_flat: runs of 16 pixels
        # across rows): two outputs per channel, images and bands of runs (16 columns); rows of 37 (runs
        # start at every column) on 20 channels; uneven vertical pads (an output row fewer); dilation (some
        # convs above are flat too). Then, with such rows, 3x5, 5x3, 5x5, 7x7, 1-D and strided convs: in
        # blocks
        Conv([_t((1, 4, 8, 11)), _t((4, 1, 3, 5))], group=4, pads=(1, 2, 1, 2)),
        Conv([_t((1, 4, 9, 8)), _t((4, 1, 5, 3))], group=4, pads=(2, 1, 2, 1)),
        Conv([_t((1, 2, 6, 4)), _t((2, 1, 3, 3))], group=2, pads=(1, 2, 1, 3), strides=(1, 2)),
        Conv([_t((1, 3, 10, 9)), _t((3, 1, 3, 3))], group=3, pads=(1, 1, 1, 1), strides=(2, 1)),
        Conv([_t((2, 6, 300, 16)), _t((12, 1, 3, 3)), _t((12,))], group=6, pads=(1, 1, 1, 1)),
        Conv([_t((1, 20, 30, 37)), _t((20, 1, 3, 3)), _t((20,))], group=20, pads=(1, 1, 1, 1)),
        Conv([_t((1, 5, 13, 9)), _t((5, 1, 3, 3)), _t((5,))], group=5, pads=(0, 1, 1, 1)),
        Conv([_t((1, 4, 10, 7)), _t((4, 1, 3, 3))], group=4, pads=(2, 2, 2, 2), dilations=(2, 2)),
        Conv([_t((1, 5, 13, 9)), _t((5, 1, 5, 5)), _t((5,))], group=5, pads=(0, 2, 3, 2)),
        Conv([_t((1, 3, 9, 12)), _t((3, 1, 7, 7)), _t((3,))], group=3, pads=(3, 3, 3, 3)),
        Conv([_t((2, 6, 12)), _t((6, 1, 3)), _t((6,))], group=6, pads=(2, 0)),
        # 3x3 at horizontal stride 2, rows of 8 or more (sf_conv_depthwise_s2 with AVX-512: runs of 16 of a
        # row): two outputs per channel, vertical stride 1 and dilation 2, bands of rows, row tails; two
        # columns of left padding and taps past the right edge, images; the right padding read by a
        # run's second load (rows of 49) and by its column after them (rows of 31). Then 3x5, 5x3,
        # horizontal dilation 2 and stride 3: in blocks
        Conv([_t((1, 2, 300, 70)), _t((4, 1, 3, 3)), _t((4,))], group=2, pads=(1, 1, 1, 0), strides=(1, 2),
             dilations=(2, 1)),
        Conv([_t((2, 3, 20, 41)), _t((3, 1, 3, 3)), _t((3,))], group=3, pads=(2, 2, 2, 2), strides=(2, 2)),
        Conv([_t((1, 2, 9, 49)), _t((2, 1, 3, 3))], group=2, pads=(1, 1, 1, 1), strides=(2, 2)),
        Conv([_t((1, 2, 9, 31)), _t((2, 1, 3, 3))], group=2, pads=(1, 1, 1, 1), strides=(2, 2)),
        Conv([_t((1, 3, 14, 40)), _t((3, 1, 5, 3))], group=3, pads=(2, 1, 2, 1), strides=(2, 2)),
        Conv([_t((1, 3, 12, 40)), _t((3, 1, 3, 5))], group=3, pads=(1, 2, 1, 2), strides=(2, 2)),
        Conv([_t((1, 3, 12, 40)), _t((3, 1, 3, 3))], group=3, pads=(1, 2, 1, 2), strides=(2, 2), dilations=(1, 2)),
        Conv([_t((1, 3, 12, 50)), _t((3, 1, 3, 3))], group=3, pads=(1, 1, 1, 1), strides=(2, 3)),
        # the conv template's paths: short rows (two-load permutes), K in two blocks packed once for
        # the three row tiles, row and column remainders of every micro-kernel shape
        Conv([_t((1, 40, 9, 9)), _t((200, 40, 3, 3)), _t((200,))], pads=(1, 1, 1, 1)),
        Conv([_t((1, 3, 40, 40)), _t((20, 3, 5, 5)), _t((20,))], pads=(2, 2, 2, 2), strides=(2, 2)),  # strided rows
        Conv([_t((1, 5, 20, 37)), _t((13, 5, 3, 3))], pads=(1, 2, 1, 0), dilations=(1, 2)),  # long rows: copies
        Conv([_t((2, 6, 11, 13)), _t((12, 2, 3, 2)), _t((12,))], group=3, pads=(2, 1, 0, 3), strides=(3, 2),
             dilations=(2, 3)),
        Conv([_t((1, 300, 5, 7)), _t((130, 300, 1, 1)), _t((130,))]),  # 1x1: two K blocks, two row tiles
        Conv([_t((2, 24, 9, 9)), _t((16, 24, 1, 1))], strides=(2, 2)),  # 1x1 strided: picked pixels, packed
        Conv([_t((1, 16, 30, 41)), _t((24, 16, 1, 1)), _t((24,))], strides=(2, 3)),  # picked, read unpacked
        Conv([_t((2, 8, 24, 26)), _t((12, 4, 1, 1))], group=2, strides=(2, 2)),  # picked, images and groups
        Conv([_t((1, 8, 9, 9)), _t((8, 8, 1, 1))], pads=(1, 1, 1, 1), strides=(2, 2)),  # padded 1x1: not picked
        Conv([_t((3, 8, 48, 48)), _t((13, 8, 3, 3)), _t((13,))], pads=(1, 1, 1, 1)),  # threads: many tiles
        Conv([_t((2, 4, 5, 6)), _t((5, 4, 3, 3))], pads=(2, 2, 2, 2), dilations=(2, 2)),  # pads past the taps
        # horizontal stride 1 with rows of at least one panel: AVX2 reads B from the image, panels
        # of one output row (16, 16, 5; 16, 12 with two K blocks; a 1x1's one row of 99; no padding,
        # so the masked tail ends at the input's last float; groups)
        Conv([_t((1, 10, 12, 37)), _t((14, 10, 3, 3)), _t((14,))], pads=(1, 1, 1, 1)),
        Conv([_t((2, 40, 9, 27)), _t((20, 40, 3, 3)), _t((20,))], pads=(0, 2, 1, 1), strides=(2, 1),
             dilations=(2, 1)),
        Conv([_t((1, 24, 9, 11)), _t((30, 24, 1, 1)), _t((30,))]),
        Conv([_t((1, 4, 6, 20)), _t((8, 4, 3, 3))]),
        Conv([_t((1, 12, 5, 18)), _t((12, 4, 3, 3))], group=3, pads=(1, 1, 1, 1)),
        # packed rows of 8+ pixels at horizontal stride 2, unpadded, so the last taps reach the image's
        # end; a 1x1 with more than 1024 output channels (packed at stride 1: whole-vector stores)
        Conv([_t((1, 4, 17, 35)), _t((10, 4, 3, 3)), _t((10,))], strides=(2, 2)),
        Conv([_t((1, 3, 6, 9)), _t((1030, 3, 1, 1))]),
        # strided convs of long output rows (3+ panels), read unpacked from their image's phases: two
        # images, uneven pads; groups, stride 3 and a dilated tap (phases no tap reads)
        Conv([_t((2, 3, 61, 101)), _t((10, 3, 7, 7)), _t((10,))], pads=(3, 3, 2, 4), strides=(2, 2)),
        Conv([_t((1, 4, 20, 150)), _t((10, 2, 2, 4))], group=2, strides=(3, 3), dilations=(2, 1)),
        # convs as the prepacked GEMM (passes/prepack.py): 1x1 reading the image, im2col with padding,
        # stride and dilation, 1-D, several images, column tails, K in two blocks, threads
        PackedConv([_t((2, 64, 7, 7)), _panels(64, 100), _t((100,))], oc=100, kernel=(1, 1)),
        PackedConv([_t((1, 20, 9, 8)), _panels(180, 37), _t((37,))], oc=37, kernel=(3, 3), pads=(1, 1, 1, 1)),
        PackedConv([_t((3, 6, 13, 11)), _panels(54, 21)], oc=21, kernel=(3, 3), strides=(2, 2), pads=(1, 0, 2, 1),
                   dilations=(2, 1)),
        PackedConv([_t((2, 24, 9, 9)), _panels(24, 16)], oc=16, kernel=(1, 1), strides=(2, 2)),
        PackedConv([_t((2, 5, 30)), _panels(25, 9), _t((9,))], oc=9, kernel=(5,), pads=(2, 2), strides=(3,)),
        PackedConv([_t((1, 256, 14, 14)), _panels(2304, 70), _t((70,))], oc=70, kernel=(3, 3), pads=(1, 1, 1, 1)),
        # strided PackedConvs read from the channel-blocked image (AVX-512; AVX2 when forced: rows of 6 + 6 + 5
        # pixels, 16-channel panels): rows of 14 + 3 pixels, 20 channels
        # (a block of 16 and one of 4), 40 outputs (a block of 32 and one of 8), bias, two images; a 7x7
        # window with stride (3, 2) on one image
        PackedConv([_t((2, 20, 9, 33)), _panels(180, 40), _t((40,))], oc=40, kernel=(3, 3), pads=(1, 1, 1, 1),
                   strides=(2, 2)),
        PackedConv([_t((1, 3, 23, 30)), _panels(147, 17)], oc=17, kernel=(7, 7), pads=(3, 3, 3, 3), strides=(3, 2)),
        # a 1x1 of 1024+ outputs, read blocked as well: 1030 channels (32 blocks of 32 and one of 6), runs of
        # 14 pixels crossing the image's rows, two images
        PackedConv([_t((2, 24, 7, 9)), _panels(24, 1030), _t((1030,))], oc=1030, kernel=(1, 1)),
        # the blocked layout [N, C/16, H, W, 16] (passes/layout.py): read where it lies (1x1), padded (3x3),
        # gathered (1x1 of stride 2), written as the kernels hold it (two panels of 16, one), from a plain
        # image of 3 channels; pixel runs crossing rows, two images
        PackedConv([_t((2, 2, 7, 9, 16)), _panels(32, 48), _t((48,))], oc=48, kernel=(1, 1), blocked_in=True,
                   blocked_out=True),
        PackedConv([_t((1, 2, 9, 11, 16)), _panels(288, 16)], oc=16, kernel=(3, 3), pads=(1, 1, 1, 1),
                   blocked_in=True),
        PackedConv([_t((2, 1, 9, 8, 16)), _panels(16, 32), _t((32,))], oc=32, kernel=(1, 1), strides=(2, 2),
                   blocked_in=True, blocked_out=True),
        PackedConv([_t((1, 3, 23, 30)), _panels(147, 32), _t((32,))], oc=32, kernel=(7, 7), pads=(3, 3, 3, 3),
                   strides=(2, 2), blocked_out=True),
        PackedConv([_t((1, 1, 15, 17, 16)), _panels(144, 64), _t((64,))], oc=64, kernel=(3, 3), pads=(1, 1, 1, 1),
                   strides=(2, 2), blocked_in=True, blocked_out=True),
        # 7-pixel output rows (AVX-512: tiles of two rows, a lone last row of a task's run on its own): stride 1
        # blocked both sides (two images, panels of 32 and 16 channels), stride 2 to a plain output (40 channels)
        PackedConv([_t((2, 3, 7, 7, 16)), _panels(432, 48), _t((48,))], oc=48, kernel=(3, 3), pads=(1, 1, 1, 1),
                   blocked_in=True, blocked_out=True),
        PackedConv([_t((1, 2, 14, 13, 16)), _panels(288, 40), _t((40,))], oc=40, kernel=(3, 3), pads=(1, 1, 1, 1),
                   strides=(2, 2), blocked_in=True),
        # groups of whole blocks (RegNet's grouped 3x3s, passes/layout.py): blocked both sides at stride 1 (3 groups
        # of 16 -> 32: blocks of 32 output channels), blocked in at stride 2 to a plain output (2 groups of 32 ->
        # 48: blocks of 16, each in one group), plain both sides (3 groups of 16 -> 16), two images
        PackedConv([_t((2, 3, 9, 10, 16)), _panels(144, 96), _t((96,))], oc=96, kernel=(3, 3), pads=(1, 1, 1, 1),
                   group=3, blocked_in=True, blocked_out=True),
        PackedConv([_t((1, 4, 10, 11, 16)), _panels(288, 96), _t((96,))], oc=96, kernel=(3, 3), pads=(1, 0, 1, 1),
                   strides=(2, 2), group=2, blocked_in=True),
        PackedConv([_t((2, 48, 9, 10)), _panels(144, 48)], oc=48, kernel=(3, 3), pads=(1, 1, 1, 1), group=3),
        # strided convs of a blocked image of 2 MiB or more (padded): padded by each task a band of rows at a time
        # (SF_CONV_BAND_MIN): 16 channels at 256x256 (bands of uneven rows); 2 groups of 32 channels with uneven
        # pads to a plain output of blocks of 16 channels, two images; a dilated tap, rows of other length
        PackedConv([_t((1, 1, 256, 256, 16)), _panels(144, 32), _t((32,))], oc=32, kernel=(3, 3), pads=(1, 1, 1, 1),
                   strides=(2, 2), blocked_in=True, blocked_out=True),
        PackedConv([_t((2, 4, 128, 127, 16)), _panels(288, 96), _t((96,))], oc=96, kernel=(3, 3), pads=(1, 0, 2, 1),
                   strides=(2, 2), group=2, blocked_in=True),
        PackedConv([_t((1, 1, 300, 230, 16)), _panels(144, 16)], oc=16, kernel=(3, 3), pads=(2, 1, 2, 1),
                   strides=(2, 2), dilations=(2, 1), blocked_in=True, blocked_out=True),
        WinogradConv([_t((1, 4, 28, 28, 16)), _wino(64, 64, 4), _t((64,))], oc=64, m=4, pads=(1, 1, 1, 1),
                     blocked_in=True, blocked_out=True),
        WinogradConv([_t((2, 1, 9, 13, 16)), _wino(16, 32, 2)], oc=32, m=2, pads=(1, 0, 1, 1), blocked_in=True),
        WinogradConv([_t((1, 40, 14, 14)), _wino(40, 48, 2), _t((48,))], oc=48, m=2, pads=(1, 1, 1, 1),
                     blocked_out=True),
        # depthwise convs on the blocked layout (sf_conv_depthwise: the blocked image read in place with AVX-512,
        # its rows copied as they lie otherwise; output rows stored in place): both sides, stride 1 and 2,
        # uneven pads, two images, a 5x5 with dilation;
        # the input only (a stride-2 3x3 that the plain path runs in rows), the output only (a flat 3x3)
        Conv([_t((2, 2, 14, 13, 16)), _t((32, 1, 3, 3)), _t((32,))], group=32, pads=(1, 1, 1, 1),
             blocked_in=True, blocked_out=True),
        Conv([_t((1, 3, 15, 17, 16)), _t((48, 1, 3, 3))], group=48, pads=(1, 0, 1, 2), strides=(2, 2),
             blocked_in=True, blocked_out=True),
        Conv([_t((1, 1, 12, 20, 16)), _t((16, 1, 5, 5)), _t((16,))], group=16, pads=(2, 4, 2, 4), dilations=(1, 2),
             blocked_in=True, blocked_out=True),
        Conv([_t((1, 2, 11, 33, 16)), _t((32, 1, 3, 3)), _t((32,))], group=32, pads=(1, 1, 1, 1), strides=(2, 2),
             blocked_in=True),
        Conv([_t((2, 16, 9, 10)), _t((16, 1, 3, 3)), _t((16,))], group=16, pads=(1, 1, 1, 1), blocked_out=True),
        # a 1x1 of a plain image of 24 channels writing the layout (MobileNetV2's expansions), two images
        PackedConv([_t((2, 24, 9, 10)), _panels(24, 48), _t((48,))], oc=48, kernel=(1, 1), blocked_out=True),
        # Winograd F(2x2) and F(4x4) (passes/prepack.py): whole chunks per thread (56x56), threads sharing
        # each step of one chunk (7x7), channel lanes and panels with tails, tiles past the output, pads
        # on one side only, several images, one row of tiles per chunk
        WinogradConv([_t((1, 64, 56, 56)), _wino(64, 64, 2), _t((64,))], oc=64, m=2, pads=(1, 1, 1, 1)),
        WinogradConv([_t((1, 96, 7, 7)), _wino(96, 40, 2), _t((40,))], oc=40, m=2, pads=(1, 1, 1, 1)),
        WinogradConv([_t((2, 10, 13, 11)), _wino(10, 21, 4)], oc=21, m=4, pads=(1, 0, 2, 1)),
        WinogradConv([_t((1, 32, 28, 28)), _wino(32, 48, 4), _t((48,))], oc=48, m=4, pads=(1, 1, 1, 1)),
        WinogradConv([_t((3, 200, 9, 30)), _wino(200, 260, 2), _t((260,))], oc=260, m=2, pads=(0, 1, 0, 1)),
        # weights beyond 1 MiB read once per image (one chunk of all its tiles), not once per chunk: the
        # images above shared by the threads, these four taken whole by each thread
        WinogradConv([_t((4, 130, 20, 20)), _wino(130, 136, 2), _t((136,))], oc=136, m=2, pads=(1, 1, 1, 1)),
        # 3-D convs (the 2-D conv's tiles per output depth slice): B packed (a W stride of 2 with padding,
        # strides, dilation, groups and two images; rows of 5 and 8 pixels with K in several blocks and, at
        # 100 outputs, two row tiles reusing their panels; 1024 outputs, unpadded) and read in place (rows of
        # 16, 48 and 35 pixels: K in blocks, column tails, a depth stride and W dilation, groups, two images)
        Conv([_t((2, 4, 6, 7, 9)), _t((6, 2, 3, 2, 3)), _t((6,))], group=2, pads=(1, 0, 2, 1, 1, 0),
             strides=(2, 1, 2), dilations=(2, 2, 1)),
        Conv([_t((1, 300, 3, 4, 5)), _t((10, 300, 1, 3, 3)), _t((10,))], pads=(0, 1, 1, 0, 1, 1)),
        Conv([_t((1, 40, 4, 6, 8)), _t((100, 40, 3, 3, 3)), _t((100,))], pads=(2, 1, 1, 0, 1, 1),
             dilations=(2, 1, 1)),
        Conv([_t((1, 2, 3, 4, 20)), _t((1024, 2, 1, 1, 1)), _t((1024,))]),
        Conv([_t((1, 8, 12, 16, 16)), _t((16, 8, 3, 3, 3))], pads=(1,) * 6),
        Conv([_t((1, 64, 3, 48, 48)), _t((4, 64, 3, 3, 3)), _t((4,))], pads=(1,) * 6),
        Conv([_t((2, 6, 5, 4, 37)), _t((10, 3, 3, 3, 3)), _t((10,))], group=2, pads=(1,) * 6, strides=(2, 1, 1),
             dilations=(1, 1, 2)),
        # the transposed-conv template (a GEMM into columns, then col2im): output padding, groups with
        # stride, dilation and uneven pads, 1-D, stride 1, an output past the columns' reach (negative end pads:
        # bias only there), K in two blocks, threads, and a thin one left to the generic nest
        ConvTranspose([_t((2, 8, 9, 7)), _t((8, 6, 3, 3)), _t((6,))], strides=(2, 2), pads=(1, 1, 1, 1),
                      output_shape=(18, 14)),
        ConvTranspose([_t((2, 8, 5, 6)), _t((8, 3, 3, 2)), _t((6,))], group=2, strides=(3, 2), pads=(2, 0, 1, 1),
                      dilations=(2, 3), output_shape=(15, 12)),
        ConvTranspose([_t((2, 8, 30)), _t((8, 4, 5)), _t((4,))], strides=(3,), pads=(1, 2), output_shape=(90,)),
        ConvTranspose([_t((1, 6, 7, 9)), _t((6, 5, 3, 3)), _t((5,))], pads=(1, 1, 1, 1), output_shape=(7, 9)),
        ConvTranspose([_t((1, 4, 5, 5)), _t((4, 8, 2, 2))], strides=(2, 2), pads=(0, 0, -2, -1),
                      output_shape=(12, 11)),
        ConvTranspose([_t((1, 300, 5, 6)), _t((300, 20, 2, 2)), _t((20,))], strides=(2, 2), output_shape=(10, 12)),
        ConvTranspose([_t((1, 32, 24, 24)), _t((32, 16, 4, 4)), _t((16,))], strides=(2, 2), pads=(1, 1, 1, 1),
                      output_shape=(48, 48)),
        ConvTranspose([_t((1, 6, 5, 5)), _t((6, 1, 3, 3))], group=6, strides=(2, 2), output_shape=(11, 11)),
        # over 3 spatial dims (by slabs of input slices): a 3-D UNet's 2x2x2 upsampling of two images; groups
        # with uneven strides, pads and dilations and output padding; a slab of one slice
        ConvTranspose([_t((2, 8, 5, 6, 4)), _t((8, 6, 2, 2, 2)), _t((6,))], strides=(2, 2, 2),
                      output_shape=(10, 12, 8)),
        ConvTranspose([_t((1, 8, 5, 6, 7)), _t((8, 3, 3, 3, 2)), _t((6,))], group=2, strides=(2, 1, 3),
                      pads=(1, 0, 1, 1, 1, 0), dilations=(1, 2, 1), output_shape=(10, 9, 20)),
        ConvTranspose([_t((1, 4, 3, 100, 100)), _t((4, 16, 3, 3, 3))], pads=(1,) * 6, output_shape=(3, 100, 100)),
        # the Resize template: nearest (every rounding, integer and odd scales), linear and cubic (rows
        # resized along W cached and combined), only H or only W resized, antialias (many taps), crop
        # with extrapolation, 1-D/2-D/5-D inputs, bands of rows (few planes) and threads over planes
        _resize((1, 3, 10, 12), (1, 3, 20, 24), "nearest", "asymmetric", nearest_mode="floor"),
        _resize((2, 3, 7, 9), (2, 3, 11, 5), "nearest", "half_pixel", nearest_mode="round_prefer_floor"),
        _resize((1, 2, 9, 8), (1, 2, 13, 19), "nearest", "align_corners", nearest_mode="round_prefer_ceil"),
        _resize((1, 2, 9, 8), (1, 2, 4, 19), "nearest", "tf_half_pixel_for_nn", nearest_mode="ceil"),
        _resize((1, 4, 9, 10), (1, 4, 18, 20), "linear", "half_pixel"),
        _resize((1, 32, 8, 8), (1, 32, 16, 16), "linear", "pytorch_half_pixel"),
        _resize((2, 3, 17, 15), (2, 3, 6, 7), "linear", "align_corners"),
        _resize((1, 2, 5, 17), (1, 2, 5, 40), "linear", "pytorch_half_pixel"),
        _resize((1, 2, 12, 7), (1, 2, 30, 7), "cubic", "half_pixel_symmetric"),
        _resize((1, 3, 11, 13), (1, 3, 25, 20), "cubic", "asymmetric", cubic_coeff_a=-0.5, exclude_outside=True),
        _resize((1, 2, 40, 33), (1, 2, 12, 10), "cubic", "half_pixel", antialias=True),
        _resize((1, 2, 40, 33), (1, 2, 12, 10), "linear", "half_pixel", antialias=True),
        _resize((1, 2, 9, 10), (1, 2, 7, 16), "linear", "tf_crop_and_resize", extrapolation_value=5.0,
                roi=(0.0, 0.0, -0.2, 0.1, 1.0, 1.0, 0.9, 1.3)),
        _resize((1, 2, 9, 10), (1, 2, 14, 16), "nearest", "tf_crop_and_resize", extrapolation_value=5.0,
                nearest_mode="floor", roi=(0.0, 0.0, -0.1, 0.1, 1.0, 1.0, 0.9, 1.3)),  # a row outside, then its source
        _resize((1, 3, 6, 20), (1, 3, 13, 20), "nearest", "asymmetric", nearest_mode="floor"),  # rows copied
        _resize((2, 3, 10), (2, 3, 25), "linear", "half_pixel"),
        _resize((7, 9), (14, 20), "cubic", "half_pixel"),
        _resize((1, 2, 3, 6, 6), (1, 2, 3, 12, 12), "nearest", "asymmetric", nearest_mode="floor"),
        _resize((1, 3, 28), (1, 3, 28), "nearest", "half_pixel", nearest_mode="ceil"),  # the same size: copies
        _resize((2, 5, 7), (2, 5, 7), "linear", "align_corners"),
        # the pooling template: borders, dilation, ceil_mode, both averages, 1-D, a threaded one
        Pool([_t((2, 5, 17, 16))], kind="max", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
        Pool([_t((1, 3, 15, 20))], kind="max", kernel=(3, 2), strides=(2, 3), dilations=(2, 1), pads=(1, 0, 2, 1),
             ceil_mode=True),
        Pool([_t((2, 3, 13, 11))], kind="avg", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), ceil_mode=True,
             count_include_pad=False),
        Pool([_t((2, 3, 13, 11))], kind="avg", kernel=(2, 4), strides=(1, 3), pads=(1, 2, 0, 1),
             count_include_pad=True),
        Pool([_t((2, 4, 50))], kind="max", kernel=(4,), strides=(3,), pads=(1, 2)),
        Pool([_t((2, 4, 50))], kind="avg", kernel=(5,), strides=(2,), pads=(2, 2)),
        Pool([_t((1, 16, 56, 56))], kind="max", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
        Pool([_t((1, 2, 5, 5))], kind="max", kernel=(2, 2), strides=(2, 2), pads=(2, 2, 2, 2)),  # windows in the pads
        # blocked planes [N, C/16, H, W, 16] (passes/layout.py): the window's last extent is one lane
        Pool([_t((2, 2, 17, 16, 16))], kind="max", kernel=(3, 3, 1), strides=(2, 2, 1), pads=(1, 1, 0, 1, 1, 0)),
        Pool([_t((1, 1, 13, 11, 16))], kind="avg", kernel=(3, 3, 1), strides=(2, 2, 1), pads=(1, 1, 0, 1, 1, 0),
             ceil_mode=True, count_include_pad=False),
        Pool([_t((1, 3, 7, 7, 16))], kind="avg", kernel=(7, 7, 1)),
        # windows inside the image (constant loops) beside border ones: dilated, padding counted; a max pool of
        # stride 1
        Pool([_t((1, 2, 12, 13, 16))], kind="avg", kernel=(3, 3, 1), dilations=(2, 2, 1), pads=(2, 1, 0, 2, 3, 0),
             count_include_pad=True),
        Pool([_t((2, 1, 9, 10, 16))], kind="max", kernel=(3, 2, 1), pads=(1, 0, 0, 1, 1, 0)),
        # rows of at least 16 outputs: along the rows, then down (separable), with the same edge cases
        Pool([_t((1, 3, 40, 45))], kind="max", kernel=(3, 2), strides=(2, 1), dilations=(2, 1), pads=(1, 0, 2, 1),
             ceil_mode=True),
        Pool([_t((2, 2, 33, 40))], kind="avg", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), ceil_mode=True,
             count_include_pad=False),
        Pool([_t((1, 2, 20, 64))], kind="avg", kernel=(2, 4), strides=(1, 3), pads=(1, 2, 0, 1),
             count_include_pad=True),
        Pool([_t((1, 2, 20, 40))], kind="max", kernel=(2, 2), strides=(2, 2), pads=(2, 2, 2, 2)),
        # max windows 2 or 3 wide at horizontal stride 2, rows of 16 outputs or more (with AVX-512 in runs
        # of 16; above: the 56x56 and 20x40 ones, and the NaN case of test_numpy_edge_semantics): a
        # vertical stride of 3 with ceil_mode (taps past the right and bottom edges), the right padding
        # read by a run's second load (rows of 49) and by its column after them (rows of 31); then a
        # horizontal stride of 3, a dilation along the rows or down the columns, windows 4 wide: the
        # separable loops
        Pool([_t((1, 2, 30, 37))], kind="max", kernel=(2, 3), strides=(3, 2), pads=(0, 1, 1, 0), ceil_mode=True),
        Pool([_t((1, 4, 10, 49))], kind="max", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
        Pool([_t((1, 4, 10, 31))], kind="max", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
        Pool([_t((1, 2, 12, 50))], kind="max", kernel=(3, 3), strides=(2, 3)),
        Pool([_t((1, 2, 12, 50))], kind="max", kernel=(3, 3), strides=(2, 2), dilations=(1, 2)),
        Pool([_t((1, 2, 20, 40))], kind="max", kernel=(3, 3), strides=(2, 2), dilations=(2, 1)),
        Pool([_t((1, 2, 12, 50))], kind="max", kernel=(2, 4), strides=(2, 2)),
        Softmax([_t((2, 3, 130, 70))], axes=(3,), log=False),
        Softmax([_t((4, 130, 40))], axes=(1,), log=False),            # middle axis: materialized stats
        LayerNorm([_t((3, 50, 300)), _t((300,)), _t((300,))], axis=2, epsilon=1e-5, stash="float32", stats=True),
        # LRN's template: windows cut at both ends of the channels (size 5 of 7, and an even size), two
        # images, a plane of 3 x 19 pixels (not a whole number of vectors), 1-D and 3-D pixels
        LRN([_t((2, 7, 3, 19))], size=5, alpha=1e-2, beta=0.75, bias=1.0),
        LRN([_t((1, 9, 40))], size=4, alpha=0.3, beta=0.5, bias=2.0),
        LRN([_t((1, 3, 2, 3, 5))], size=7, alpha=0.1, beta=1.5, bias=0.5),
        Reduce([_t((40, 500))], kind="max", axes=(1,), keepdims=False),
        Reduce([_t((7, 300, 11))], kind="sum", axes=(0, 2), keepdims=True),
        Binary([_t((8, 64, 300)), _t((300,))], fn="add"),
        Binary([_t((6, 5000)), _t(())], fn="pow"),
        Unary([_t((6, 5000))], fn="erf"),
        Unary([_t((6, 5000))], fn="tanh"),
        Where([_t((1, 1, 64, 64), "bool"), _t((2, 4, 64, 64)), _t(())]),
        Transpose([_t((2, 64, 12, 32))], perm=(0, 2, 3, 1)),
        Gather([_t((1000, 64)), _t((4, 50), "int64")], axis=0),
        Attention([_t((2, 4, 30, 16)), _t((2, 2, 40, 16)), _t((2, 2, 40, 24))], scale_sqrt=0.5),
        ArgReduce([_t((30, 700))], kind="argmax", axis=1, keepdims=False),
        # the scan template: inner dims of two tasks (256 + 44 columns), reversed and exclusive; a last axis
        # (one column a task) in int64; a first axis; unsigned wrap-around
        CumSum([_t((3, 40, 300))], axis=1, exclusive=True, reverse=True),
        CumSum([_t((5, 700), "int64")], axis=1, exclusive=False, reverse=False),
        CumProd([_t((30, 4, 3), "float64")], axis=0, exclusive=True, reverse=False),
        CumSum([_t((600, 2), "uint32")], axis=0, exclusive=False, reverse=True),
        CumProd([_t((2, 9, 5), "int32")], axis=2, exclusive=False, reverse=True),
        # the pad template: reflect on both spatial dims (one pad wider than the plane: reflected twice), edge
        # on the last dim of a 3-D tensor, wrap on the rows only, reflect of a single column
        Pad([_t((2, 3, 9, 20))], begin=(0, 0, 2, 3), end=(0, 0, 9, 1), mode="reflect"),
        Pad([_t((4, 5, 33))], begin=(0, 0, 4), end=(0, 0, 2), mode="edge"),
        Pad([_t((1, 2, 6, 7))], begin=(0, 0, 3, 0), end=(0, 0, 8, 0), mode="wrap"),
        Pad([_t((1, 3, 5, 1))], begin=(0, 0, 1, 2), end=(0, 0, 0, 2), mode="reflect"),
        # Einsums that are matrix products: batched; two batch labels with K^T read in place (attention's
        # scores); the output transposed (its row label last); a dot per batch; vector @ matrix; matrix @ vector;
        Einsum([_t((3, 37, 300)), _t((3, 300, 29))], equation="bij,bjk->bik"),
        Einsum([_t((2, 3, 20, 16)), _t((2, 3, 33, 16))], equation="bhqd,bhkd->bhqk"),
        Einsum([_t((45, 70)), _t((30, 70))], equation="ij,kj->ki"),
        Einsum([_t((6, 50)), _t((6, 50))], equation="bi,bi->b"),
        Einsum([_t((40,)), _t((40, 23))], equation="i,ij->j"),
        Einsum([_t((23, 40)), _t((40,))], equation="ik,k->i"),
        Einsum([_t((4, 9, 30)), _t((4, 30, 11))], equation="bij,bjk->ibk"),  # rows of C apart (a batch between)
        # two row labels nested (one row label), two apart (ViTDet's relative positions: one a batch label B
        # lacks), the output transposed with such a batch label, two column labels apart (A lacks one)
        Einsum([_t((2, 3, 4)), _t((4, 5))], equation="bij,jk->bik"),
        Einsum([_t((3, 5, 6, 16)), _t((5, 7, 16))], equation="bhwc,hkc->bhwk"),
        Einsum([_t((3, 5, 6, 16)), _t((6, 7, 16))], equation="bhwc,wkc->bhwk"),
        Einsum([_t((3, 5, 6, 16)), _t((5, 7, 16))], equation="bhwc,hkc->bhkw"),
        Einsum([_t((9, 20)), _t((4, 20, 13))], equation="ik,bkj->ibj"),
        # TopK's template: a middle axis (rows strided), k = n, int64 values with ties, float64 smallest,
        # float16 (_Float16 compared as is)
        TopK([_t((3, 300, 5))], k=17, axis=1, largest=True),
        TopK([_t((6, 50), "float16")], k=7, axis=1, largest=True),
        TopK([_t((0, 9))], k=3, axis=1, largest=True),  # (a rank's empty shard: nothing to write)
        TopK([_t((20, 9), "int64")], k=9, axis=1, largest=False),
        TopK([_t((40, 3), "float64")], k=4, axis=0, largest=False),
        # every other type the op takes: unsigned keys past the signed range (-3 wrapped), small
        # integers, bfloat16 compared as floats
        TopK([_t((7, 30), "uint64")], k=5, axis=1, largest=True),
        TopK([_t((30, 7), "uint32")], k=6, axis=0, largest=False),
        TopK([_t((5, 40), "uint16")], k=3, axis=1, largest=True),
        TopK([_t((5, 40), "int8")], k=8, axis=1, largest=False),
        TopK([_t((5, 40), "int16")], k=8, axis=1, largest=True),
        TopK([_t((9, 33), "bfloat16")], k=4, axis=1, largest=True),
        # the blocked transpose (64 Ki elements or more): NCHW -> NHWC (64 and 20 channels), NHWC -> NCHW with a
        # batch, a matrix with partial tiles, and a size-1 dim between the blocks
        Transpose([_t((1, 64, 40, 30))], perm=(0, 2, 3, 1)),
        Transpose([_t((2, 20, 50, 70))], perm=(0, 2, 3, 1)),  # (output rows of 20: whole-row tiles, a block's tail)
        Transpose([_t((2, 20, 30, 70))], perm=(0, 3, 1, 2)),
        Transpose([_t((300, 250))], perm=(1, 0)),
        Transpose([_t((70, 1, 1000))], perm=(2, 1, 0)),
        Transpose([_t((40, 50, 40))], perm=(1, 0, 2)),  # rows of 40 move whole: the generic nest
        # the integer GEMM (cpu_library/gemm_int8.h): K past one block of 1024 with a tail of 3 (groups of 4),
        # N off the 64-wide VNNI tile and the 16-column panel, every row tail of the 6-row and 4-row kernels,
        # uint8/int8 A, a zero point per tensor, per row of a batched A, or none
        _i8mm((2, 37, 1103), 77, "uint8", ()),
        _i8mm((130, 520), 200, "int8", (130,)),
        _i8mm((3, 11, 40), 20, "uint8", (11,)),
        _i8mm((1, 1000), 130, "int8", None),
        _i8mm((1000,), 33, "uint8", (1,)),
        _i8mm((9, 64), 64, "int8", ()),
        _i8mm((64, 256), 48, "uint8", None),  # (whole AMX tiles)
        # the bfloat16 GEMM (cpu_library/gemm_bf16.h): K off the 32-deep AMX tile, N off the 16-column panel
        # and the 32-column tiles, row tails of the 16-row AMX tiles and the 12-row vdpbf16ps kernel, one
        # and two rows (the widened path's GEMV), two K blocks of the vdpbf16ps kernel (K > 512), biases
        _bfmm((2, 37, 301), 77),
        _bfmm((1, 300), 129),
        _bfmm((2, 41), 33, bias=(33,)),
        _bfmm((130, 1100), 280, bias=(280,)),
        _bfmm((33, 64), 48, bias=(33, 1), alpha=0.5, beta=0.25),
        _bfmm((17, 31), 20),
        _bfmm((130, 1100), 280, bias=(280,), to="bfloat16"),  # (rounded as it is stored: the AMX and vdpbf16ps stores)
        _bfmm((2, 41), 33, to="bfloat16"),
        _bfmm((33, 64), 48, bias=(33, 1), alpha=0.5, beta=0.25, to="bfloat16"),  # (a bias per row, scaled)
        _bfmm((1, 300), 129, to="bfloat16"),
        # K a multiple of 32 over two blocks of k: vdpbf16ps reads A's rows in place (no packed copy)
        _bfmm((20, 1024), 70, bias=(70,)),
        # a token's routed experts: GEMVs on each chosen expert's [N, K] weight, with its bias
        ExpertMatMul([_t((3, 300)), _t((6, 203, 300)), _t((3, 2), "int64"), _t((6, 203))]),
        ExpertMatMul([_t((2, 2, 40)), _t((3, 70, 40)), _t((2, 2), "int32")]),
        # many slots on few experts: one GEMM per expert on its gathered rows (and an expert's single slot)
        ExpertMatMul([_t((12, 300)), _t((4, 70, 300)), _t((12, 3), "int64"), _t((4, 70))]),
        # the integer conv (cpu_library/conv_int8.h): 3x3 with padding (AMX's 16+ output channels, K off 64),
        # 1x1 on the image's rows (pixels off the 16-column panel), a strided 7x7 (gathered taps), groups of
        # few channels (the VNNI kernel), a 1-D conv, two images; uint8/int8 images, zero point or none
        _i8conv((1, 24, 13, 11), 40, (3, 3), "uint8", True, pads=(1, 1, 1, 1)),
        _i8conv((2, 70, 9, 7), 33, (1, 1), "int8", True),
        _i8conv((1, 3, 30, 29), 16, (7, 7), "uint8", True, strides=(2, 2), pads=(3, 3, 3, 3)),
        _i8conv((1, 32, 10, 12), 48, (3, 3), "int8", False, group=4, strides=(1, 2), dilations=(2, 1),
                pads=(2, 1, 2, 1)),
        _i8conv((1, 40, 50), 24, (5,), "uint8", True, strides=(2,), pads=(2, 2)),
        # the bfloat16 conv (cpu_library/conv_bf16.h): K off the 32-deep AMX tile, 16+ output channels and fewer,
        # stride 2 (gathered taps), groups, a 1-D conv, with and without a bias
        _bfconv((1, 24, 13, 11), 40, (3, 3), pads=(1, 1, 1, 1), bias=True),
        _bfconv((2, 70, 9, 7), 9, (1, 1)),
        _bfconv((1, 8, 30, 29), 16, (5, 5), strides=(2, 2), pads=(2, 2, 2, 2), bias=True),
        _bfconv((1, 32, 10, 12), 48, (3, 3), group=4, strides=(1, 2), dilations=(2, 1), pads=(2, 1, 2, 1)),
        _bfconv((1, 40, 50), 24, (3,), strides=(2,), pads=(1, 1), bias=True),
        _bfconv((1, 24, 13, 11), 40, (3, 3), pads=(1, 1, 1, 1), bias=True, lo=0.0, to="bfloat16"),  # (its store)
        _bfconv((2, 70, 9, 7), 9, (1, 1), lo=-1.0, hi=2.0),
        # float16 panels (a weight of float16 values), widened per K block of a tile (SfHalfPrepacked) or in the
        # GEMV: two K blocks and a column tail, one row, tiles with a bias, a last tile of one panel
        PackedMatMul([_t((2, 37, 300)), _panels(300, 77, "float16")], n=77),
        PackedMatMul([_t((1, 300)), _panels(300, 129, "float16")], n=129),
        PackedMatMul([_t((130, 520)), _panels(520, 280, "float16"), _t((280,))], n=280),
        PackedMatMul([_t((7, 40)), _panels(40, 33, "float16")], n=33, alpha=0.5),
        # blocks of C that threads own (sf_gemm_blocks; test_products_on_more_threads): row
        # blocks, 2 x 2 and 3 x 2 grids with a column bias, strips of columns with a row bias, uneven strips
        PackedMatMul([_t((200, 64)), _panels(64, 1000), _t((1000,))], n=1000),
        PackedMatMul([_t((16, 64)), _panels(64, 1000), _t((16, 1))], n=1000, alpha=0.5, beta=0.25),
        PackedMatMul([_t((40, 100)), _panels(100, 2000, "float16")], n=2000),
        # float64 products (sf_dgemm): batch folded into M with two K blocks and row and column tails, broadcast
        # batch dims, a vector times batched matrices (small products, one per thread), a matrix times a vector,
        # threads over row blocks and column ranges, Gemm's transposes, alpha, beta and biases of rows, columns
        # and one value
        MatMul([_t((2, 37, 300), "float64"), _t((300, 77), "float64")]),
        MatMul([_t((3, 1, 29, 40), "float64"), _t((5, 40, 33), "float64")]),
        MatMul([_t((300,), "float64"), _t((4, 300, 50), "float64")]),
        MatMul([_t((50, 300), "float64"), _t((300,), "float64")]),
        MatMul([_t((130, 520), "float64"), _t((520, 280), "float64")]),
        Gemm([_t((300, 45), "float64"), _t((70, 300), "float64"), _t((70,), "float64")], trans_a=True, trans_b=True,
             alpha=0.5, beta=2.0),
        Gemm([_t((64, 96), "float64"), _t((96, 80), "float64"), _t((64, 1), "float64")], beta=0.25),
        Gemm([_t((13, 7), "float64"), _t((7, 9), "float64"), _t((1,), "float64")]),
        # the pad template over three dims: reflect of two volumes' depth, rows and columns (a depth pad wider
        # than the volume: reflected twice), edge on the first dim of a 3-D tensor, wrap of the depth only
        Pad([_t((2, 3, 4, 9, 20))], begin=(0, 0, 5, 2, 3), end=(0, 0, 1, 1, 1), mode="reflect"),
        Pad([_t((4, 6, 7))], begin=(1, 0, 0), end=(2, 1, 0), mode="edge"),
        Pad([_t((1, 2, 5, 6, 7))], begin=(0, 0, 2, 0, 0), end=(0, 0, 3, 0, 0), mode="wrap"),
    ]
    rng = np.random.default_rng(1)
    res = []
    for k, op in enumerate(ops):
        arrays = [_rand(rng, t) for t in op.inputs]
        if op.op_type == "Binary" and op.attrs["fn"] == "pow":
            arrays[1] = np.array(3.0, np.float32)
        if op.op_type == "Gather":
            arrays[1] = rng.integers(-1000, 1000, op.inputs[1].shape)
        if op.op_type == "PackedMatMulInteger":  # the whole byte range, and a packed weight with its zero point
            lo = {"uint8": 0, "int8": -128}
            arrays = [rng.integers(lo[t.dtype], lo[t.dtype] + 256, t.shape).astype(t.dtype) if t.dtype != "int32"
                      else None for t in op.inputs]
            b = rng.integers(-128, 128, (op.inputs[0].shape[-1], op.attrs["n"])).astype(np.int8)
            arrays[1:3] = pack_int8_panels(b, rng.integers(-128, 128, op.attrs["n"]).astype(np.int8))
        if op.op_type == "PackedConvInteger":  # the whole byte range, a weight of bytes less a zero point per channel
            x, oc, g = op.inputs[0], op.attrs["oc"], op.attrs.get("group", 1)
            lo = -128 if x.dtype == "int8" else 0
            arrays[0] = rng.integers(lo, lo + 256, x.shape).astype(x.dtype)
            w = rng.integers(-128, 128, (oc, x.shape[1] // g) + tuple(op.attrs["kernel"])).astype(np.int32)
            arrays[1:3] = pack_int8_conv(w - rng.integers(-128, 128, (oc,) + (1,) * (w.ndim - 1)), g)
            if len(op.inputs) > 3:
                arrays[3] = np.array(rng.integers(lo, lo + 256), x.dtype)
        if op.op_type == "PackedConvBf16":  # bfloat16 values, and the weight's rows
            x, oc, g = op.inputs[0], op.attrs["oc"], op.attrs.get("group", 1)
            arrays[0] = rng.standard_normal(x.shape).astype(np.dtype("bfloat16"))
            w = rng.standard_normal((oc, x.shape[1] // g) + tuple(op.attrs["kernel"])).astype(np.dtype("bfloat16"))
            arrays[1] = pack_bf16_conv(w, g)
        if op.op_type == "PackedMatMulBf16":  # bfloat16 values, and a packed weight
            arrays[0] = rng.standard_normal(op.inputs[0].shape).astype(np.dtype("bfloat16"))
            depth = op.inputs[0].shape[-1]  # (not k: the case's index, which names it)
            arrays[1] = pack_bf16_panels(rng.standard_normal((depth, op.attrs["n"])).astype(np.dtype("bfloat16")))
        if op.op_type == "ExpertMatMul":  # experts in range, and one past the last or below 0 (a row of zeros)
            e_len = op.inputs[1].shape[0]
            arrays[2] = rng.integers(-1, e_len + 1, op.inputs[2].shape).astype(op.inputs[2].dtype)
            arrays[2].flat[:2] = [e_len, -1]
        if op.op_type == "WinogradConv":  # the transform of 3x3 weights
            c = op.inputs[0].shape[1] * (op.inputs[0].shape[-1] if op.attrs.get("blocked_in") else 1)
            w = rng.standard_normal((op.attrs["oc"], c, 3, 3)).astype(np.float32)
            arrays[1] = winograd_weights(w, op.attrs["m"])
        res.append((f"large-{k}-{op.op_type}", op, arrays))
    return res + _attention_cases()


def _attention_cases():
    """The Attention template's cases (sf_attention): masks float and bool, broadcast and with fewer keys
    than K, rows every key of which is excluded (their output is 0), NaN in a mask, nonpad_kv_seqlen with
    and without a past, causal with a past, windows, softcap, grouped K/V heads, the 3-D forms, several
    blocks of query rows (causal blocks skipping keys), keys past 4096 (8-row blocks), one query row,
    attention sinks."""
    rng = np.random.default_rng(3)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    fmask = np.where(rng.random((3, 7)) > 0.3, rng.standard_normal((3, 7)), -np.inf).astype(np.float32)
    fmask[1] = -np.inf  # every key masked: the row is 0
    bmask = rng.random((2, 1, 3, 9)) > 0.4
    bmask[1, 0, 2] = False
    nanmask = f(1, 1, 4, 6)
    nanmask[0, 0, 1, 2] = np.nan  # row 1's output is NaN
    nanmask[0, 0, 2] = -np.inf
    nanmask[0, 0, 2, 4] = np.nan  # so is row 2's: a NaN among -inf is not "every key masked"
    bmask_sink = rng.random((2, 1, 5, 9)) > 0.3
    bmask_sink[1, 0, 3] = False
    fmask_blocks = np.where(rng.random((1, 1, 160, 170)) > 0.1, rng.standard_normal((1, 1, 160, 170)),
                            -np.inf).astype(np.float32)
    cases = [
        ("gqa", Attention([_t((2, 4, 3, 8)), _t((2, 2, 9, 8)), _t((2, 2, 9, 5))], scale_sqrt=0.6),
         [f(2, 4, 3, 8), f(2, 2, 9, 8), f(2, 2, 9, 5)]),
        ("float-mask-causal-past", Attention([_t((2, 2, 3, 8)), _t((2, 2, 9, 8)), _t((2, 2, 9, 8)), _t((3, 7))],
                                             scale_sqrt=0.5, has_mask=True, is_causal=True, past_len=5),
         [f(2, 2, 3, 8), f(2, 2, 9, 8), f(2, 2, 9, 8), fmask]),
        ("bool-mask-nonpad-softcap-3d", Attention([_t((2, 3, 12)), _t((2, 9, 12)), _t((2, 9, 6)),
                                                   _t((2, 1, 3, 9), "bool"), _t((2,), "int64")],
                                                  q_heads=2, kv_heads=2, scale_sqrt=0.7, softcap=1.5, has_mask=True,
                                                  has_nonpad=True, is_causal=True),
         [f(2, 3, 12), f(2, 9, 12), f(2, 9, 6), bmask, np.array([7, 4], np.int64)]),
        ("nonpad-past-windows", Attention([_t((2, 2, 4, 8)), _t((2, 1, 10, 8)), _t((2, 1, 10, 8)),
                                           _t((2,), "int64")], scale_sqrt=0.5, has_nonpad=True, past_len=4,
                                          is_causal=True, left_window=2, right_window=1),
         [f(2, 2, 4, 8), f(2, 1, 10, 8), f(2, 1, 10, 8), np.array([10, 6], np.int64)]),
        ("nan-mask-y3d", Attention([_t((1, 2, 4, 8)), _t((1, 2, 6, 8)), _t((1, 2, 6, 8)), _t((1, 1, 4, 6))],
                                   scale_sqrt=0.5, has_mask=True, y_3d=True),
         [f(1, 2, 4, 8), f(1, 2, 6, 8), f(1, 2, 6, 8), nanmask]),
        ("causal-blocks", Attention([_t((1, 3, 150, 16)), _t((1, 3, 150, 16)), _t((1, 3, 150, 16))],
                                    scale_sqrt=0.5, is_causal=True),
         [f(1, 3, 150, 16), f(1, 3, 150, 16), f(1, 3, 150, 16)]),
        ("long-keys", Attention([_t((1, 1, 20, 8)), _t((1, 1, 5000, 8)), _t((1, 1, 5000, 4))], scale_sqrt=0.5),
         [f(1, 1, 20, 8), f(1, 1, 5000, 8), f(1, 1, 5000, 4)]),
        ("one-row", Attention([_t((1, 2, 1, 8)), _t((1, 2, 33, 8)), _t((1, 2, 33, 8))], scale_sqrt=0.5,
                              is_causal=True, past_len=32),
         [f(1, 2, 1, 8), f(1, 2, 33, 8), f(1, 2, 33, 8)]),
        # K^T and V packed once per key head (more than one block of 128 rows, or grouped heads): a left
        # window (blocks' first keys inside a panel of 16), a float mask, Dv not a multiple of 16; a bool
        # mask, nonpad lengths and a softcap
        ("blocks-window-gqa", Attention([_t((1, 4, 160, 8)), _t((1, 2, 170, 8)), _t((1, 2, 170, 12)),
                                         _t((1, 1, 160, 170))], scale_sqrt=0.5, has_mask=True, is_causal=True,
                                        past_len=10, left_window=37),
         [f(1, 4, 160, 8), f(1, 2, 170, 8), f(1, 2, 170, 12), fmask_blocks]),
        ("blocks-nonpad-softcap", Attention([_t((2, 2, 140, 8)), _t((2, 2, 140, 8)), _t((2, 2, 140, 8)),
                                             _t((2, 1, 140, 140), "bool"), _t((2,), "int64")], scale_sqrt=0.6,
                                            softcap=2.0, has_mask=True, has_nonpad=True),
         [f(2, 2, 140, 8), f(2, 2, 140, 8), f(2, 2, 140, 8), rng.random((2, 1, 140, 140)) > 0.2,
          np.array([140, 77], np.int64)]),
        # attention sinks (gpt-oss): a window, a bool mask hiding every key of one row (its output 0)
        ("sink-window-gqa", Attention([_t((2, 4, 5, 8)), _t((2, 2, 9, 8)), _t((2, 2, 9, 8)),
                                       _t((2, 1, 5, 9), "bool"), _t((4,))], scale_sqrt=0.5, has_mask=True,
                                      has_sink=True, is_causal=True, past_len=4, left_window=3),
         [f(2, 4, 5, 8), f(2, 2, 9, 8), f(2, 2, 9, 8), bmask_sink, f(4) * 2]),
    ]
    return [(f"attention-{name}", op, arrays) for name, op, arrays in cases]


class _Fn(Operator):
    """Test-only op: one UNARY_FUNCS/BINARY_FUNCS function on its inputs; ``op.run`` is the
    reference evaluator (the default ``Operator.numpy``)."""

    def compute(self, *xs):
        fn = self.attrs["fn"]
        if len(xs) == 1:
            return compute("y", xs[0].shape, lambda *i: UnaryOp(fn, xs[0][i]))
        return compute("y", xs[0].shape, lambda *i: BinOp(fn, xs[0][i], xs[1][i]))


_FVALS = np.array([-2.5, -1.0, -0.5, -0.0, 0.0, 0.3, 0.5, 1.0, 1.5, 2.5, 3.0, 7.25, 100.0, -100.0, np.inf, -np.inf,
                   np.nan, 1e-30, -40.0, 0.999], np.float64)
_IVALS = np.array([-7, -5, -2, -1, 0, 1, 2, 3, 5, 7, 64, -64, 100, -100, 127, -128, 4, 9, -9, 1], np.int64)


def _fn_cases():
    """Every unary and binary function on the dtypes numpy accepts it for, with NaN, infinities,
    signed zeros, negative operands and zero divisors."""
    from shardflow.compiler.ir.expr import BINARY_FUNCS, UNARY_FUNCS
    int_unary = {"neg", "abs", "sign", "bitnot", "not", "isnan", "isinf", "isposinf", "isneginf", "floor", "ceil",
                 "round", "reciprocal", "exp", "sqrt", "erf"}
    bool_unary = {"not", "bitnot", "isnan", "isinf"}
    f16_unary = {"exp", "tanh", "erf", "sigmoid", "sqrt", "neg", "round", "log", "abs", "rsqrt"}
    bits = {"bitand", "bitor", "bitxor", "shl", "shr"}
    bool_binary = {"and", "or", "xor", "add", "mul", "max", "min", "eq", "ne", "lt", "ge", "bitand", "bitor", "bitxor"}
    small_int_binary = {"add", "sub", "mul", "floordiv", "mod", "fmod", "truncdiv", "max", "min", "bitand", "shl", "shr",
                        "lt", "eq"}
    f16_binary = {"add", "mul", "div", "pow", "max", "sub"}
    rng = np.random.default_rng(3)
    f = np.concatenate([_FVALS, rng.uniform(-3, 3, 12)])
    ii = np.concatenate([_IVALS, rng.integers(-50, 50, 12)])
    arr = {"float32": f.astype(np.float32), "float64": f, "float16": np.clip(f, -60000, 60000).astype(np.float16),
           "int64": ii, "int8": np.clip(ii, -128, 127).astype(np.int8), "uint8": (ii % 256).astype(np.uint8),
           "bool": ii % 3 == 0}
    cases = []
    for fn in sorted(UNARY_FUNCS):
        dts = ["float32", "float64"] + (["int64"] if fn in int_unary else []) + (["bool"] if fn in bool_unary else []) \
            + (["float16"] if fn in f16_unary else [])
        if fn == "bitnot":
            dts = ["int64", "bool"]
        for dt in dts:
            cases.append((f"fn-{fn}-{dt}", fn, [arr[dt]]))
    for fn in sorted(BINARY_FUNCS):
        dts = (["float32", "float64"] if fn not in bits else []) + ["int64"] \
            + (["int8", "uint8"] if fn in small_int_binary else []) + (["bool"] if fn in bool_binary else []) \
            + (["float16"] if fn in f16_binary else [])
        for dt in dts:
            a = arr[dt]
            b = np.roll(a, 7)
            if fn == "pow" and dt in ("int64", "int8", "uint8"):
                a, b = np.clip(a, -3, 3), np.abs(b) % 5
            if fn in ("shl", "shr"):
                b = np.abs(b) % 70 if dt == "int64" else np.abs(b) % 9
            cases.append((f"fn-{fn}-{dt}", fn, [a, b.astype(a.dtype)]))
    return cases


EXAMPLES = _examples()
LARGE = _large()
FNS = _fn_cases()


def _example_op(cls, arrays, attrs, name):
    return cls([const_tensor(a) for a in arrays], name=name, **attrs)


@pytest.fixture(scope="session")
def library(tmp_path_factory, kernel_cache):
    """One library with every lowerable example and the large cases (``-O1``: compile time)."""
    d = tmp_path_factory.mktemp("cpu_kernels")
    cases = {}
    for cid, cls, arrays, attrs in EXAMPLES:
        op = _example_op(cls, arrays, attrs, cid)
        cases[cid] = (op, arrays)
    for cid, op, arrays in LARGE:
        op.name = cid
        cases[cid] = (op, arrays)
    for cid, fn, arrays in FNS:
        cases[cid] = (_Fn([_t(a.shape, str(a.dtype)) for a in arrays], name=cid, fn=fn), arrays)
    ops = [op for op, _ in cases.values()]
    t0 = time.perf_counter()
    symbols = build_cpu_library(ops, str(d / "kernels.so"), cache_dir=kernel_cache, opt_level=1)
    build_s = time.perf_counter() - t0
    lib = ctypes.CDLL(str(d / "kernels.so"))
    return {"lib": lib, "symbols": symbols, "cases": cases, "dir": d, "ops": ops, "build_s": build_s}


def run_kernel(lib, symbol, op, arrays):
    ins = [np.ascontiguousarray(a, dtype=t.dtype) for a, t in zip(arrays, op.inputs)]
    outs = [np.empty(t.shape, t.dtype) for t in op.outputs]
    ia = (ctypes.c_void_p * max(len(ins), 1))(*[a.ctypes.data for a in ins])
    oa = (ctypes.c_void_p * len(outs))(*[o.ctypes.data for o in outs])
    fn = getattr(lib, symbol)
    fn.restype = None
    fn(ia, oa)
    return outs


def assert_matches(got, want, dtypes):
    assert len(got) == len(want)
    for g, w, dt in zip(got, want, dtypes):
        assert g.shape == w.shape and g.dtype == np.dtype(dt)
        if w.dtype.kind == "f":
            f16 = w.dtype == np.float16
            np.testing.assert_allclose(g, w, rtol=2e-3 if f16 else 1e-5, atol=1e-3 if f16 else 1e-6, equal_nan=True)
        else:
            np.testing.assert_array_equal(g, w)


def _compiled_for_cpu(op) -> bool:
    """Whether the cpu target compiles ``op``: the generic lowering or a template (TopK's definition is
    an extern, which only the template implements)."""
    from shardflow.compiler.codegen.templates_cpu import template_kind

    return lowerable(op) or template_kind(op) is not None


# --------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("cid", [c[0] for c in EXAMPLES])
def test_example_kernel_matches_numpy(library, cid):
    op, arrays = library["cases"][cid]
    if not _compiled_for_cpu(op):
        assert cid not in library["symbols"]
        pytest.skip(f"not lowerable: {why_not_lowerable(op)}")
    want = op.run(*arrays)
    with np.errstate(all="ignore"):
        got = run_kernel(library["lib"], library["symbols"][cid], op, arrays)
    assert_matches(got, want, [t.dtype for t in op.outputs])


@pytest.mark.parametrize("cid", [c[0] for c in LARGE])
def test_large_kernel_matches_numpy(library, cid):
    op, arrays = library["cases"][cid]
    want = op.run(*arrays)
    got = run_kernel(library["lib"], library["symbols"][cid], op, arrays)
    if op.outputs[0].dtype == "bfloat16":  # (a bfloat16 product's output: sums in another order, one rounding)
        for g, w in zip(got, want):
            w = w.astype(np.float32)
            np.testing.assert_allclose(g.astype(np.float32), w, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(w).max()))
    elif op.op_type in ("MatMul", "Gemm", "PackedMatMul", "Conv", "PackedConv", "WinogradConv", "ConvTranspose",
                        "Attention", "MatMulNBits", "ExpertMatMul", "PackedMatMulBf16"):
        # blocked FMA accumulation vs numpy's BLAS: compare relative to the output's scale
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(np.nanmax(np.abs(w))))
    else:
        # long float32 reductions: our summation order differs from numpy's pairwise sums
        for g, w, t in zip(got, want, op.outputs):
            assert g.dtype == np.dtype(t.dtype) and g.shape == w.shape
            if w.dtype.kind == "f":
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("cid", [c[0] for c in FNS])
def test_function_semantics_match_the_evaluator(library, cid):
    op, arrays = library["cases"][cid]
    with np.errstate(all="ignore"):
        want = op.run(*arrays)
        got = run_kernel(library["lib"], library["symbols"][cid], op, arrays)
    g, w = got[0], want[0]
    assert g.dtype == w.dtype
    if w.dtype.kind == "f":
        # float16 math runs in float32 (numpy rounds each op to half): a few half ulps
        tol = dict(rtol=2e-3, atol=1e-3) if w.dtype == np.float16 else dict(rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, w, equal_nan=True, **tol)
    else:
        np.testing.assert_array_equal(g, w)


_ISA_SCRIPT = r"""
import ctypes, sys
import ml_dtypes
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
lib.shardflow_cpu_isa.restype = ctypes.c_char_p
lib.shardflow_cpu_bf16_isa.restype = ctypes.c_char_p
lib.shardflow_cpu_int8_isa.restype = ctypes.c_char_p
print(lib.shardflow_cpu_isa().decode(), lib.shardflow_cpu_bf16_isa().decode(), lib.shardflow_cpu_int8_isa().decode())
data = np.load(sys.argv[2], allow_pickle=True)
for case in data["cases"]:
    sym, ins, outs = case
    got = [np.empty_like(w) for w in outs]
    ia = (ctypes.c_void_p * len(ins))(*[a.ctypes.data for a in ins])
    oa = (ctypes.c_void_p * len(got))(*[o.ctypes.data for o in got])
    getattr(lib, sym)(ia, oa)
    for g, w in zip(got, outs):
        if w.dtype.kind in "iu":  # the integer GEMM: exact
            np.testing.assert_array_equal(g, w)
        elif w.dtype == ml_dtypes.bfloat16:  # (stored rounded: the sums' order may round the other way)
            w = w.astype(np.float32)
            np.testing.assert_allclose(g.astype(np.float32), w, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(w).max()))
        else:
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(np.nanmax(np.abs(w))))
print("ok", len(data["cases"]))
"""


def _run_forced_isa(lib_path, cases, isa, tmp_path, env=None) -> tuple[str, str]:
    """Run ``cases`` ``[(symbol, inputs, wanted outputs)]`` of the library at ``lib_path`` in a fresh
    process with ``SHARDFLOW_CPU_ISA=isa`` and ``env`` (:data:`_ISA_SCRIPT` compares them); returns the ISAs the
    library picked (its float32 GEMM's, bfloat16 GEMM's and integer GEMM's, space-separated) and the script's last line
    (``ok N`` when all N matched)."""
    import subprocess
    import sys
    np.savez(tmp_path / "cases.npz", cases=np.array(cases, dtype=object))
    script = tmp_path / "isa.py"
    script.write_text(_ISA_SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(lib_path), str(tmp_path / "cases.npz")],
                         capture_output=True, text=True, env=dict(os.environ, SHARDFLOW_CPU_ISA=isa, **(env or {})),
                         timeout=300)
    assert res.returncode == 0, (isa, res.stderr[-3000:])
    return res.stdout.split("\n")[0], res.stdout.strip().split("\n")[-1]


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_gemm_micro_kernels_of_other_cpus(library, tmp_path, isa):
    """The AVX2 (6x16) and portable (4x8) GEMM micro-kernels (and the conv kernels, Winograd
    transforms and packing of each), forced with SHARDFLOW_CPU_ISA, give the same results (this machine
    would otherwise only run the widest one it supports); the transposed convs, attention and the blocked
    transposes (8 x 8 register blocks with AVX2, element by element otherwise) run on them, and the
    integer GEMM's AVX2 (4x8, int16 pairs) and portable (4x16) kernels match exactly."""
    cases = []
    for cid, op, arrays in LARGE:
        if op.op_type in ("MatMul", "Gemm", "PackedMatMul", "Conv", "PackedConv", "WinogradConv", "ConvTranspose",
                          "Attention", "PackedMatMulInteger", "PackedConvInteger", "MatMulNBits", "Transpose") \
                and cid in library["symbols"]:
            want = [np.ascontiguousarray(w) for w in op.run(*arrays)]  # (numpy's transposes are views)
            cases.append((library["symbols"][cid], [np.ascontiguousarray(a) for a in arrays], want))
    first, last = _run_forced_isa(library["dir"] / "kernels.so", cases, isa, tmp_path)
    assert last == f"ok {len(cases)}" and len(cases) >= 20
    first = first.split()[0]
    assert first == isa or (isa == "avx2" and first == "generic")  # a CPU without AVX2 falls back


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_products_on_more_threads(library, tmp_path, isa):
    """With 3, 4 and 6 threads (OMP_NUM_THREADS; this machine has 2), the products and convs of the large
    cases match numpy: the products split C into blocks that each thread computes whole (sf_gemm_blocks;
    with prepacked weights, float32 and float16 panels, with low-bit weights dequantized and bfloat16 ones
    widened per call (forced to AVX-512, AVX2 and the portable kernels, the bfloat16 products take the
    widened path), and with operands packed per call, transposed ones included): blocks of rows, strips
    of columns (of the kernel's width; some strips a panel wider than others), 2 x 2 and 3 x 2 grids,
    biases of rows and of columns."""
    cases = [(library["symbols"][cid], [np.ascontiguousarray(a) for a in arrays],
              [np.ascontiguousarray(w) for w in op.run(*arrays)])
             for cid, op, arrays in LARGE
             if op.op_type in ("MatMul", "Gemm", "PackedMatMul", "MatMulNBits", "PackedMatMulBf16", "PackedConvBf16",
                               "Conv", "PackedConv", "ConvTranspose")
             and cid in library["symbols"]]
    assert sum(op.op_type == "PackedMatMul" for _, op, _ in LARGE) >= 15 and len(cases) >= 40
    # (and a team of one where 4 threads are asked for, OMP_THREAD_LIMIT: as inside another parallel region,
    # each thread of a team smaller than the grid computes several blocks)
    for env in ({"OMP_NUM_THREADS": "3"}, {"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "6"},
                {"OMP_NUM_THREADS": "4", "OMP_THREAD_LIMIT": "1"}):
        first, last = _run_forced_isa(library["dir"] / "kernels.so", cases, isa, tmp_path, env=env)
        assert last == f"ok {len(cases)}", (env, last)


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


@pytest.mark.parametrize("isa", ["amx", "avx512bf16", "avx512", "avx2", "generic"])
def test_bfloat16_gemm_on_each_instruction_set(library, tmp_path, isa):
    """The bfloat16 GEMM's three paths (AMX tiles, AVX-512's vdpbf16ps, and both operands widened for the
    float32 GEMM's kernel, itself forced to AVX-512, AVX2 or the portable one), each forced with
    SHARDFLOW_CPU_ISA, match numpy on the large cases, products and convs; a path the CPU lacks falls back to the
    next (this machine would otherwise run only the first it has)."""
    cases = [(library["symbols"][cid], [np.ascontiguousarray(a) for a in arrays], op.run(*arrays))
             for cid, op, arrays in LARGE if op.op_type in ("PackedMatMulBf16", "PackedConvBf16")]
    first, last = _run_forced_isa(library["dir"] / "kernels.so", cases, isa, tmp_path)
    assert last == f"ok {len(cases)}" and len(cases) >= 11
    flags = _cpu_flags()
    want = ("amx" if isa == "amx" and {"amx_bf16", "amx_tile"} <= flags else
            "avx512bf16" if isa in ("amx", "avx512bf16") and "avx512_bf16" in flags else "widened")
    assert first.split()[1] == want, (first, sorted(flags & {"amx_bf16", "amx_tile", "avx512_bf16"}))


@pytest.mark.parametrize("isa", ["amx", "avx512"])
def test_integer_gemm_on_each_instruction_set(library, tmp_path, isa):
    """The integer GEMM on AMX tiles (tdpbusd, for 16 rows or more) and on AVX-512 VNNI, each forced with
    SHARDFLOW_CPU_ISA, match numpy exactly on the large cases, products and convs (AVX2's and the portable
    kernel: test_gemm_micro_kernels_of_other_cpus); a CPU without one falls back to the next."""
    cases = [(library["symbols"][cid], [np.ascontiguousarray(a) for a in arrays], op.run(*arrays))
             for cid, op, arrays in LARGE if op.op_type in ("PackedMatMulInteger", "PackedConvInteger")]
    from shardflow.compiler.codegen.templates_cpu import template_body

    assert sum(op.inputs[0].ndim >= 2 and op.inputs[0].shape[-2] >= 16 for _, op, _ in LARGE
               if op.op_type == "PackedMatMulInteger") >= 3  # (each GEMM has 16 rows or more)
    assert all("sf_iconv2d)(" in template_body(op) for _, op, _ in LARGE if op.op_type == "PackedConvInteger")
    first, last = _run_forced_isa(library["dir"] / "kernels.so", cases, isa, tmp_path)
    assert last == f"ok {len(cases)}" and len(cases) >= 12
    flags = _cpu_flags()
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= flags
    want = ("amx" if isa == "amx" and {"amx_int8", "amx_tile"} <= flags else
            "avx512vnni" if vnni else "avx2" if "avx2" in flags else "generic")
    assert first.split()[2] == want, (first, sorted(flags & {"amx_int8", "amx_tile", "avx512_vnni"}))


def test_float64_products_use_their_template():
    """Float64 MatMul and Gemm run sf_dgemm (the generic nest took 46x onnxruntime's time on a [256, 512] @
    [512, 512] product, rfcs/0002 "Float64 products"); products of other dtypes than float32 and float64,
    or of mixed ones, are not taken."""
    from shardflow.compiler.codegen.templates_cpu import template_body, template_kind

    f64 = [op for _, op, _ in LARGE if op.op_type in ("MatMul", "Gemm") and op.outputs[0].dtype == "float64"]
    assert len(f64) == 8 and all(template_kind(op) == op.op_type and "sf_dgemm" in template_body(op) for op in f64)
    assert not any("sf_dgemm" in template_body(op) for _, op, _ in LARGE if op.outputs[0].dtype == "float32"
                   and template_body(op))
    assert template_kind(MatMul([_t((4, 8), "float64"), _t((8, 3), "float32")])) is None
    assert template_kind(MatMul([_t((4, 8), "int64"), _t((8, 3), "int64")])) is None


def test_3d_convs_use_their_template():
    """3-D convs run sf_conv3d (the generic nest was 26-28x onnxruntime's time, rfcs/0002) and take the ops
    its kernels finish (test_3d_conv_kernels_finish_a_residual_and_a_clamp). One whose padded volume needs
    offsets past int32 is left to the generic nest."""
    from shardflow.compiler.codegen.templates_cpu import accepts_epilogue, template_body, template_kind

    convs = [op for _, op, _ in LARGE
             if op.op_type == "Conv" and op.inputs[0].ndim == 5 and not op.attrs.get("blocked_in")]
    assert len(convs) == 7 and all(template_kind(op) == "Conv" for op in convs)
    assert all("sf_conv3d)(" in template_body(op) and accepts_epilogue(op) for op in convs)
    huge = Conv([_t((1, 2, 1024, 1024, 1023)), _t((4, 2, 3, 3, 3))], pads=(1,) * 6)  # 2 x 1026 x 1026 x 1025 floats
    assert template_body(huge) is None


def test_scans_lrn_pads_and_einsums_use_their_templates():
    """CumSum/CumProd (one pass; the definition's lowering is quadratic in the axis), LRN (rows that
    vectorize), reflect/edge/wrap pads of the last three dims (row copies) and Einsums that are matrix products (the GEMM)
    take their templates in the dtypes they run in; float16 scans, constant pads (fast and fusable in
    the generic nest) and other einsums keep it."""
    from shardflow.compiler.codegen.templates_cpu import template_kind

    ops = [op for _, op, _ in LARGE if op.op_type in ("CumSum", "CumProd", "LRN", "Pad")]
    assert len(ops) == 15 and all(template_kind(op) == op.op_type for op in ops)
    assert template_kind(CumSum([_t((4, 5), "float16")], axis=1, exclusive=False, reverse=False)) is None
    assert template_kind(Pad([_t((1, 2, 6, 7))], begin=(0, 0, 1, 1), end=(0, 0, 1, 1), mode="constant")) is None
    assert template_kind(Pad([_t((2, 4, 6, 7))], begin=(1, 0, 0, 0), end=(0, 0, 0, 0), mode="edge")) is None
    from shardflow.compiler.codegen.templates_cpu import template_body
    for neg, pos in ((TopK([_t((5, 300))], k=3, axis=-1), TopK([_t((5, 300))], k=3, axis=1)),
                     (CumSum([_t((5, 30, 4))], axis=-2, exclusive=False, reverse=False),
                      CumSum([_t((5, 30, 4))], axis=1, exclusive=False, reverse=False))):
        assert template_body(neg) == template_body(pos)  # a negative axis counts from the end
    blocked = [op for _, op, _ in LARGE if op.op_type == "Transpose" and template_kind(op) == "Transpose"]
    assert len(blocked) == 5
    assert template_kind(Transpose([_t((4, 128, 12, 64))], perm=(0, 2, 1, 3))) is None  # rows of 64 move whole
    assert template_kind(Transpose([_t((2, 64, 12, 32))], perm=(0, 2, 3, 1))) is None  # small: fuses in the nest
    einsums = [op for _, op, _ in LARGE if op.op_type == "Einsum"]
    assert len(einsums) == 12 and all(template_kind(op) == "Einsum" for op in einsums)
    # a label summed within one operand, a broadcast batch, two contracted labels apart, a batch label last
    # (no output label contiguous): the nest
    for eq, shapes in (("bij,bjk->bk", ((2, 3, 4), (2, 4, 5))), ("bij,bjk->bik", ((1, 3, 4), (2, 4, 5))),
                       ("ijk,jlk->il", ((2, 3, 4), (3, 5, 4))), ("ijb,jkb->ikb", ((3, 4, 2), (4, 5, 2)))):
        assert template_kind(Einsum([_t(shapes[0]), _t(shapes[1])], equation=eq)) is None, eq


def test_blocked_depthwise_convs_use_their_template():
    """The depthwise convs of the blocked layout run ``sf_conv_depthwise`` with the sides they have blocked;
    a grouped conv of two channels per group with the attributes has no template."""
    from shardflow.compiler.codegen.templates_cpu import template_body

    ops = [op for _, op, _ in LARGE if op.op_type == "Conv" and (op.attrs.get("blocked_in") or
                                                                op.attrs.get("blocked_out"))]
    flags = [template_body(op).split("sf_conv_depthwise)(")[1].split(", ")[8] for op in ops]
    assert flags == ["SF_BLK_IN | SF_BLK_OUT"] * 3 + ["SF_BLK_IN", "SF_BLK_OUT"]
    assert template_body(Conv([_t((1, 2, 6, 6, 16)), _t((16, 2, 3, 3))], group=16, pads=(1, 1, 1, 1),
                              blocked_in=True)) is None


def test_convs_of_few_one_channel_groups_take_the_gemm():
    """A conv of one input channel per group is depthwise-shaped, but with fewer than 16 groups the depthwise
    kernel (16 channels a vector) would leave most of its lanes idle (wav2vec2's first conv, 1 -> 512 channels:
    37x onnxruntime's time): with at least 4 outputs per group and 4 products per output it runs the GEMM
    (``sf_conv2d``); 16 groups or more, or 2 outputs per group, keep the depthwise kernel."""
    from shardflow.compiler.codegen.templates_cpu import template_body

    def fn(x, w, g):
        body = template_body(Conv([_t(x), _t(w)], group=g, strides=(2,)))
        return "sf_conv_depthwise" if "sf_conv_depthwise)(" in body else "sf_conv2d" if "sf_conv2d)(" in body else body

    assert fn((1, 1, 300), (48, 1, 10), 1) == "sf_conv2d"
    assert fn((1, 4, 300), (32, 1, 5), 4) == "sf_conv2d"
    assert fn((1, 16, 300), (64, 1, 5), 16) == "sf_conv_depthwise"
    assert fn((1, 4, 300), (8, 1, 5), 4) == "sf_conv_depthwise"


def test_transposed_convs_use_their_template():
    """The large ConvTranspose cases, 3-D ones too, run the GEMM + col2im template (the generic nest is
    ~100x slower on such shapes, benchmarks/cpu_conv.py); the depthwise-like one stays generic."""
    from shardflow.compiler.codegen.templates_cpu import template_kind

    kinds = {cid: template_kind(op) for cid, op, _ in LARGE if op.op_type == "ConvTranspose"}
    assert len(kinds) == 11
    thin = [cid for cid, op, _ in LARGE if op.op_type == "ConvTranspose" and op.attrs.get("group") == 6]
    assert [cid for cid, k in kinds.items() if k is None] == thin and len(thin) == 1
    assert all(k == "ConvTranspose" for cid, k in kinds.items() if cid not in thin)


def test_expert_matmul_uses_its_template(library):
    """The float32 ExpertMatMul cases (large ones and op examples) run the template's GEMVs and GEMMs."""
    from shardflow.compiler.codegen.templates_cpu import template_kind

    ops = [op for op, _ in library["cases"].values() if op.op_type == "ExpertMatMul"]
    assert len(ops) == 5 and all(template_kind(op) == "ExpertMatMul" for op in ops)


def test_attention_uses_its_template(library):
    """Every float32 Attention case above runs sf_attention, the op examples on float32 operands whose
    probabilities are rounded to float16 or bfloat16 too (precision float16/bfloat16); the mixed-precision
    form on half operands and the qk_matmul_output forms (the op examples) keep the generic nest, which
    computes them."""
    from shardflow.compiler.codegen.templates_cpu import template_kind

    att = [(cid, op) for cid, op, _ in LARGE if op.op_type == "Attention"]
    assert len(att) == 12 and all(template_kind(op) == "Attention" for _, op in att)
    examples = [op for op, _ in library["cases"].values() if op.op_type == "Attention"]
    generic = [op for op in examples if op.attrs.get("qk_mode") is not None or op.inputs[0].dtype != "float32"]
    assert len(generic) == 7 and all(template_kind(op) is None for op in generic)
    rounded = [op for op in examples if op.attrs.get("probs_dtype") and op.inputs[0].dtype == "float32"]
    assert [op.attrs["probs_dtype"] for op in rounded] == ["bfloat16", "float16"]
    assert all(template_kind(op) == "Attention" for op in rounded)
    assert [template_kind(op) for op in examples if op.attrs.get("has_sink") and op.attrs.get("qk_mode") is None] \
        == ["Attention"] * 2  # the op example and the large case


def test_every_lowerable_example_is_in_the_library(library):
    lowered = [cid for cid, cls, a, attrs in EXAMPLES if _compiled_for_cpu(library["cases"][cid][0])]
    assert len(lowered) >= 250
    assert all(cid in library["symbols"] for cid in lowered)
    assert [cid for cid, *_ in EXAMPLES if cid not in library["symbols"]] == []
    assert sum(library["cases"][cid][0].op_type == "TopK" for cid in lowered) == 3  # by the template


def test_constants_are_inputs_not_baked(library):
    """The kernel of an op built on constant tensors reads whatever arrays it is given (those of
    more than one element: see the next test)."""
    cid = next(c for c in library["cases"] if c.startswith("MatMul-linalg-0"))
    op, arrays = library["cases"][cid]
    rng = np.random.default_rng(5)
    other = [rng.standard_normal(a.shape).astype(a.dtype) for a in arrays]
    got = run_kernel(library["lib"], library["symbols"][cid], op, other)
    np.testing.assert_allclose(got[0], other[0] @ other[1], rtol=1e-5, atol=1e-6)


def test_one_element_constants_are_literals(tmp_path, kernel_cache):
    """A constant input of one element is a literal in the generic kernel, so the C++ compiler folds
    it: GPT-2's GELU ``x ** 3`` (a 0-d exponent) became ``x * x * x`` (its kernels 5x faster in GPT-2
    small; now printed as ``sf_cube``). The values equal numpy's; the kernel no longer reads those inputs."""
    x = np.random.default_rng(3).standard_normal((4, 33)).astype(np.float32)
    i = np.arange(-6, 6, dtype=np.int64).reshape(3, 4)
    ops = [Binary([_t(x.shape), const_tensor(np.float32(3.0))], fn="pow", name="cube"),
           Binary([_t(x.shape), const_tensor(np.full((1, 1), 0.044715, np.float32))], fn="mul", name="scale"),
           Binary([_t(i.shape, "int64"), const_tensor(np.array([4], np.int64))], fn="floordiv", name="idiv"),
           Binary([_t(x.shape), const_tensor(np.array([1.0, 2.0], np.float32)[:1].copy())], fn="sub", name="one")]
    bodies = {op.name: generate_cpu_source([op]).kernels[0][1] for op in ops}
    assert "sf_cube(" in bodies["cube"] and "0.044714998453855515f" in bodies["scale"]
    assert "INT64_C(4)" in bodies["idiv"] and "1.0f" in bodies["one"]
    assert not any("in1[" in b for b in bodies.values())
    syms = build_cpu_library(ops, str(tmp_path / "lit.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "lit.so"))
    for op in ops:
        arrays = [x if op.inputs[0].dtype == "float32" else i, np.asarray(op.inputs[1].value)]
        want = op.run(*arrays)
        assert_matches(run_kernel(lib, syms[op.name], op, arrays), want, [t.dtype for t in op.outputs])
        # the literal is what the kernel uses: another array in that input changes nothing
        other = [arrays[0], (arrays[1] + 7).astype(arrays[1].dtype)]
        assert_matches(run_kernel(lib, syms[op.name], op, other), want, [t.dtype for t in op.outputs])


def test_gpt2_matmul_speed(library, tmp_path, kernel_cache):
    """Prints the generated GEMM's time for a GPT-2 projection next to numpy's (no assertion on
    speed: timings on shared CI machines are noise; the values are checked)."""
    op = MatMul([_t((1, 128, 768)), _t((768, 768))], name="gpt2_proj")
    syms = build_cpu_library([op], str(tmp_path / "mm.so"), cache_dir=kernel_cache, opt_level=2)
    lib = ctypes.CDLL(str(tmp_path / "mm.so"))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((1, 128, 768)).astype(np.float32), rng.standard_normal((768, 768)).astype(np.float32)

    def best(f, n=10):
        f()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return min(ts) * 1e3
    out = run_kernel(lib, syms["gpt2_proj"], op, [a, b])
    np.testing.assert_allclose(out[0], a @ b, rtol=1e-4, atol=1e-3)
    tk = best(lambda: run_kernel(lib, syms["gpt2_proj"], op, [a, b]))
    tn = best(lambda: a @ b)
    print(f"\n[cpu codegen] matmul 128x768x768 fp32: kernel {tk:.3f} ms, numpy {tn:.3f} ms "
          f"({2 * 128 * 768 * 768 / tk / 1e6:.1f} GFLOP/s); test library built in {library['build_s']:.1f} s")


# --------------------------------------------------------------------------- semantics
def _build_and_run(tmp_path, op, arrays, opt_level=1):
    syms = build_cpu_library([op], str(tmp_path / f"{op.op_type}.so"), cache_dir=str(tmp_path / "cache"),
                             opt_level=opt_level)
    lib = ctypes.CDLL(str(tmp_path / f"{op.op_type}.so"))
    return run_kernel(lib, syms[op.name], op, arrays)


def test_numpy_edge_semantics(tmp_path, kernel_cache):
    """Python-style floor division and modulo, integer division by zero, pow's signs, NaN in max and argmax,
    first-index ties, float→int truncation and wrap-around, float16 storage: in one library."""
    ia = np.array([[-7, 7, -7, 7, 5, -5]], np.int64)
    ib = np.array([[2, -2, -2, 2, 0, 0]], np.int64)
    fa = np.array([[-7.5, 7.5, np.nan, 1e20, -1.5, 300.7]], np.float32)
    amax = np.array([[1.0, 3.0, 3.0, 2.0], [np.nan, 5.0, np.nan, 1.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
    h = np.array([[0.1, -2.5, 65504.0, 1e-4]], np.float16)
    px = np.random.default_rng(5).standard_normal((1, 2, 7, 9)).astype(np.float32)
    pw = np.random.default_rng(6).standard_normal((1, 2, 9, 40)).astype(np.float32)  # rows of 20 outputs
    pw[0, 0, 0, 0] = pw[0, 0, 4, 7] = pw[0, 1, 8, 39] = np.nan
    px[0, 0, 0, 0] = px[0, 0, 3, 4] = px[0, 1, 6, 8] = np.nan  # a border tap, an interior one, the last one
    # pow's integer and odd exponents (the sign of a negative base's power) past 2^23 and 2^24, NaN
    pa, pb = (v.astype(np.float32) for v in np.meshgrid(
        [-1.0, -2.0, -0.5, -0.0, 2.0, np.nan, -np.inf, 1.5],
        [np.nan, 8388609.0, -8388609.0, 8388608.0, 16777218.0, 1e30, 3.0, 5.0, 0.75, -0.75, 2.0, 0.0], indexing="ij"))
    tk = np.array([[1.0, np.nan, 3.0, np.nan, 2.0, 3.0, -np.inf, 0.0]], np.float32)  # NaN ordering, ties
    cases = [
        (Binary([_t(pa.shape), _t(pb.shape)], fn="pow", name="pw"), [pa, pb]),
        (TopK([_t(tk.shape)], k=5, axis=1, largest=True, name="tk_hi"), [tk]),
        (TopK([_t(tk.shape)], k=7, axis=1, largest=False, name="tk_lo"), [tk]),
        (Binary([_t(ia.shape, "int64"), _t(ib.shape, "int64")], fn="floordiv", name="fd"), [ia, ib]),
        (Binary([_t(ia.shape, "int64"), _t(ib.shape, "int64")], fn="mod", name="md"), [ia, ib]),
        (Binary([_t(ia.shape, "int64"), _t(ib.shape, "int64")], fn="fmod", name="fm"), [ia, ib]),
        (Reduce([_t(amax.shape)], kind="max", axes=(1,), keepdims=False, name="mx"), [amax]),
        (ArgReduce([_t(amax.shape)], kind="argmax", axis=1, keepdims=False, name="am"), [amax]),
        (CastOp([_t(fa.shape)], to="uint8", name="cu8"), [fa]),
        (CastOp([_t(fa.shape)], to="int32", name="ci32"), [fa]),
        (Unary([_t(h.shape, "float16")], fn="exp", name="h_exp"), [h]),
        (Unary([_t(fa.shape)], fn="round", name="rnd"), [np.array([[0.5, 1.5, 2.5, -0.5, -1.5, 2.4]], np.float32)]),
        # round half to even without std::nearbyint: ties, the last fractions below 2^23 / 2^52, integers above,
        # huge values, NaN and infinities, and the sign of a zero result
        (Unary([_t((1, 16))], fn="round", name="rnd32"), [np.array([[
            4194304.5, 4194305.5, 8388607.5, -8388607.5, 8388608.0, 8388609.0, 16777216.0, 1e30, -1e30, np.nan,
            np.inf, -np.inf, -0.3, -0.5, 0.49999997, 3.5]], np.float32)]),
        (Unary([_t((1, 10), "float64")], fn="round", name="rnd64"), [np.array([[
            2.0 ** 51 + 0.5, 2.0 ** 52 - 0.5, -(2.0 ** 52 - 0.5), 2.0 ** 52 + 1, 1e300, np.nan, -np.inf, -0.3,
            0.49999999999999994, -2.5]], np.float64)]),
        (Pool([_t(px.shape)], kind="max", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), name="mpool"), [px]),
        (Pool([_t(px.shape)], kind="avg", kernel=(3, 2), strides=(1, 2), pads=(1, 0, 1, 1), name="apool"), [px]),
        (Pool([_t(pw.shape)], kind="max", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), name="wpool"), [pw]),
    ]
    syms = build_cpu_library([op for op, _ in cases], str(tmp_path / "edge.so"), cache_dir=kernel_cache,
                             opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "edge.so"))
    with np.errstate(all="ignore"):
        for op, arrays in cases:
            got = run_kernel(lib, syms[op.name], op, arrays)
            want = op.run(*arrays)
            assert_matches(got, want, [t.dtype for t in op.outputs])
    fd = run_kernel(lib, syms["fd"], cases[3][0], cases[3][1])[0]
    assert fd.tolist() == [[-4, -4, 3, 3, 0, 0]]
    pw_ = run_kernel(lib, syms["pw"], *cases[0])[0]
    assert pw_[0, 1] == -1.0 and pw_[0, 3] == pw_[0, 4] == 1.0 and pw_[1, 1] == -np.inf and np.isnan(pw_[0, 8])
    assert run_kernel(lib, syms["tk_hi"], *cases[1])[1].tolist() == [[1, 3, 2, 5, 4]]  # NaN first, then 3 at 2 before 5
    assert run_kernel(lib, syms["tk_lo"], *cases[2])[1].tolist() == [[6, 7, 0, 4, 2, 5, 1]]  # NaN last
    am = run_kernel(lib, syms["am"], cases[7][0], cases[7][1])[0]
    assert am.tolist() == [1, 0, 0]
    for op, (x,) in (c for c in cases if c[0].name in ("rnd32", "rnd64")):  # exactly numpy's, signed zeros too
        got = run_kernel(lib, syms[op.name], op, [x])[0]
        np.testing.assert_array_equal(got, np.round(x))
        assert (np.signbit(got) == np.signbit(np.round(x))).all()
    mp = run_kernel(lib, syms["mpool"], *cases[-3])[0]
    assert np.isnan(mp[0, 0, 0, 0]) and np.isnan(mp[0, 0, 1, 2]) and np.isnan(mp[0, 1, 3, 4])
    assert np.isnan(mp).sum() == 1 + 2 + 1  # (3, 4) lies in the windows (1, 2) and (2, 2)
    wp = run_kernel(lib, syms["wpool"], *cases[-1])[0]  # the separable path
    assert np.isnan(wp[0, 0, 0, 0]) and np.isnan(wp[0, 1, 4, 19]) and np.isnan(wp[0, 0, 2, 3:5]).all()
    assert np.isnan(wp).sum() == 1 + 2 + 1  # (4, 7) lies in the windows (2, 3) and (2, 4)


def test_topk_rows_that_replace_their_candidates_often(tmp_path, kernel_cache):
    """TopK's template keeps candidates in a buffer of 2k + 64 and cuts it to the k that go first when it
    fills: rising rows (every value enters, the buffer fills again and again) with runs of equal values
    and NaN, both directions, a strided axis and integers, against numpy's order (ties by position)."""
    n = 1500
    rise = np.repeat(np.arange(n // 3, dtype=np.float32), 3)[:n] / 7  # (runs of three equal values)
    rows = np.stack([rise, rise[::-1], np.where(np.arange(n) % 97 == 5, np.nan, rise), np.zeros(n, np.float32)])
    ints = (np.arange(n, dtype=np.int64) // 4)[None, :] * np.array([[1], [-1]])
    cases = [
        (TopK([_t(rows.shape)], k=10, axis=1, largest=True, name="hi"), [rows]),
        (TopK([_t(rows.shape)], k=33, axis=1, largest=False, name="lo"), [rows]),
        (TopK([_t((n, 4))], k=7, axis=0, largest=True, name="col"), [np.ascontiguousarray(rows.T)]),
        (TopK([_t(ints.shape, "int64")], k=9, axis=1, largest=True, name="int"), [ints]),
    ]
    syms = build_cpu_library([op for op, _ in cases], str(tmp_path / "topk.so"), cache_dir=kernel_cache,
                             opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "topk.so"))
    for op, arrays in cases:
        got = run_kernel(lib, syms[op.name], op, arrays)
        want = op.run(*arrays)
        assert_matches(got, want, [t.dtype for t in op.outputs])
    hi = run_kernel(lib, syms["hi"], *cases[0])[1]
    assert hi[0].tolist() == [1497, 1498, 1499, 1494, 1495, 1496, 1491, 1492, 1493, 1488]
    assert hi[3].tolist() == list(range(10)) and np.isnan(run_kernel(lib, syms["hi"], *cases[0])[0][2]).all()


def test_out_of_range_gather_indices_are_clamped(tmp_path):
    """Indices from data are clamped into the tensor (as the reference evaluator does), never read
    out of bounds."""
    op = Gather([_t((5, 3)), _t((4,), "int64")], axis=0, name="g")
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    idx = np.array([1, 10**12, -10**12, -1], np.int64)
    got = _build_and_run(tmp_path, op, [x, idx])[0]
    np.testing.assert_array_equal(got, x[[1, 4, 0, 4]])


# --------------------------------------------------------------------------- lowering structure
def _loop_depth(body, depth=0):
    best = depth
    for s in body:
        if isinstance(s, (lower_mod.Loop, lower_mod.FlatLoop)):
            best = max(best, _loop_depth(s.body, depth + 1))
        elif isinstance(s, lower_mod.Block):
            best = max(best, _loop_depth(s.body, depth))
        elif isinstance(s, lower_mod.If):
            best = max(best, _loop_depth(s.then, depth), _loop_depth(s.other, depth))
    return best


def test_softmax_reductions_are_hoisted():
    """Softmax over the last axis: per row a max loop, a sum loop and the elementwise loop, side by
    side (depth 2), not a reduction inside the elementwise loop (O(n²))."""
    op = Softmax([_t((4, 8, 64))], axes=(2,), log=False)
    k = lower_task(op.task, op.name, op.op_type)
    assert _loop_depth(k.body) == 2
    assert not k.temps
    # the sum's exponentials are kept in the output's own row and finished there by the output loop
    kernel = generate_cpu_source([op]).kernels[0][1]
    assert kernel.count("sf_exp_nonpos(") == 1 and "sf_exp(" not in kernel and "alignas(64)" not in kernel
    assert re.search(r"out0\[[^\]]*k1\] = t\d+;", kernel) and re.search(r"out0\[(.*i2)\] = \(out0\[\1\] \*", kernel)
    # a row array where the output has another type (a float16 output of a float32 softmax)
    from shardflow.compiler.codegen.fusion import FusedOp
    x = _t((4, 8, 64))
    sm = Softmax([x], axes=(2,), log=False, name="sm")
    half = FusedOp([sm, CastOp([sm.outputs[0]], to="float16", name="h")])
    kernel = generate_cpu_source([half]).kernels[0][1]
    assert kernel.count("sf_exp_nonpos(") == 1 and kernel.count("alignas(64)") == 1
    # over a middle axis the two statistics are materialized once per (outer, inner) position
    op = Softmax([_t((4, 64, 8))], axes=(1,), log=False)
    k = lower_task(op.task, op.name, op.op_type)
    assert len(k.temps) == 2 and [t.shape for t in k.temps] == [(4, 8), (4, 8)]
    assert _loop_depth(k.body) == 3


def test_softmax_finishes_its_exponentials_in_the_output_row(tmp_path, kernel_cache):
    """The sum pass stores each row's exponentials in the output and the output loop scales them in
    place: softmax and log-softmax (whose output reads the input, not the exponentials) against
    numpy, rows of 64 KiB or more too (no row array was kept for them), an input with -inf and NaN
    rows, and a float16 output of a float32 softmax (a row array, the output's type differing)."""
    from shardflow.compiler.codegen.fusion import FusedOp

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 5, 64)) * 4).astype(np.float32)
    x[0, 1] = -np.inf
    x[1, 2, 7] = np.nan
    ops = [Softmax([_t((3, 5, 64))], axes=(2,), log=False, name="sm"),
           Softmax([_t((3, 5, 64))], axes=(2,), log=True, name="lsm"),
           Softmax([_t((2, 20000))], axes=(1,), log=False, name="wide")]
    sm = Softmax([_t((3, 5, 64))], axes=(2,), log=False, name="sm16")
    ops.append(FusedOp([sm, CastOp([sm.outputs[0]], to="float16", name="h")]))
    inputs = {"sm": x, "lsm": x, "wide": (rng.standard_normal((2, 20000)) * 3).astype(np.float32), "h": x}
    syms = build_cpu_library(ops, str(tmp_path / "softmax.so"), cache_dir=kernel_cache, opt_level=1)
    src = "".join(text for _, text in generate_cpu_source(ops).kernels)
    assert src.count("alignas(64)") == 1  # the float16 output's row array only
    lib = ctypes.CDLL(str(tmp_path / "softmax.so"))
    for op in ops:
        a = inputs[op.name]
        got = run_kernel(lib, syms[op.name], op, [a])[0]
        want = op.run(a)[0]
        # (log-softmax: x - max - log(sum) cancels; both sides round operands of about 5 (an ulp 4.8e-7):
        # at [0, 0, 9] the kernel is 1.1e-7 from the float64 value, numpy's float32 1.3e-7)
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-6,
                                   atol=5e-7 if op.name == "lsm" else 1e-7, err_msg=op.name)


def _reduction_loops(body):
    """The extents of each reduction's loop nest (loops over reduction variables), outermost first."""
    found = []
    for s in body:
        if isinstance(s, lower_mod.Loop) and s.var.kind == "reduce":
            nest = [s.extent]
            while len(s.body) == 1 and isinstance(s.body[0], lower_mod.Loop) and s.body[0].var.kind == "reduce":
                s = s.body[0]
                nest.append(s.extent)
            found.append(nest)
        for key in ("body", "then", "other"):
            found.extend(_reduction_loops(getattr(s, key, [])))
    return found


def test_reductions_over_adjacent_axes_are_one_loop(tmp_path, kernel_cache):
    """A reduction whose variables index consecutive dims of every read runs one loop over their product
    (a global pool over 56x56 pixels: one vectorized sum of 3136 values, not 56 of 56), with numpy's values,
    NaN included; other reductions keep their nest."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    nhwc = rng.standard_normal((2, 5, 7, 3)).astype(np.float32)
    nhwc[1, 2, 3, 1] = np.nan
    merged = [
        (Reduce([_t(x.shape)], kind="mean", axes=(2, 3), keepdims=True, name="hw"), [x], [35]),
        (Reduce([_t(x.shape)], kind="sum", axes=(1, 2, 3), keepdims=False, name="chw"), [x], [105]),
        (Reduce([_t(x.shape)], kind="prod", axes=(0, 1, 2, 3), keepdims=False, name="all"), [x * 0 + 1.01], [210]),
        (Reduce([_t(nhwc.shape)], kind="max", axes=(1, 2), keepdims=False, name="nhwc_max"), [nhwc], [35]),
        (GlobalPool([_t(x.shape)], kind="avg", name="gap"), [x], [35]),
    ]
    kept = [
        (Reduce([_t(x.shape)], kind="sum", axes=(1, 3), keepdims=False, name="apart"), [x], [3, 7]),
        (Pool([_t(x.shape)], kind="avg", kernel=(2, 3), strides=(1, 1), pads=(0, 0, 0, 0), name="window"), [x],
         [2, 3]),
    ]
    for op, _, loops in merged + kept:
        assert _reduction_loops(lower_task(op.task, op.name, op.op_type).body) == [loops], op.name
    ops = [op for op, _, _ in merged + kept]
    syms = build_cpu_library(ops, str(tmp_path / "red.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "red.so"))
    for op, arrays, _ in merged + kept:
        got = run_kernel(lib, syms[op.name], op, arrays)
        assert_matches(got, op.run(*arrays), [t.dtype for t in op.outputs])
    got = run_kernel(lib, syms["nhwc_max"], merged[3][0], merged[3][1])[0]
    assert np.isnan(got[1, 1]) and np.isnan(got).sum() == 1


class _ShiftedExp(Operator):
    """Test-only op: ``exp(a[i, j] - max_k b[i, k])``, the shift of another tensor's maximum (positive
    arguments: not a softmax's)."""

    def compute(self, a, b):
        from shardflow.compiler.ir.task import reduce

        def f(i, j):
            return UnaryOp("exp", BinOp("sub", a[i, j], reduce((b.shape[1],), lambda k: b[i, k], "max")))
        return compute("y", a.shape, f)


def test_softmax_exponentials_take_the_nonpositive_exp(tmp_path, kernel_cache):
    """``exp(x - max(x))`` is proven at most 0 (or NaN) and printed ``sf_exp_nonpos`` (one scaling, helpers.h):
    Softmax over the last and a middle axis, LogSoftmax; values as numpy's, the tiny ones denormal (not
    flushed), NaN, infinite and all -inf rows kept. An exp shifted by another tensor's maximum keeps
    ``sf_exp`` (its arguments reach 60 here: the one-scaling form would be wrong)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    x[0, :] = -20.0
    x[0, :3] = [0.0, -95.0, -100.0]      # exp of -95 and -100: denormal probabilities
    x[1, 5] = np.nan
    x[2, 7] = np.inf
    x[3, :] = -np.inf
    x[4, 9] = -np.inf
    x3 = rng.standard_normal((3, 40, 5)).astype(np.float32) * 30
    cases = [(Softmax([_t(x.shape)], axes=(1,), log=False, name="last"), [x]),
             (Softmax([_t(x3.shape)], axes=(1,), log=False, name="middle"), [x3]),
             (Softmax([_t(x.shape)], axes=(1,), log=True, name="log"), [x])]
    shifted = (_ShiftedExp([_t((4, 8)), _t((4, 8))], name="shifted"),
               [rng.standard_normal((4, 8)).astype(np.float32) * 20 + 40,
                rng.standard_normal((4, 8)).astype(np.float32)])
    for op, _ in cases:
        text = generate_cpu_source([op]).kernels[0][1]
        # (over a middle axis the output's exponentials, in a loop of their own: the vector form, sfv_; the sum's,
        # in its temporary's nest, keep sf_exp)
        nonpos = "sfv_exp_nonpos(" if op.name == "middle" else "sf_exp_nonpos("
        assert nonpos in text and ("sf_exp(" not in text or op.name == "middle"), op.name
    text = generate_cpu_source([shifted[0]]).kernels[0][1]
    assert re.search(r"\bsfv?_exp\(", text) and "exp_nonpos(" not in text  # (its vector form: sfv_exp)
    ops = [op for op, _ in cases] + [shifted[0]]
    syms = build_cpu_library(ops, str(tmp_path / "sm.so"), cache_dir=kernel_cache, opt_level=2)
    lib = ctypes.CDLL(str(tmp_path / "sm.so"))
    for op, arrays in cases + [shifted]:
        got = run_kernel(lib, syms[op.name], op, arrays)
        assert_matches(got, op.run(*arrays), [t.dtype for t in op.outputs])
    got = run_kernel(lib, syms["last"], cases[0][0], [x])[0]
    want = np.exp(np.float64(x[0]) - x[0].max()) / np.exp(np.float64(x[0]) - x[0].max()).sum()
    assert 0 < got[0, 1] < np.finfo(np.float32).tiny and 0 < got[0, 2] < got[0, 1]
    assert abs(float(got[0, 1]) - want[1]) <= 1.5e-45 and abs(float(got[0, 2]) - want[2]) <= 1.5e-45
    # a NaN row, an infinite value (inf - inf: NaN, the sum NaN) and an all -inf row: NaN rows, as numpy's
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all() and np.isnan(got[3]).all() and got[4, 9] == 0


class _MiddleVariance(Operator):
    """Test-only op: the variance over the middle axis of ``[A, K, B]``, two reductions of one nest, the
    second reading the first (``op.run`` is the reference evaluator)."""

    def compute(self, x):
        from shardflow.compiler.ir.task import reduce
        k = x.shape[1]

        def f(i, j):
            mean = reduce((k,), lambda q: x[i, q, j], "mean")
            return reduce((k,), lambda q: BinOp("mul", BinOp("sub", x[i, q, j], mean), BinOp("sub", x[i, q, j], mean)),
                          "mean")
        return compute("y", (x.shape[0], x.shape[2]), f)


def _simd_loops(body):
    found = []
    for s in body:
        if isinstance(s, lower_mod.Loop) and s.simd:
            found.append(s.extent)
        for key in ("body", "then", "other"):
            found.extend(_simd_loops(getattr(s, key, [])))
    return found


def test_reductions_over_a_middle_axis_accumulate_rows(tmp_path, kernel_cache):
    """A reduction over an axis before the innermost one accumulates a row of the innermost axis per step
    (a vectorized loop over contiguous values), where the nest summed each output through values a row
    apart; numpy's values in every kind, NaN, integer and float16 inputs, two dependent reductions."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 40, 16)).astype(np.float32)
    xn = x.copy()
    xn[1, 7, 3] = xn[2, 0, 15] = np.nan
    xi = rng.integers(-2**30, 2**30, (3, 40, 16)).astype(np.int32)  # (sums past int32's range)
    xh = x.astype(np.float16)
    row = [
        (Reduce([_t(x.shape)], kind="sum", axes=(1,), keepdims=False, name="sum"), [x]),
        (Reduce([_t(x.shape)], kind="mean", axes=(1,), keepdims=True, name="mean"), [x]),
        (Reduce([_t(x.shape)], kind="prod", axes=(1,), keepdims=False, name="prod"), [1 + x / 50]),
        (Reduce([_t(x.shape)], kind="max", axes=(1,), keepdims=False, name="max"), [xn]),
        (Reduce([_t(x.shape)], kind="min", axes=(1,), keepdims=False, name="min"), [xn]),
        (Reduce([_t(x.shape)], kind="sum", axes=(0, 1), keepdims=True, name="sum01"), [x]),
        (Reduce([_t((40, 16))], kind="max", axes=(0,), keepdims=False, name="columns"), [xn[1]]),
        (Reduce([_t(xi.shape, "int32")], kind="sum", axes=(1,), keepdims=False, name="isum"), [xi]),
        (Reduce([_t(xh.shape, "float16")], kind="mean", axes=(1,), keepdims=False, name="hmean"), [xh]),
        (Softmax([_t(x.shape)], axes=(1,), log=False, name="softmax"), [x]),
        (_MiddleVariance([_t(x.shape)], name="var"), [x]),
    ]
    kept = [
        (Reduce([_t(x.shape)], kind="sum", axes=(2,), keepdims=False, name="last"), [x]),
        (Reduce([_t((3, 40, 4))], kind="sum", axes=(1,), keepdims=False, name="narrow"), [x[:, :, :4].copy()]),
    ]
    for op, _ in row:
        assert _simd_loops(lower_task(op.task, op.name, op.op_type).body), op.name
    for op, _ in kept:
        assert not _simd_loops(lower_task(op.task, op.name, op.op_type).body), op.name
    var = lower_task(row[-1][0].task, "var", "var")
    assert _simd_loops(var.body) == [16, 16] and not var.temps  # (both in one nest: the mean's row read back)
    syms = build_cpu_library([op for op, _ in row + kept], str(tmp_path / "mid.so"), cache_dir=kernel_cache,
                             opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "mid.so"))
    for op, arrays in row + kept:
        got = run_kernel(lib, syms[op.name], op, arrays)
        assert_matches(got, op.run(*arrays), [t.dtype for t in op.outputs])
    got = run_kernel(lib, syms["max"], *row[3])[0]
    assert np.isnan(got[1, 3]) and np.isnan(got[2, 15]) and np.isnan(got).sum() == 2
    got = run_kernel(lib, syms["columns"], *row[6])[0]
    assert np.isnan(got[3]) and np.isnan(got).sum() == 1
    np.testing.assert_array_equal(run_kernel(lib, syms["isum"], *row[7])[0],  # (ReduceSum keeps int32: wrapped once)
                                  xi.astype(np.int64).sum(axis=1).astype(np.int32))


def test_rows_of_lanes_keep_their_loops_and_vectorize(tmp_path, kernel_cache):
    """An element-wise op whose innermost axis is short (the blocked layout's 16 lanes; a squeeze-and-excitation
    scale ``[1, C/16, 1, 1, 16]`` times its image) flattens only the outer axes that still leave the threads
    FLAT_MIN rows, loops over the rest, and marks its 16-lane loop simd (GCC checked the arguments for overlap
    on every entry of it: 3x slower), written over its input in place too (it reads it at the same index); with
    a long innermost axis no loop is marked. numpy's values."""
    rng = np.random.default_rng(11)
    x, s = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 32, 14, 14, 16), (1, 32, 1, 1, 16)))
    lanes = Binary([_t(x.shape), _t(s.shape)], fn="mul", name="lanes")
    k = lower_task(lanes.task, lanes.name, lanes.op_type)
    assert _parallel_flat_loops(k.body) == [[1, 32, 14]] and _simd_loops(k.body) == [16]
    assert _simd_loops(lower_task(lanes.task, lanes.name, lanes.op_type, None, 0).body) == [16]  # (in place too)
    rows = Binary([_t((8, 300)), _t((8, 1))], fn="mul", name="rows")
    k = lower_task(rows.task, rows.name, rows.op_type)
    assert not _simd_loops(k.body)
    # few rows: flattened down to the lanes as before (the threads keep enough rows)
    few = Binary([_t((1, 2, 3, 5, 16)), _t((1, 2, 1, 1, 16))], fn="add", name="few")
    flat = [[v.extent for v in st.vars] for b in lower_task(few.task, few.name, few.op_type).body
            for st in getattr(b, "body", []) if isinstance(st, lower_mod.FlatLoop)]
    assert flat == [[1, 2, 3, 5]], flat
    cases = [(lanes, [x, s]), (rows, [rng.standard_normal((8, 300)), rng.standard_normal((8, 1))]),
             (few, [rng.standard_normal((1, 2, 3, 5, 16)), rng.standard_normal((1, 2, 1, 1, 16))])]
    syms = build_cpu_library([op for op, _ in cases], str(tmp_path / "lanes.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "lanes.so"))
    for op, arrays in cases:
        assert_matches(run_kernel(lib, syms[op.name], op, arrays), op.run(*[np.asarray(a, np.float32) for a in arrays]),
                       [t.dtype for t in op.outputs])


def _parallel_flat_loops(body):
    found = []
    for s in body:
        if isinstance(s, lower_mod.FlatLoop) and s.parallel:
            found.append([v.extent for v in s.vars])
        for key in ("body", "then", "other"):
            found.extend(_parallel_flat_loops(getattr(s, key, [])))
    return found


def test_few_output_rows_split_their_columns_across_threads(tmp_path, kernel_cache):
    """An interchanged reduction with fewer than 4 output rows (column sums, a softmax's statistics
    over the first axis) splits its columns into chunks of at most 1024, a multiple of 16 dividing the
    row, and runs the chunks in parallel (one thread summed the whole row); a row with no such divisor
    stays one thread. numpy's values, NaN included; ReduceL2 (a square root of each column's sum)."""
    rng = np.random.default_rng(5)
    cols = rng.standard_normal((40, 4096)).astype(np.float32)
    cols[7, 3000] = np.nan
    two = rng.standard_normal((2, 24, 2048)).astype(np.float32)
    odd = rng.standard_normal((1, 40, 1040)).astype(np.float32)  # (1040 = 16 * 65: chunks of 208)
    prime = rng.standard_normal((40, 4100)).astype(np.float32)
    cases = [
        (Reduce([_t(cols.shape)], kind="sum", axes=(0,), keepdims=False, name="colsum"), [cols], [4], 1024),
        (Reduce([_t(cols.shape)], kind="max", axes=(0,), keepdims=True, name="colmax"), [cols], [1, 4], 1024),
        (Reduce([_t(two.shape)], kind="mean", axes=(1,), keepdims=False, name="two"), [two], [2, 2], 1024),
        (_MiddleVariance([_t(odd.shape)], name="var"), [odd], [1, 5], 208),
        (Softmax([_t((40, 2048))], axes=(0,), log=False, name="softmax0"), [cols[:, :2048].copy()], None, 1024),
        (Reduce([_t(cols.shape)], kind="l2", axes=(0,), keepdims=False, name="l2"), [cols], [4], 1024),
        (Reduce([_t(prime.shape)], kind="sum", axes=(0,), keepdims=False, name="prime"), [prime], [], 4100),
    ]
    for op, _, flat, chunk in cases:
        k = lower_task(op.task, op.name, op.op_type)
        assert chunk in _simd_loops(k.body), op.name
        if flat is not None:
            assert _parallel_flat_loops(k.body) == ([flat] if flat else []), op.name
    syms = build_cpu_library([c[0] for c in cases], str(tmp_path / "cols.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "cols.so"))
    for op, arrays, _, _ in cases:
        got = run_kernel(lib, syms[op.name], op, arrays)
        assert_matches(got, op.run(*arrays), [t.dtype for t in op.outputs])
    got = run_kernel(lib, syms["colmax"], *cases[1][:2])[0]
    assert np.isnan(got[0, 3000]) and np.isnan(got).sum() == 1


def test_attention_scores_are_materialized_once():
    """The three score reductions of Attention are one temporary (equal up to renaming)."""
    op = Attention([_t((1, 2, 5, 4)), _t((1, 2, 6, 4)), _t((1, 2, 6, 3))], scale_sqrt=0.5)
    k = lower_task(op.task, op.name, op.op_type)
    assert [t.shape for t in k.temps] == [(1, 2, 5, 6)]


def test_guarded_reads_become_branches_and_safe_ones_selects():
    src = generate_cpu_source([Concat([_t((2, 3)), _t((2, 2))], axis=1, name="cat"),
                               Where([_t((2, 3), "bool"), _t((2, 3)), _t((3,))], name="wh")]).text
    cat = src[src.index("// ops: cat"):]
    cat = cat[:cat.index("SF_EXPORT")]
    assert "if (" in cat and "min<" not in cat      # branch; the refined reads need no clamping
    wh = src[src.index("// ops: wh"):]
    wh = wh[:wh.index("SF_EXPORT")]
    assert "if (" not in wh and " ? " in wh          # both sides safe: a select


# --------------------------------------------------------------------------- library building
def test_collectives_and_extern_ops_are_left_out(tmp_path, kernel_cache):
    """Collectives are the runtime's; an op with an extern output only compiles through a template
    (TopK's, in every type it takes: uint64 too since session 82)."""
    x = _t((4, 6))
    ar = AllReduce([x], mesh_axis=0, group_size=2, op="sum", name="ar")
    tk = TopK([x], k=2, axis=1, largest=True, name="tk")
    tk64 = TopK([_t((4, 6), "uint64")], k=2, axis=1, largest=True, name="tk64")
    mm = MatMul([x, _t((6, 3))], name="mm")
    assert not lowerable(ar) and "collective" in why_not_lowerable(ar)
    assert not lowerable(tk) and not lowerable(tk64) and lowerable(mm)
    syms = build_cpu_library([ar, tk, tk64, mm], str(tmp_path / "l.so"), cache_dir=kernel_cache, opt_level=1)
    assert set(syms) == {"mm", "tk", "tk64"}


def test_identical_ops_share_one_kernel(tmp_path):
    a = Binary([_t((3, 4)), _t((4,))], fn="add", name="a1")
    b = Binary([_t((3, 4)), _t((4,))], fn="add", name="a2")
    c = Binary([_t((3, 5)), _t((5,))], fn="add", name="a3")
    src = generate_cpu_source([a, b, c])
    assert src.symbols["a1"] == src.symbols["a2"] != src.symbols["a3"]
    assert len(src.kernels) == 2 and src.text.count("SF_EXPORT void sf_binary") == 2
    # ops built separately (their reduction variables numbered differently by the IR) print the
    # same text, so a recompile in the same process hits the cache too
    s1 = generate_cpu_source([Softmax([_t((2, 5, 7))], axes=(1,), log=False, name="s")])
    s2 = generate_cpu_source([Softmax([_t((2, 5, 7))], axes=(1,), log=False, name="s")])
    assert s1.text == s2.text


def test_second_build_hits_the_cache(tmp_path, monkeypatch):
    ops = [Binary([_t((3, 4)), _t((4,))], fn="mul", name="m"), Unary([_t((5,))], fn="exp", name="e")]
    cache = str(tmp_path / "cache")
    first = build_cpu_library(ops, str(tmp_path / "a.so"), cache_dir=cache, opt_level=1)
    assert len([f for f in os.listdir(cache) if f.endswith(".so")]) == 1

    def no_compiler(*a, **k):
        raise AssertionError("the compiler ran although the library is cached")
    monkeypatch.setattr(toolchain, "_run_compilers", no_compiler)
    t0 = time.perf_counter()
    second = build_cpu_library(ops, str(tmp_path / "b.so"), cache_dir=cache, opt_level=1)
    assert time.perf_counter() - t0 < 5.0
    assert first == second
    assert open(tmp_path / "a.so", "rb").read() == open(tmp_path / "b.so", "rb").read()
    lib = ctypes.CDLL(str(tmp_path / "b.so"))
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_allclose(run_kernel(lib, second["e"], ops[1], [x])[0], np.exp(x), rtol=1e-6)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]


def test_the_micro_kernel_tables_are_compiled_once_for_the_libraries_that_use_them(tmp_path, monkeypatch):
    """The GEMM's table of micro-kernels (which every library's ``shardflow_cpu_isa`` reads) is one
    object, compiled with the first library, cached, and linked into the next ones; the conv tables
    are not built for libraries without a conv; the exponential's vector forms (``vmath.h``) are one
    object too, built for the library whose kernel calls ``sfv_exp``; so is the GEMM's driver a kernel
    calls (``SF_LIB``), with the scratch memory it shares with the kernels: the next library with a
    product compiles its kernel only, at any optimization level (the objects are -O3 for all)."""
    cache = str(tmp_path / "c")
    commands = []
    real = toolchain._run_compilers
    monkeypatch.setattr(toolchain, "_run_compilers", lambda cmds, jobs: commands.extend(cmds) or real(cmds, jobs))

    def prebuilt():
        return [c[-3] for c in commands if "-c" in c and "prebuilt_" in c[-3]]

    build_cpu_library([Unary([_t((5,))], fn="exp", name="e")], str(tmp_path / "e.so"), cache_dir=cache, opt_level=1)
    assert sorted(os.path.basename(p) for p in prebuilt()) == ["prebuilt_sf_rt_ukr.cpp", "prebuilt_sfv_exp.cpp"]
    compiles = [c for c in commands if "-c" in c]
    assert all("-O3" in c and "-O1" not in c for c in compiles if "prebuilt_" in c[-3])
    assert any("-O1" in c for c in compiles if "prebuilt_" not in c[-3])
    assert len([f for f in os.listdir(cache) if f.endswith(".o")]) == 2
    commands.clear()
    rng = np.random.default_rng(0)
    for i, (m, n) in enumerate([(64, 48), (32, 80)]):
        op = MatMul([_t((m, 64)), _t((64, n))], name="mm")
        syms = build_cpu_library([op], str(tmp_path / f"mm{i}.so"), cache_dir=cache, opt_level=1 + i)
        assert commands and sorted(os.path.basename(p) for p in prebuilt()) == (
            ["prebuilt_sf_rt_fn_sgemm.cpp", "prebuilt_sf_rt_workspace.cpp"] if i == 0 else [])
        assert len([f for f in os.listdir(cache) if f.endswith(".o")]) == 4
        commands.clear()
        a, b = rng.standard_normal((m, 64)).astype(np.float32), rng.standard_normal((64, n)).astype(np.float32)
        got = run_kernel(ctypes.CDLL(str(tmp_path / f"mm{i}.so")), syms["mm"], op, [a, b])[0]
        np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)


def test_the_prebuilt_units_needs_are_what_their_objects_refer_to(tmp_path, kernel_cache):
    """templates_cpu.prebuilt_needs() names, for each prebuilt unit, exactly the other prebuilt units its
    object refers to (a build compiles them side by side rather than in a second round after it): every
    unit compiled (the objects of the default cache, which the suite's libraries build anyway) and scanned
    (but the vector helpers, which refer to nothing, and off x86-64 the packed conv's tables, x86-64 code)."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    units = {s: t for s, t in prebuilt_tables().items() if s.startswith("sf_rt_") and (x86 or "pdkr" not in s)}
    cxx = toolchain.cxx_compiler()
    command, keys = toolchain._prebuilt_keys(units, cxx, 2, (), toolchain.compiler_version(cxx))
    objects = toolchain._cached_or_compiled(list(units), units, keys, command, kernel_cache, str(tmp_path), 2)
    refers = {s: sorted(r for r in toolchain._referenced_symbols([o], units) if r != s) for s, o in objects.items()}
    assert {s: r for s, r in refers.items() if r} == {s: sorted(n) for s, n in prebuilt_needs().items()}


def test_the_library_header_is_precompiled_once_per_cache(tmp_path, monkeypatch):
    """The helpers and templates every unit starts with are compiled once into a precompiled header
    that the units of this and later libraries include (and g++ does use it: ``-H`` marks a used
    one with ``!``); if it cannot be built, the units compile the header's text."""
    cache = str(tmp_path / "c")
    commands, shown = [], []
    real = toolchain._run_compilers

    def run(cmds, jobs):
        commands.extend(cmds)
        for c in cmds:
            if "-include" in c:  # the same command, showing the headers it reads
                shown.append(subprocess.run(c[:-1] + [str(tmp_path / "shown.o"), "-H"], capture_output=True,
                                            text=True))
        return real(cmds, jobs)
    monkeypatch.setattr(toolchain, "_run_compilers", run)

    def headers():
        return [c for c in commands if "c++-header" in c]

    def units():
        return [c for c in commands if "-c" in c and "prebuilt_" not in c[-3]]

    rng = np.random.default_rng(0)
    x = rng.standard_normal(5).astype(np.float32)
    ops = [(Unary([_t((5,))], fn="exp", name="e"), np.exp), (Unary([_t((5,))], fn="tanh", name="t"), np.tanh)]
    for k, (op, ref) in enumerate(ops):
        commands.clear()
        syms = build_cpu_library([op], str(tmp_path / f"{k}.so"), cache_dir=cache, opt_level=1)
        assert len(headers()) == (1 if k == 0 else 0)
        (unit,) = units()
        include = unit[unit.index("-include") + 1]
        assert os.path.dirname(include) == cache and os.path.exists(include + ".gch")
        got = run_kernel(ctypes.CDLL(str(tmp_path / f"{k}.so")), syms[op.name], op, [x])[0]
        np.testing.assert_allclose(got, ref(x), rtol=1e-6)
    assert len(shown) == 2 and all(r.returncode == 0 and f"! {include}.gch" in r.stderr for r in shown), \
        shown[-1].stderr[:2000]

    def no_headers(cmds, jobs):
        if any("c++-header" in c for c in cmds):
            return [subprocess.CompletedProcess(c, 1, "", "no precompiled headers here") for c in cmds]
        return real(cmds, jobs)
    monkeypatch.setattr(toolchain, "_run_compilers", lambda cmds, jobs: commands.extend(cmds) or no_headers(cmds, jobs))
    commands.clear()
    op = Unary([_t((5,))], fn="exp", name="e2")
    syms = build_cpu_library([op], str(tmp_path / "2.so"), cache_dir=str(tmp_path / "c2"), opt_level=1)
    assert len(headers()) == 1 and all("-include" not in c for c in units())
    got = run_kernel(ctypes.CDLL(str(tmp_path / "2.so")), syms["e2"], op, [x])[0]
    np.testing.assert_allclose(got, np.exp(x), rtol=1e-6)


def test_cache_dir_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFLOW_CACHE_DIR", str(tmp_path / "envcache"))
    build_cpu_library([Unary([_t((3,))], fn="neg", name="n")], str(tmp_path / "n.so"), opt_level=1)
    assert any(f.endswith(".so") for f in os.listdir(tmp_path / "envcache"))


def test_small_kernels_with_costly_math_are_cloned_for_each_instruction_set():
    """A kernel touching fewer than 16 Ki elements is compiled for x86-64-v3 and v4 too where its
    outputs times its costly calls (exponentials, tanh, ...) reach 256 (an LSTM step's gates: x86-64-v2's
    four lanes without FMA were 3x slower there); a small negation, or an exponential of 64 values,
    stays x86-64-v2 only; a large negation is cloned as before."""
    from shardflow.compiler.codegen.fusion import fuse

    def chain(n, name):  # n alternating exp and tanh of 64 values, fused into one kernel
        ops = [Unary([_t((4, 16))], fn="exp", name=f"{name}0")]
        for i in range(1, n):
            ops.append(Unary([ops[-1].outputs[0]], fn=("exp", "tanh")[i % 2], name=f"{name}{i}"))
        return fuse(ops, keep={ops[-1].outputs[0].name})

    ops = [Unary([_t((8, 256))], fn="exp", name="small_exp"), Unary([_t((4, 16))], fn="exp", name="tiny_exp"),
           Unary([_t((8, 256))], fn="neg", name="small_neg"), Unary([_t((128, 128))], fn="neg", name="large_neg"),
           *chain(4, "four"), *chain(3, "three")]
    src = generate_cpu_source(ops)
    texts = dict(src.kernels)
    cloned = {op.name for op in ops
              if f"SF_CLONES static void {src.symbols[op.name]}_impl(" in texts[src.symbols[op.name]]}
    assert cloned == {"small_exp", "large_neg", "four3"}, cloned


def test_compiler_errors_name_the_op(tmp_path, monkeypatch):
    from shardflow.compiler.codegen import cpp

    real = cpp.kernel_source

    def broken(op, clones=False, in_place=None):
        sym, text = real(op, clones, in_place)
        if op.name == "bad":
            text = text.replace("{\n", "{\n  this_is_not_cpp;\n", 1)
        return sym, text
    monkeypatch.setattr(cpp, "kernel_source", broken)
    ops = [Unary([_t((3,))], fn="neg", name="good"), Unary([_t((4,))], fn="abs", name="bad")]
    with pytest.raises(CompileError) as ei:
        build_cpu_library(ops, str(tmp_path / "x.so"), cache_dir=str(tmp_path / "c"), opt_level=0)
    assert isinstance(ei.value, ShardflowError)
    assert ei.value.ops == ["bad"] and "bad" in str(ei.value) and "this_is_not_cpp" in str(ei.value)
    assert not (tmp_path / "x.so").exists()


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(toolchain.ToolchainError, match="no-such-compiler-xyz"):
        build_cpu_library([Unary([_t((3,))], fn="neg", name="n")], str(tmp_path / "n.so"),
                          cache_dir=str(tmp_path / "c"))


def _fused_groups(seed: int):
    """``(arrays, inp, group)`` for tests of fused groups: ``inp(*shape)`` makes an input tensor whose random
    values ``arrays`` holds by its id; ``group(name, op, *tail)`` the FusedOp of ``op`` and the ops each of
    ``tail`` makes of the output before it (named after ``name``)."""
    from shardflow.compiler.codegen.fusion import FusedOp

    rng = np.random.default_rng(seed)
    arrays: dict[int, np.ndarray] = {}

    def inp(*shape):
        t = _t(shape)
        arrays[id(t)] = rng.standard_normal(shape).astype(np.float32)
        return t

    def group(name, conv, *tail):
        members, prev = [conv], conv.outputs[0]
        for k, make in enumerate(tail):
            op = make(prev)
            op.name = f"{name}-{k}"
            members.append(op)
            prev = op.outputs[0]
        conv.name = f"{name}-conv"
        return FusedOp(members)

    return arrays, inp, group


def test_conv_epilogue_fusion(tmp_path, kernel_cache):
    """A Conv followed by element-wise ops (a fused group, as codegen/fusion.py builds them) compiles
    to the conv template finishing each tile with the bias and the ops, and computes what the members
    compute one after another: residual adds, per-channel and scalar broadcasts, activations, an
    operand that is the conv's own input, groups, strides, 1-D, threads. A residual Add and a Relu
    or a Clip after it (either optional; ReLU6, one bound, crossed bounds) are applied by the kernels as
    they store (``SfFin``), checked also with the AVX2 and portable kernels forced: 1x1 read from the
    image and packed, two K blocks, images and groups, column tails. A ConvTranspose's epilogue
    finishes each plane after its fold; a depthwise conv's Relu or Clip clamps its rows or runs, other
    ops (a residual too) run on its planes or blocks of channels' bands of rows (the depthwise ones also
    forced to AVX2 and portable); a Resize's run on its bands of rows."""
    from shardflow.compiler.codegen.fusion import FusedOp
    from shardflow.compiler.codegen.templates_cpu import accepts_group, template_kind
    from shardflow.compiler.ops.elementwise import Clip
    from shardflow.compiler.ops.transform import Transpose

    arrays, inp, group = _fused_groups(7)
    rng = np.random.default_rng(8)  # (Winograd's weights)

    x5 = inp(1, 16, 8, 8)
    finish = [  # sf_conv2d's kernels apply these as they store
        group("residual", Conv([inp(2, 8, 9, 11), inp(16, 8, 3, 3), inp(16)], pads=(1, 1, 1, 1)),
              lambda y: Binary([y, inp(2, 16, 9, 11)], fn="add"), lambda y: Activation([y], kind="relu")),
        group("relu-1x1-unpacked", Conv([inp(1, 16, 20, 21), inp(24, 16, 1, 1), inp(24)]),
              lambda y: Activation([y], kind="relu")),
        group("add-two-k-blocks", Conv([inp(1, 40, 9, 13), inp(20, 40, 3, 3)], pads=(1, 1, 1, 1)),
              lambda y: Binary([inp(1, 20, 9, 13), y], fn="add"), lambda y: Activation([y], kind="relu")),
        group("groups-images", Conv([inp(2, 8, 10, 37), inp(12, 4, 3, 3), inp(12)], group=2, pads=(1, 1, 1, 1)),
              lambda y: Binary([y, inp(2, 12, 10, 37)], fn="add"), lambda y: Activation([y], kind="relu")),
        group("strided-relu", Conv([inp(1, 8, 30, 30), inp(16, 8, 3, 3), inp(16)], pads=(1, 1, 1, 1),
                                   strides=(2, 2)),
              lambda y: Activation([y], kind="relu")),
    ]
    cases = [
        group("relu-then-add", Conv([inp(1, 8, 9, 11), inp(16, 8, 3, 3), inp(16)], pads=(1, 1, 1, 1)),
              lambda y: Activation([y], kind="relu"), lambda y: Binary([y, inp(1, 16, 9, 11)], fn="add")),
        group("scale", Conv([inp(2, 24, 7, 5), inp(16, 24, 1, 1)]),
              lambda y: Binary([y, inp(1, 16, 1, 1)], fn="mul"), lambda y: Binary([y, inp()], fn="add"),
              lambda y: Clip([y], lo=0.0, hi=0.5)),
        group("conv1d", Conv([inp(2, 6, 40), inp(12, 3, 5), inp(12)], group=2, pads=(2, 1), strides=(3,)),
              lambda y: Activation([y], kind="leaky_relu", alpha=0.1), lambda y: Activation([y], kind="sigmoid")),
        group("threads", Conv([inp(1, 8, 48, 48), inp(24, 8, 3, 3), inp(24)], pads=(1, 1, 1, 1), strides=(2, 2)),
              lambda y: Binary([y, inp(24, 1, 1)], fn="add"), lambda y: Activation([y], kind="relu")),
        group("own-input", Conv([x5, inp(16, 16, 3, 3)], pads=(1, 1, 1, 1)),
              lambda y: Binary([y, x5], fn="sub")),
    ]
    finish_packed = [  # PackedConv: the transposition adds the residual, then the Relu
        group("packed-residual", PackedConv([inp(2, 8, 9, 11), inp(3, 72, PANEL), inp(40)], oc=40, kernel=(3, 3),
                                            pads=(1, 1, 1, 1)),
              lambda y: Binary([y, inp(2, 40, 9, 11)], fn="add"), lambda y: Activation([y], kind="relu")),
        group("packed-relu", PackedConv([inp(1, 16, 7, 7), inp(2, 16, PANEL), inp(20)], oc=20, kernel=(1, 1)),
              lambda y: Activation([y], kind="relu")),
        group("packed-wide-residual", PackedConv([inp(1, 20, 7, 7), inp(64, 20, PANEL), inp(1024)], oc=1024,
                                                 kernel=(1, 1)),
              lambda y: Binary([y, inp(1, 1024, 7, 7)], fn="add"), lambda y: Activation([y], kind="relu")),
        group("packed-s2-residual", PackedConv([inp(2, 20, 9, 33), inp(2, 180, PANEL), inp(24)], oc=24,
                                               kernel=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2)),
              lambda y: Binary([y, inp(2, 24, 5, 17)], fn="add"), lambda y: Activation([y], kind="relu")),
    ]
    packed = [  # PackedConv (passes/prepack.py): the epilogue runs after the transposition
        group("packed-1x1", PackedConv([inp(2, 24, 7, 5), inp(1, 24, PANEL)], oc=16, kernel=(1, 1)),
              lambda y: Binary([y, inp(1, 16, 1, 1)], fn="mul"), lambda y: Clip([y], lo=0.0, hi=0.5)),
        group("packed-s2", PackedConv([inp(1, 20, 9, 33), inp(3, 180, PANEL)], oc=40, kernel=(3, 3), strides=(2, 2)),
              lambda y: Binary([y, inp(1, 40, 1, 1)], fn="mul"), lambda y: Clip([y], lo=0.0, hi=0.5)),
    ]
    finish_blocked = [  # blocked outputs (passes/layout.py): the kernels add the residual (blocked alike), clamp
        group("blocked-residual", PackedConv([inp(2, 2, 9, 11, 16), inp(2, 32, PANEL), inp(32)], oc=32,
                                             kernel=(1, 1), blocked_in=True, blocked_out=True),
              lambda y: Binary([y, inp(2, 2, 9, 11, 16)], fn="add"), lambda y: Activation([y], kind="relu")),
        group("blocked-s2-relu6", PackedConv([inp(1, 20, 9, 33), inp(2, 180, PANEL)], oc=32, kernel=(3, 3),
                                             pads=(1, 1, 1, 1), strides=(2, 2), blocked_out=True),
              lambda y: Clip([y], lo=0.0, hi=6.0)),
        group("blocked-rows7-residual", PackedConv([inp(1, 2, 7, 7, 16), inp(2, 288, PANEL), inp(32)], oc=32,
                                                  kernel=(3, 3), pads=(1, 1, 1, 1), blocked_in=True, blocked_out=True),
              lambda y: Binary([y, inp(1, 2, 7, 7, 16)], fn="add"), lambda y: Activation([y], kind="relu")),
    ]
    epi_blocked = [  # a blocked output's other element-wise ops: the epilogue over the lanes of each pixel
        group("blocked-scale", PackedConv([inp(1, 2, 7, 5, 16), inp(2, 32, PANEL), inp(32)], oc=32, kernel=(1, 1),
                                          blocked_in=True, blocked_out=True),
              lambda y: Binary([y, inp(1, 2, 1, 1, 16)], fn="mul"), lambda y: Activation([y], kind="sigmoid")),
    ]

    def wino(c, oc, m):  # the transform of random 3x3 weights
        t = _wino(c, oc, m)
        arrays[id(t)] = winograd_weights(rng.standard_normal((oc, c, 3, 3)).astype(np.float32), m)
        return t

    # threads sharing each step of one chunk: the epilogue's channel ranges of 8 end inside blocks of 16
    epi_blocked.append(group("blocked-winograd-silu", WinogradConv([inp(1, 2, 7, 7, 16), wino(32, 32, 2), inp(32)],
                                                                  oc=32, m=2, pads=(1, 1, 1, 1), blocked_in=True,
                                                                  blocked_out=True),
                             lambda y: Activation([y], kind="sigmoid"), lambda y: Binary([y, y], fn="mul")))
    finish_wino = [  # WinogradConv: the output transform adds the residual, then the Relu
        group("winograd-residual", WinogradConv([inp(2, 16, 9, 11), wino(16, 40, 4), inp(40)], oc=40, m=4,
                                                pads=(1, 1, 1, 1)),
              lambda y: Binary([y, inp(2, 40, 9, 11)], fn="add"), lambda y: Activation([y], kind="relu")),
    ]
    winograd = [  # WinogradConv: the epilogue runs on each chunk of tiles (whole-chunk and shared steps; a
        # chunk may end inside a row of tiles: 9 tiles on 2 threads)
        group("winograd-partial", WinogradConv([inp(1, 16, 9, 11), wino(16, 24, 4)], oc=24, m=4, pads=(1, 1, 1, 1)),
              lambda y: Binary([y, inp(1, 24, 1, 1)], fn="mul"), lambda y: Clip([y], lo=-0.5, hi=0.5)),
        group("winograd-scale", WinogradConv([inp(1, 24, 40, 40), wino(24, 16, 2)], oc=16, m=2, pads=(1, 1, 1, 1)),
              lambda y: Binary([y, inp(1, 16, 1, 1)], fn="mul"), lambda y: Clip([y], lo=0.0, hi=0.5)),
    ]
    finish_dw = [  # sf_conv_depthwise: a Relu or a Clip alone clamps the rows (or runs) as they finish
        group("dw-relu", Conv([inp(2, 8, 9, 11), inp(8, 1, 3, 3), inp(8)], group=8, pads=(1, 1, 1, 1)),
              lambda y: Activation([y], kind="relu")),
        group("dw-relu6", Conv([inp(1, 8, 12, 10), inp(8, 1, 3, 3), inp(8)], group=8, pads=(1, 1, 1, 1),
                               strides=(2, 2)),
              lambda y: Clip([y], lo=0.0, hi=6.0)),
    ]
    depthwise = [  # other ops run on each plane
        group("dw-residual-relu", Conv([inp(1, 6, 9, 9), inp(6, 1, 5, 5)], group=6, pads=(2, 2, 2, 2)),
              lambda y: Binary([y, inp(1, 6, 9, 9)], fn="add"), lambda y: Activation([y], kind="relu")),
        # blocks of 16 channels (one of 4; output rows wider than the input's) and bands of rows: each block's band
        group("dw-blocks-residual", Conv([inp(2, 20, 100, 37), inp(20, 1, 3, 3), inp(20)], group=20,
                                         pads=(1, 1, 1, 2)),
              lambda y: Binary([y, inp(2, 20, 100, 38)], fn="add"), lambda y: Binary([y, inp(20, 1, 1)], fn="mul")),
        # stride 1, rows as wide as the input's (runs of 16 pixels across rows) in two bands of runs, two
        # outputs per channel: each output channel's band's ops
        group("dw-flat-bands", Conv([inp(1, 3, 320, 16), inp(6, 1, 3, 3), inp(6)], group=3, pads=(1, 1, 1, 1)),
              lambda y: Binary([y, inp(1, 6, 320, 16)], fn="add"), lambda y: Binary([y, inp(6, 1, 1)], fn="mul")),
        # two outputs per input channel, in blocks: the ops run on each output channel's band
        group("dw-multiplier-residual", Conv([inp(1, 4, 9, 10), inp(8, 1, 3, 3), inp(8)], group=4,
                                             pads=(1, 1, 1, 2)),
              lambda y: Binary([y, inp(1, 8, 9, 11)], fn="add"), lambda y: Binary([y, inp(8, 1, 1)], fn="mul")),
    ]
    transposed = [  # ConvTranspose: the epilogue (bias first) finishes each folded plane
        group("convT-relu", ConvTranspose([inp(2, 8, 7, 6), inp(8, 12, 3, 3), inp(12)], strides=(2, 2),
                                          pads=(1, 1, 1, 1), output_shape=(14, 12)),
              lambda y: Activation([y], kind="relu")),
        group("convT-groups-residual", ConvTranspose([inp(1, 8, 9), inp(8, 3, 4)], group=2, strides=(2,),
                                                     pads=(1, 1), output_shape=(18,)),
              lambda y: Binary([y, inp(1, 6, 18)], fn="add"), lambda y: Activation([y], kind="sigmoid")),
    ]
    resized = [  # Resize: the epilogue runs on each band of rows (few planes) or plane (many)
        group("resize-fpn-add", _resize(inp(1, 4, 6, 7), (1, 4, 12, 14), "nearest", "asymmetric", nearest_mode="floor"),
              lambda y: Binary([y, inp(1, 4, 12, 14)], fn="add")),
        group("resize-planes-relu", _resize(inp(2, 16, 5, 6), (2, 16, 10, 9), "linear", "half_pixel"),
              lambda y: Binary([y, inp(16, 1, 1)], fn="mul"), lambda y: Activation([y], kind="relu")),
        group("resize-1d-sigmoid", _resize(inp(2, 3, 10), (2, 3, 25), "cubic", "half_pixel"),
              lambda y: Activation([y], kind="sigmoid")),
        group("resize-1d-residual", _resize(inp(2, 3, 10), (2, 3, 25), "linear", "half_pixel"),  # rows = channels
              lambda y: Binary([y, inp(2, 3, 25)], fn="add"), lambda y: Binary([y, inp(3, 1)], fn="mul")),
    ]
    def dag(name, conv, build):  # build(y) -> the members after the conv, reading y and each other
        members = [conv, *build(conv.outputs[0])]
        for k, op in enumerate(members):
            op.name = f"{name}-{k}"
        return FusedOp(members)

    def silu(y):  # x * sigmoid(x), as exporters write SiLU: the conv's value read by two members
        s = Activation([y], kind="sigmoid")
        return [s, Binary([y, s.outputs[0]], fn="mul")]

    def gelu_erf(y):  # 0.5 * x * (1 + erf(x / sqrt(2))), as torch exports nn.GELU
        d = Binary([y, inp()], fn="div")
        e = Unary([d.outputs[0]], fn="erf")
        a = Binary([e.outputs[0], inp()], fn="add")
        m = Binary([y, a.outputs[0]], fn="mul")
        return [d, e, a, m, Binary([m.outputs[0], inp()], fn="mul")]

    # members that read the conv's value and each other's (not a chain): SiLU, GELU (flat runs; rows with an
    # operand broadcast along them; a depthwise conv's planes)
    cases += [dag("silu-dag", Conv([inp(1, 8, 9, 11), inp(16, 8, 3, 3), inp(16)], pads=(1, 1, 1, 1)), silu),
              dag("gelu-erf-dag", Conv([inp(2, 12, 6, 10), inp(16, 12, 1, 1)]), gelu_erf),
              dag("row-broadcast-dag", Conv([inp(1, 8, 6, 10), inp(16, 8, 3, 3)], pads=(1, 1, 1, 1)),
                  lambda y: (lambda s, r: [s, r, Binary([r.outputs[0], s.outputs[0]], fn="mul")])(
                      Activation([y], kind="sigmoid"), Binary([y, inp(10)], fn="add")))]
    depthwise.append(dag("dw-silu-dag", Conv([inp(1, 16, 12, 10), inp(16, 1, 3, 3), inp(16)], group=16,
                                             pads=(1, 1, 1, 1)), silu))
    # in the blocked layout only a chain (a graph of members measured slower there than apart)
    blocked_dag = dag("blocked-silu-dag", PackedConv([inp(1, 2, 7, 5, 16), inp(2, 32, PANEL), inp(32)], oc=32,
                                                     kernel=(1, 1), blocked_in=True, blocked_out=True), silu)
    assert template_kind(blocked_dag) is None
    other = group("transpose", Conv([inp(1, 4, 6, 6), inp(4, 4, 3, 3)], pads=(1, 1, 1, 1)),
                  lambda y: Transpose([y], perm=(0, 1, 3, 2)))  # not element-wise: the generic nest
    # operands broadcast along a row or a column: the epilogue loops over rows (elsewhere over a channel's
    # pixels as one run)
    cases.append(group("row-column-broadcast", Conv([inp(1, 8, 6, 10), inp(16, 8, 3, 3)], pads=(1, 1, 1, 1)),
                       lambda y: Binary([y, inp(10)], fn="add"), lambda y: Binary([y, inp(6, 1)], fn="mul")))
    # Clips the kernels apply as they store: ReLU6 (1x1 read from the image), a lower bound after a
    # residual, an upper bound alone (PackedConv), crossed bounds after a residual (min > max: all max;
    # Winograd), a flat depthwise conv's runs
    finish.append(group("relu6-1x1", Conv([inp(1, 16, 20, 21), inp(24, 16, 1, 1), inp(24)]),
                        lambda y: Clip([y], lo=0.0, hi=6.0)))
    finish.append(group("residual-clip-lo", Conv([inp(2, 8, 9, 11), inp(16, 8, 3, 3), inp(16)], pads=(1, 1, 1, 1)),
                        lambda y: Binary([y, inp(2, 16, 9, 11)], fn="add"), lambda y: Clip([y], lo=-0.5)))
    finish_packed.append(group("packed-clip-hi", PackedConv([inp(1, 16, 7, 7), inp(2, 16, PANEL), inp(20)], oc=20,
                                                            kernel=(1, 1)),
                               lambda y: Clip([y], hi=0.5)))
    finish_wino.append(group("winograd-clip-crossed", WinogradConv([inp(1, 16, 9, 11), wino(16, 24, 4), inp(24)],
                                                                   oc=24, m=4, pads=(1, 1, 1, 1)),
                             lambda y: Binary([y, inp(1, 24, 9, 11)], fn="add"),
                             lambda y: Clip([y], lo=0.5, hi=-0.5)))
    finish_dw.append(group("dw-flat-clip", Conv([inp(2, 8, 12, 10), inp(8, 1, 3, 3), inp(8)], group=8,
                                                pads=(1, 1, 1, 1)),
                           lambda y: Clip([y], lo=-1.0, hi=1.0)))
    finish.append(group("strided-clip-crossed", Conv([inp(1, 8, 30, 30), inp(16, 8, 3, 3), inp(16)],
                                                     pads=(1, 1, 1, 1), strides=(2, 2)),
                        lambda y: Clip([y], lo=0.25, hi=-0.25)))
    # a Relu or a Clip of another tensor than the conv's output is not the kernels' to apply
    cases += [group(f"{kind}-of-another", Conv([inp(1, 8, 9, 11), inp(16, 8, 3, 3)], pads=(1, 1, 1, 1)),
                    lambda y, kind=kind: (Clip([inp(1, 16, 9, 11)], lo=0.0, hi=0.5) if kind == "clip"
                                          else Activation([inp(1, 16, 9, 11)], kind="relu")))
              for kind in ("clip", "relu")]
    # stride 2 (AVX-512: runs of a row): ReLU6 in the kernel; other ops on each band of rows (three bands)
    finish_dw.append(group("dw-s2-relu6", Conv([inp(1, 8, 40, 38), inp(8, 1, 3, 3), inp(8)], group=8,
                                               pads=(1, 1, 1, 1), strides=(2, 2)),
                           lambda y: Clip([y], lo=0.0, hi=6.0)))
    depthwise.append(group("dw-s2-bands", Conv([inp(1, 2, 600, 36), inp(2, 1, 3, 3), inp(2)], group=2,
                                               pads=(1, 1, 1, 1), strides=(2, 2)),
                           lambda y: Binary([y, inp(1, 2, 300, 18)], fn="add"),
                           lambda y: Binary([y, inp(2, 1, 1)], fn="mul")))
    finish += finish_packed + finish_wino + finish_blocked
    for g in finish:  # a NaN in the residual (or the input) stays NaN through the clamp, as in numpy
        arrays[id(g.inputs[-1 if len(g.inputs) > 3 else 0])].flat[5] = np.nan
    for g in finish + cases + packed + winograd + transposed + finish_dw + depthwise + resized + epi_blocked:
        assert template_kind(g) == "Fused" and accepts_group(g), g.name
    assert template_kind(other) is None
    for g in finish_dw:
        arrays[id(g.inputs[0])].flat[7] = np.nan  # the clamp keeps a NaN
    ops = finish + cases + packed + winograd + transposed + finish_dw + depthwise + resized + epi_blocked + [other]
    src = generate_cpu_source(ops)
    assert src.text.count("sf_conv2d)(in") == len(finish + cases) - len(finish_packed + finish_wino + finish_blocked)
    assert src.text.count("sf_conv2d_packed)(in") == len(packed + finish_packed + finish_blocked) + 1
    assert src.text.count("SF_BLK_IN | SF_BLK_OUT, nullptr, nullptr, in3, SfClamp{true, 0.0f, ") == 2
    assert src.text.count("sf_conv2d_winograd<4>)(in") == 3 and src.text.count("sf_conv2d_winograd<2>)(in") == 2
    assert src.text.count("sf_conv_transpose2d)(in") == len(transposed)
    assert src.text.count("sf_conv_depthwise)(in") == len(finish_dw + depthwise)
    inf = "std::numeric_limits<float>::infinity()"
    assert src.text.count(f"sf_conv_depthwise)(in0, in1, in2, out0, geom, 2, 8, 1, 0, nullptr, nullptr, "
                          f"SfClamp{{true, 0.0f, {inf}}});") == 1
    assert src.text.count("SfClamp{true, 0.0f, 6.0f}") == 4 and src.text.count("SfClamp{true, 0.5f, -0.5f}") == 1
    assert src.text.count(f"SfClamp{{true, (-{inf}), 0.5f}}") == 1
    assert src.text.count(", epi_, &ctx_") == len(cases + packed + winograd + transposed + depthwise + epi_blocked)
    assert src.text.count("the tiles are finished as they are stored") == len(finish + finish_dw)
    assert src.text.count("epi_(&ctx_, pl") == len(resized)
    # the epilogues are functions of the file, compiled for each instruction set where the kernel is large
    epis = re.findall(r"(SF_CLONES )?static void sf_fused_\w+_epi\(", src.text)
    assert len(epis) == len(cases + packed + winograd + transposed + depthwise + resized + epi_blocked) and any(epis)
    syms = build_cpu_library(ops, str(tmp_path / "fused.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "fused.so"))
    for g in ops:
        ins = [arrays[id(t)] for t in g.inputs]
        want = g.run(*ins)[0]
        got = run_kernel(lib, syms[g.name], g, ins)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.nanmax(np.abs(want))), err_msg=g.name)
    forced = [(syms[g.name], [arrays[id(t)] for t in g.inputs], g.run(*[arrays[id(t)] for t in g.inputs]))
              for g in finish + cases + finish_dw + depthwise + epi_blocked]
    for isa in ("avx2", "generic"):
        assert _run_forced_isa(tmp_path / "fused.so", forced, isa, tmp_path)[1] == f"ok {len(forced)}", isa


def test_3d_conv_kernels_finish_a_residual_and_a_clamp(tmp_path, kernel_cache):
    """A 3-D conv and the ops its kernels apply as they store (a residual Add, then a Relu or a Clip: a video
    ResNet's conv with its batch norm folded and its ReLU, a residual block's end) compile to sf_conv3d with
    them: B read in place (groups, two images, column tails; K in blocks) and packed (a W stride of 2), also
    with the AVX2 and portable kernels forced, a NaN kept through the clamp. Other ops after one (a Relu then
    an Add, a sigmoid) are refused as its epilogue: fused, the conv and its Relu form one kernel and a sigmoid
    after them another."""
    from shardflow.compiler.codegen import prepare_cpu_library
    from shardflow.compiler.codegen.templates_cpu import accepts_group, template_kind
    from shardflow.compiler.ops.elementwise import Clip

    arrays, inp, group = _fused_groups(3)

    relu = lambda y: Activation([y], kind="relu")  # noqa: E731
    finish = [
        group("c3-residual-relu", Conv([inp(2, 8, 5, 6, 35), inp(12, 4, 3, 3, 3), inp(12)], group=2, pads=(1,) * 6),
              lambda y: Binary([y, inp(2, 12, 5, 6, 35)], fn="add"), relu),
        group("c3-s2-relu6", Conv([inp(1, 8, 6, 9, 20), inp(16, 8, 3, 3, 3), inp(16)], pads=(1,) * 6,
                                  strides=(2, 2, 2)),
              lambda y: Clip([y], lo=0.0, hi=6.0)),
        group("c3-add-k-blocks", Conv([inp(1, 40, 4, 5, 17), inp(20, 40, 3, 3, 3)], pads=(1,) * 6),
              lambda y: Binary([inp(1, 20, 4, 5, 17), y], fn="add")),
    ]
    refused = [group("c3-relu-then-add", Conv([inp(1, 8, 4, 5, 17), inp(16, 8, 3, 3, 3)], pads=(1,) * 6), relu,
                     lambda y: Binary([y, inp(1, 16, 4, 5, 17)], fn="add")),
               group("c3-sigmoid", Conv([inp(1, 8, 4, 5, 17), inp(16, 8, 1, 1, 1)]),
                     lambda y: Activation([y], kind="sigmoid"))]
    assert all(template_kind(g) == "Fused" and accepts_group(g) for g in finish)
    assert not any(accepts_group(g) for g in refused)
    arrays[id(finish[0].inputs[3])].flat[5] = np.nan  # the residual's NaN stays NaN through the Relu
    arrays[id(finish[1].inputs[0])].flat[7] = np.nan
    src = generate_cpu_source(finish)
    inf = "std::numeric_limits<float>::infinity()"
    assert src.text.count("sf_conv3d)(in") == 3 and f", in3, SfClamp{{true, 0.0f, {inf}}});" in src.text
    assert ", nullptr, SfClamp{true, 0.0f, 6.0f});" in src.text
    assert "nullptr, out0, geom, 1, 1, 20, in2, SfClamp{});" in src.text
    syms = build_cpu_library(finish, str(tmp_path / "c3.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "c3.so"))
    forced = []
    for g in finish:
        ins = [arrays[id(t)] for t in g.inputs]
        want = g.run(*ins)
        np.testing.assert_allclose(run_kernel(lib, syms[g.name], g, ins)[0], want[0], rtol=1e-4,
                                   atol=1e-4 * float(np.nanmax(np.abs(want[0]))), err_msg=g.name)
        forced.append((syms[g.name], ins, want))
    for isa in ("avx2", "generic"):
        assert _run_forced_isa(tmp_path / "c3.so", forced, isa, tmp_path)[1] == f"ok {len(forced)}", isa
    # fused as the cpu target fuses: a 3-D conv with its Relu, then a sigmoid of theirs apart
    conv = Conv([_t((1, 8, 4, 5, 17)), _t((16, 8, 3, 3, 3))], pads=(1,) * 6, name="c")
    act = Activation([conv.outputs[0]], kind="relu", name="r")
    sig = Activation([act.outputs[0]], kind="sigmoid", name="s")
    symbols, src = prepare_cpu_library([conv, act, sig], fuse=True)
    assert symbols["c"] is None and symbols["r"]["outputs"] == ["r:0"]  # (c runs in r's kernel)
    assert symbols["s"].startswith("sf_activation_")
    assert src.text.count("sf_conv3d)(in") == 1
    assert f"SfClamp{{true, 0.0f, {inf}}});" in src.text


def test_3d_convs_copy_their_padded_volume_by_chunks(tmp_path, kernel_cache, monkeypatch):
    """sf_conv3d copies the padded volume by chunks of output depth slices, each under a byte limit (32 MB;
    SHARDFLOW_CONV3D_PAD_BYTES here 20000): chunks of 7 slices then 2 (B read in place and packed), one slice
    a chunk where a depth stride and dilation reach past the limit (groups, two images), and a residual
    and a Relu finished per chunk; against numpy."""
    arrays, inp, group = _fused_groups(4)
    cases = [Conv([inp(1, 3, 9, 6, 20), inp(5, 3, 3, 3, 3), inp(5)], pads=(1,) * 6, name="in-place"),
             Conv([inp(1, 3, 9, 6, 20), inp(5, 3, 3, 3, 3), inp(5)], pads=(1,) * 6, strides=(1, 1, 2), name="packed"),
             Conv([inp(2, 4, 11, 5, 17), inp(6, 2, 3, 3, 3), inp(6)], group=2, pads=(2, 1, 1, 2, 1, 1),
                  strides=(2, 1, 1), dilations=(2, 1, 1), name="one-slice"),
             group("c3-chunks-residual", Conv([inp(1, 4, 10, 5, 18), inp(8, 4, 3, 3, 3), inp(8)], pads=(1,) * 6),
                   lambda y: Binary([y, inp(1, 8, 10, 5, 18)], fn="add"), lambda y: Activation([y], kind="relu"))]
    syms = build_cpu_library(cases, str(tmp_path / "chunks.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "chunks.so"))
    monkeypatch.setenv("SHARDFLOW_CONV3D_PAD_BYTES", "20000")
    for op in cases:
        ins = [arrays[id(t)] for t in op.inputs]
        want = op.run(*ins)[0]
        np.testing.assert_allclose(run_kernel(lib, syms[op.name], op, ins)[0], want, rtol=1e-4,
                                   atol=1e-4 * float(np.abs(want).max()), err_msg=op.name)


_HALF_FINISH_SCRIPT = r"""
import ctypes, sys
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
data = np.load(sys.argv[2], allow_pickle=True)
def call(sym, ins, shape):
    out = np.empty(shape, np.float32)
    ia = (ctypes.c_void_p * len(ins))(*[a.ctypes.data for a in ins])
    getattr(lib, sym)(ia, (ctypes.c_void_p * 1)(out.ctypes.data))
    return out
import ml_dtypes
r = lambda a: a.astype(np.float16 if sys.argv[3] == "float16" else ml_dtypes.bfloat16).astype(np.float32)
for name, plain, pins, fused, fins, res, lo, hi in data["cases"]:
    shape = tuple(data["shapes"].item()[name])
    y = r(call(plain, list(pins), shape))
    if res is not None:
        y = r(y + res)
    y = np.clip(y, lo, hi)
    got = call(fused, list(fins), shape)
    assert np.array_equal(got.view(np.uint32), y.view(np.uint32)), (name, np.flatnonzero(got != y)[:5])
print("ok", len(data["cases"]))
"""


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_half_models_conv_rounds_as_it_stores(tmp_path, kernel_cache, half):
    """A float16 or bfloat16 model's conv computed in float32 (``HalfModelInFloat32``): its output rounded to half,
    a residual added and rounded again, then a Relu or a Clip (``conv -> RoundHalf -> Add -> RoundHalf ->
    Relu`` or the Relu before the rounding) is applied by the conv kernels as they store (``SfClamp``'s
    ``half``) on every path: the template's micro-kernels, PackedConv's transposition and its direct
    kernels (plain, blocked, stride 2), Winograd's output transform, the depthwise kernels (rows, flat runs,
    stride 2; no residual); with the AVX-512, AVX2 and portable kernels. Bit for bit what numpy's roundings
    of the same conv's float32 output give (the conv compiled alone). A rounding after the Add only, or a
    depthwise conv's residual, goes to the generic epilogue."""
    import sys

    from shardflow.compiler.codegen.fusion import FusedOp
    from shardflow.compiler.ops.elementwise import Clip

    rng = np.random.default_rng(11)
    arrays: dict[int, np.ndarray] = {}

    def inp(*shape):
        t = _t(shape)
        arrays[id(t)] = (rng.standard_normal(shape) * 4).astype(np.float32)
        return t

    def wino(c, oc, m):
        t = _wino(c, oc, m)
        arrays[id(t)] = winograd_weights(rng.standard_normal((oc, c, 3, 3)).astype(np.float32), m)
        return t

    rnd = lambda y: RoundHalf([y], to=half)  # noqa: E731
    cases = []  # (name, plain conv, fused group, residual tensor or None, lo, hi)

    def case(name, make_conv, res_shape=None, clamp=(0.0, np.inf), relu_first=False, kinds=None):
        plain = make_conv()
        conv = type(plain)(list(plain.inputs), name=f"{name}-conv", **plain.attrs)
        plain.name = f"{name}-plain"
        members, prev = [conv], conv.outputs[0]

        def add(op):
            nonlocal prev
            op.name = f"{name}-{len(members)}"
            members.append(op)
            prev = op.outputs[0]
        res = inp(*res_shape) if res_shape else None
        clamp_op = (lambda y: Activation([y], kind="relu")) if clamp == (0.0, np.inf) else \
            (lambda y: Clip([y], lo=clamp[0], hi=clamp[1]))
        add(rnd(prev))
        if res is not None:
            add(Binary([prev, res], fn="add"))
        if relu_first:
            add(clamp_op(prev))
            add(rnd(prev))
        else:
            if res is not None:
                add(rnd(prev))
            add(clamp_op(prev))
        cases.append((name, plain, FusedOp(members), res, *clamp))

    case("conv3x3", lambda: Conv([inp(2, 8, 9, 11), inp(16, 8, 3, 3), inp(16)], pads=(1, 1, 1, 1)), (2, 16, 9, 11))
    case("conv3x3-relu-first", lambda: Conv([inp(1, 40, 9, 13), inp(20, 40, 3, 3), inp(20)], pads=(1, 1, 1, 1)),
         (1, 20, 9, 13), relu_first=True)
    case("conv1x1-relu6", lambda: Conv([inp(1, 16, 20, 21), inp(24, 16, 1, 1), inp(24)]), clamp=(0.0, 6.0))
    case("packed3x3", lambda: PackedConv([inp(2, 8, 9, 11), inp(3, 72, PANEL), inp(40)], oc=40, kernel=(3, 3),
                                         pads=(1, 1, 1, 1)), (2, 40, 9, 11))
    case("packed-wide", lambda: PackedConv([inp(1, 20, 7, 7), inp(64, 20, PANEL), inp(1024)], oc=1024, kernel=(1, 1)),
         (1, 1024, 7, 7), relu_first=True)
    case("packed-s2", lambda: PackedConv([inp(2, 20, 9, 33), inp(2, 180, PANEL), inp(24)], oc=24, kernel=(3, 3),
                                         pads=(1, 1, 1, 1), strides=(2, 2)), (2, 24, 5, 17))
    case("blocked", lambda: PackedConv([inp(2, 2, 9, 11, 16), inp(2, 32, PANEL), inp(32)], oc=32, kernel=(1, 1),
                                       blocked_in=True, blocked_out=True), (2, 2, 9, 11, 16))
    case("winograd", lambda: WinogradConv([inp(2, 16, 9, 11), wino(16, 40, 4), inp(40)], oc=40, m=4,
                                          pads=(1, 1, 1, 1)), (2, 40, 9, 11), relu_first=True)
    case("winograd-clip", lambda: WinogradConv([inp(1, 16, 9, 11), wino(16, 24, 4), inp(24)], oc=24, m=4,
                                               pads=(1, 1, 1, 1)), clamp=(-2.0, 3.0))
    # depthwise: rows of 16 channels (a band's), runs of a flat image, stride 2's runs
    case("depthwise", lambda: Conv([inp(2, 20, 9, 11), inp(20, 1, 3, 3), inp(20)], group=20, pads=(1, 1, 1, 1)))
    case("depthwise-flat", lambda: Conv([inp(1, 8, 12, 10), inp(8, 1, 3, 3), inp(8)], group=8, pads=(1, 1, 1, 1)),
         clamp=(0.0, 6.0), relu_first=True)
    case("depthwise-s2", lambda: Conv([inp(1, 8, 40, 38), inp(8, 1, 3, 3), inp(8)], group=8, pads=(1, 1, 1, 1),
                                      strides=(2, 2)), clamp=(0.0, 6.0))
    # not the kernels' to apply: a rounding after the Add only; a depthwise conv's residual
    late = Conv([inp(1, 8, 9, 11), inp(16, 8, 3, 3), inp(16)], pads=(1, 1, 1, 1), name="late-conv")
    late_add = Binary([late.outputs[0], inp(1, 16, 9, 11)], fn="add", name="late-add")
    late_group = FusedOp([late, late_add, rnd(late_add.outputs[0])])
    dw = Conv([inp(1, 8, 9, 11), inp(8, 1, 3, 3), inp(8)], group=8, pads=(1, 1, 1, 1), name="dw-conv")
    dw_round = rnd(dw.outputs[0])
    dw_add = Binary([dw_round.outputs[0], inp(1, 8, 9, 11)], fn="add", name="dw-add")
    dw_group = FusedOp([dw, dw_round, dw_add, rnd(dw_add.outputs[0])])
    ops = [op for c in cases for op in (c[1], c[2])] + [late_group, dw_group]
    src = generate_cpu_source(ops)
    assert src.text.count("the tiles are finished as they are stored") == len(cases)
    code = 1 if half == "float16" else 2
    assert len(re.findall(rf"SfClamp\{{[^}}]*, {code}\}}", src.text)) == len(cases)  # (SfClamp's half)
    assert src.text.count(", epi_, &ctx_") == 2
    syms = build_cpu_library(ops, str(tmp_path / "half.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "half.so"))
    rows = []
    for name, plain, group, res, lo, hi in cases:
        pins = [arrays[id(t)] for t in plain.inputs]
        fins = [arrays[id(t)] for t in group.inputs]
        rows.append((name, syms[plain.name], pins, syms[group.name], fins,
                     None if res is None else arrays[id(res)], lo, hi))
    shapes = {c[0]: tuple(c[1].outputs[0].shape) for c in cases}
    for g in (late_group, dw_group):  # the generic epilogue: as numpy's members
        ins = [arrays[id(t)] for t in g.inputs]
        want = g.run(*ins)[0]
        got = run_kernel(lib, syms[g.name], g, ins)[0]
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-3, err_msg=g.name)
    np.savez(tmp_path / "cases.npz", cases=np.array(rows, dtype=object), shapes=np.array(shapes, dtype=object))
    (tmp_path / "half.py").write_text(_HALF_FINISH_SCRIPT)
    for isa in ("native", "avx2", "generic"):
        env = dict(os.environ, SHARDFLOW_CPU_ISA=isa) if isa != "native" else dict(os.environ)
        res = subprocess.run([sys.executable, str(tmp_path / "half.py"), str(tmp_path / "half.so"),
                              str(tmp_path / "cases.npz"), half], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0 and res.stdout.strip().endswith(f"ok {len(cases)}"), (isa, res.stderr[-3000:])


def test_the_math_helpers_keep_a_quantized_chain_loop_vectorizable(tmp_path):
    """A QDQ GELU's loop (rounding, the +-2^24 and byte clamps, sf_tanh, sf_log, sf_pow with a literal
    exponent) is vectorized by the C++ compiler at -O3 for x86-64-v3: the helpers' selects take one
    comparison each. With sf_tanh's small-x test as two comparisons joined by && (and sf_log's
    +inf/NaN test by ||), GCC 12 if-converted them into a mask of another width than the clamps'
    and left the loop scalar (GPT-2 small's QDQ GELU kernels: 13 ms instead of 0.7)."""
    import platform
    import shutil
    import subprocess

    from shardflow.compiler.codegen.cpp import PRELUDE

    cxx = os.environ.get("CXX", "g++")
    if platform.machine() not in ("x86_64", "AMD64") or not shutil.which(cxx.split()[0]):
        pytest.skip("needs an x86-64 C++ compiler")
    clamp = "sf_min_const(sf_max_const(sf_round({}), -16777216.0f), 16777216.0f)"
    q = "(float)(sf_min<int32_t>(sf_max<int32_t>((int32_t)(" + clamp + ") + {}, 0), 255))"
    src = PRELUDE + (
        "\nextern \"C\" void k(const float* __restrict__ x, const int32_t* __restrict__ a,\n"
        "                      float* __restrict__ y, int n) {\n"
        "  for (int i = 0; i < n; ++i) {\n"
        f"    float t = ({q.format('((float)a[i] * 3e-5f + x[i]) / 0.02f', 124)} - 124.0f) * 0.02f;\n"
        f"    y[i] = {q.format('sf_tanh(t * 0.79f) / 0.0078f', 127)} + sf_log(t) + sf_pow(t, 3.0f);\n"
        "  }\n}\n")
    (tmp_path / "k.cpp").write_text(src)
    flags = [f for f in toolchain.compile_flags(2) if f not in ("-shared", "-fopenmp") and not f.startswith("-m")]
    res = subprocess.run(cxx.split() + flags + ["-march=x86-64-v3", "-c", str(tmp_path / "k.cpp"), "-o",
                                                 str(tmp_path / "k.o"), "-fopt-info-vec-optimized"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    line = src[:src.index("float t = (", len(PRELUDE))].count("\n") + 1
    assert re.search(rf"k\.cpp:{line - 1}:\d+: optimized: loop vectorized", res.stderr), res.stderr[-3000:]


def test_float16_conversions_are_exact_on_every_bit_pattern(tmp_path, kernel_cache):
    """The generic kernels' float16 loads and stores (the prelude's ``sf_h2f``/``sf_f2h``: integer and float32
    steps that vectorize, where GCC's ``_Float16`` casts went one value at a time) against numpy: all 65536
    float16 bit patterns widened (NaNs stay NaN, of the same sign), and float32 values rounded to float16 to
    nearest even: one in 61 of the bit patterns whose exponent lies in float16's range (61 is odd, so every
    pattern of the 13 bits a rounding drops, ties among them, at every exponent: 2^23 / 61 a binade) and one
    in 97 * 4099 of the others (subnormal results, overflow to infinity, NaN, signed zeros); and the same
    values rounded in float32 (``RoundHalf``, the prelude's ``sf_f16_round``). (Every float32:
    ``benchmarks/cpu_vmath_exhaustive.cpp``.)"""
    halfs = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    near = np.arange(0x33000000, 0x47800100, 61, dtype=np.uint32)  # (2^-25 .. just past 65520, both signs)
    rest = np.arange(0, 1 << 32, 97 * 4099, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x477ff000, 0x477fefff, 0x33000000,
                        0x33000001, 0x387fc000, 0x387fe000, 0x80000000, 0x00000001], np.uint32)
    floats = np.concatenate([near, near | np.uint32(0x80000000), rest, special]).view(np.float32)
    up = CastOp([Tensor("h", halfs.shape, "float16")], name="up", to="float32")
    down = CastOp([Tensor("f", floats.shape, "float32")], name="down", to="float16")
    rounded = RoundHalf([Tensor("f", floats.shape, "float32")], name="rounded", to="float16")
    symbols = build_cpu_library([up, down, rounded], str(tmp_path / "k.so"), cache_dir=kernel_cache, opt_level=1)
    lib = ctypes.CDLL(str(tmp_path / "k.so"))
    (wide,) = run_kernel(lib, symbols["up"], up, [halfs])
    (narrow,) = run_kernel(lib, symbols["down"], down, [floats])
    (kept,) = run_kernel(lib, symbols["rounded"], rounded, [floats])
    with np.errstate(all="ignore"):
        want_wide, want_narrow = halfs.astype(np.float32), floats.astype(np.float16)
    for got, want in ((wide, want_wide), (narrow, want_narrow), (kept, want_narrow.astype(np.float32))):
        bits = np.dtype(f"u{got.dtype.itemsize}")
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan) and np.array_equal(np.signbit(got[nan]), np.signbit(want[nan]))
        bad = np.flatnonzero(got[~nan].view(bits) != want[~nan].view(bits))
        assert bad.size == 0, (got[~nan][bad[:5]], want[~nan][bad[:5]])


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_rounding_that_a_later_rounding_repeats_is_not_printed(tmp_path, kernel_cache, half):
    """A half model computed in float32 rounds a conv's output, applies a Relu and rounds again where a kernel
    stores half values (``Cast(max(RoundHalf(x), 0), half)``): rounding to nearest even is monotone and
    symmetric, so the store's rounding alone gives the same values, through max/min, negation, abs and
    selects (the printer's ``unrounded``). The fused kernels print one rounding each, and their values are
    numpy's (rounded, applied, rounded again) bit for bit on float32 bit patterns around the half type's
    ties, overflow and subnormals, infinities, NaNs and signed zeros (the bfloat16 ResNet-50's Relu after a
    conv: 0.11 ms with both roundings, 0.066 with one)."""
    from shardflow.compiler.codegen.fusion import fuse

    nt = np.float16 if half == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)
    near = (np.float32(1.5) * np.float32(2.0) ** rng.integers(-30, 20, 2048)).astype(np.float32).view(np.uint32)
    ties = near | np.uint32(0x1000 if half == "float16" else 0x8000)  # (halfway between two half values)
    special = np.array([0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x477ff000, 0x477fefff, 0x80000000, 0,
                        0x7f7fffff, 0xff7fffff, 0x00000001, 0x807fffff], np.uint32)
    x = np.concatenate([bits, near, ties, ties | np.uint32(0x80000000), special]).view(np.float32)
    n = x.size
    xt, ct = Tensor("x", (n,), "float32"), Tensor("c", (n,), "bool")
    r = RoundHalf([xt], name="r", to=half)
    relu = Activation(r.outputs, name="relu", kind="relu")
    stored = CastOp(relu.outputs, name="stored", to=half)  # (the store rounds)
    r2 = RoundHalf([xt], name="r2", to=half)
    neg = Unary(r2.outputs, name="neg", fn="neg")
    mag = Unary(r2.outputs, name="mag", fn="abs")
    sel = Where([ct, neg.outputs[0], mag.outputs[0]], name="sel")
    low = Binary([sel.outputs[0], const_tensor(np.array(-2.0, np.float32), "floor")], name="low", fn="max")
    again = RoundHalf(low.outputs, name="again", to=half)  # (a float32 store: the cast's rounding prints)
    ops = [r, relu, stored, r2, neg, mag, sel, low, again]
    keep = {stored.outputs[0].name, again.outputs[0].name}
    groups = fuse(ops, keep=keep)
    assert len(groups) == 2, groups
    src = generate_cpu_source(groups)
    stores = [line for _, text in src.kernels for line in text.splitlines() if "out0[" in line and " = " in line]
    rounding = r"\bsfv?_f16_round\(" if half == "float16" else r"\bsf_bf16_round\("  # (sfv_: its vector form)
    assert stores and all(len(re.findall(rounding, line)) + bool(re.search(r"\bsfv?_f2h\(|\bsf_float_to_bf16\(", line))
                          == 1 for line in stores), stores
    symbols = build_cpu_library(ops, str(tmp_path / "k.so"), cache_dir=kernel_cache, fuse=True, keep=keep)
    lib = ctypes.CDLL(str(tmp_path / "k.so"))
    c = rng.random(n) < 0.5
    arrays = {"x": x, "c": c, "floor": np.array(-2.0, np.float32)}

    def run(name):
        entry = symbols[name]
        ins = [np.ascontiguousarray(arrays[t]) for t in entry["inputs"]]
        outs = [np.empty(n, np.float32 if t.startswith("again") else nt) for t in entry["outputs"]]
        fn = getattr(lib, entry["symbol"])
        fn.restype = None
        fn((ctypes.c_void_p * len(ins))(*[a.ctypes.data for a in ins]),
           (ctypes.c_void_p * len(outs))(*[o.ctypes.data for o in outs]))
        return dict(zip(entry["outputs"], outs))

    got = {**run("stored"), **run("again")}
    with np.errstate(all="ignore"):
        rnd = lambda v: v.astype(nt).astype(np.float32)  # noqa: E731
        want = {"stored:0": np.maximum(rnd(x), 0).astype(nt),
                "again:0": rnd(np.maximum(np.where(c, -rnd(x), np.abs(rnd(x))), np.float32(-2.0)))}
    for k, w in want.items():
        g = got[k]
        nan = np.isnan(w.astype(np.float32))
        assert np.array_equal(np.isnan(g.astype(np.float32)), nan), k
        ub = np.dtype(f"u{w.dtype.itemsize}")
        bad = np.flatnonzero(g[~nan].view(ub) != w[~nan].view(ub))
        assert bad.size == 0, (k, x[~nan][bad[:5]], g[~nan][bad[:5]], w[~nan][bad[:5]])


@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_loops_over_float16_values_vectorize(tmp_path, march):
    """A generic kernel reading float16 values, computing (a tanh GELU), rounding to float16 in the middle and
    storing float16 is vectorized by the C++ compiler, in the default clone and the AVX2 one: GCC 12's own
    ``_Float16`` conversions (one value at a time) kept such loops scalar (a float16 GPT-2's GELU 0.80 ms, not
    0.24); a 16-bit step between the rounding and the widening did too."""
    import platform
    import shutil
    import subprocess

    cxx = os.environ.get("CXX", "g++")
    if platform.machine() not in ("x86_64", "AMD64") or not shutil.which(cxx.split()[0]):
        pytest.skip("needs an x86-64 C++ compiler")
    from shardflow.compiler.codegen.fusion import fuse

    x = Tensor("x", (4, 96), "float16")
    tanh = Unary([x], name="t", fn="tanh")
    half = Binary([tanh.outputs[0], const_tensor(np.array(0.5, np.float16))], name="h", fn="mul")
    up = CastOp(half.outputs, name="up", to="float32")
    back = CastOp(up.outputs, name="back", to="float16")
    y = Binary([back.outputs[0], x], name="y", fn="add")
    src = generate_cpu_source(fuse([tanh, half, up, back, y], keep={y.outputs[0].name}))
    (kernel,) = [text for _, text in src.kernels]
    whole, _ = src.units(1)[0]
    (tmp_path / "k.cpp").write_text(whole)
    flags = [f for f in toolchain.compile_flags(2) if f not in ("-shared", "-w") and not f.startswith("-m")]
    res = subprocess.run(cxx.split() + flags + [f"-march={march}", "-c", str(tmp_path / "k.cpp"), "-o",
                                                 str(tmp_path / "k.o"), "-fopt-info-vec-optimized"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    loop = kernel.rindex("for (")
    line = whole[:whole.index(kernel) + loop].count("\n") + 1
    assert re.search(rf"k\.cpp:{line}:\d+: optimized: loop vectorized", res.stderr), (line, kernel, res.stderr[-2000:])


class _Periodic(Operator):
    """Test-only op: ``x[i, j % 16] + y[i, j // 16] + j`` over ``[A, 16 * R]``, the last axis read modulo, divided
    and as itself (``op.run`` is the reference evaluator)."""

    def compute(self, x, y):
        from shardflow.compiler.ir.expr import Cast

        def f(i, j):
            return BinOp("add", BinOp("add", x[i, j % 16], y[i, j // 16]), Cast(j, "float32"))
        return compute("z", (x.shape[0], 16 * y.shape[1]), f)


def test_a_periodic_last_axis_is_split_into_a_contiguous_inner_loop(tmp_path, kernel_cache):
    """An output whose last axis is read as ``a % c`` (Tile's) is lowered with that axis split into ``(q, r)``:
    the innermost loop reads ``x[..., r]`` without a modulo per element (a copy the C++ compiler vectorizes;
    the survey's ``tile`` case 0.60 -> 0.10 ms). ``a // c`` becomes ``q`` and ``a`` itself ``q * c + r``.
    Periods below 8, and ones that do not divide the axis, keep the plain loop. Values as numpy's."""
    from shardflow.compiler.ops.transform import Tile

    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 24)).astype(np.float32)
    small = rng.standard_normal((3, 4)).astype(np.float32)
    xs, ys = rng.standard_normal((5, 16)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    split = [(Tile([_t(x.shape)], name="tile", repeats=(2, 1, 3)), [x]),
             (_Periodic([_t(xs.shape), _t(ys.shape)], name="periodic"), [xs, ys])]
    plain = [(Tile([_t(small.shape)], name="small", repeats=(1, 5)), [small])]
    for op, _ in split + plain:
        text = generate_cpu_source([op]).kernels[0][1]
        inner, last = text[text.rindex("for ("):], f"i{len(op.outputs[0].shape) - 1}"
        if op.name == "small":
            assert f"sf_mod<int64_t>({last}, " in inner and "_r" not in inner, text
        else:
            assert "sf_mod<int64_t>(v_" not in inner and f"for (int64_t v_{last}_r = 0;" in inner, text
    ops = [op for op, _ in split + plain]
    syms = build_cpu_library(ops, str(tmp_path / "p.so"), cache_dir=kernel_cache, opt_level=2)
    lib = ctypes.CDLL(str(tmp_path / "p.so"))
    for op, arrays in split + plain:
        got = run_kernel(lib, syms[op.name], op, arrays)
        assert_matches(got, op.run(*arrays), [t.dtype for t in op.outputs])
    np.testing.assert_array_equal(run_kernel(lib, syms["tile"], split[0][0], [x])[0], np.tile(x, (2, 1, 3)))


def test_arg_reductions_scan_in_two_vectorized_passes(tmp_path, kernel_cache):
    """ArgMax/ArgMin over 64 or more values print two passes (cpp.ARG_SCAN_MIN_EXTENT: the best value by an
    ``omp simd`` reduction, then its first position in blocks of 16; the survey's ``argmax`` 0.39 -> 0.16 ms)
    with numpy's index on every edge: ties (the first, or the last with ``select_last``), zeros of both signs
    equal, a NaN anywhere (its first), rows all NaN, all -inf or all +inf, the best value in the tail past the
    last full block; float32, float64, float16, int32 and int64. Fewer values keep the one-loop form."""
    rng = np.random.default_rng(11)
    n = 67  # (four full blocks of 16, a tail of 3)
    x = rng.standard_normal((12, n)).astype(np.float32)
    x[0, [5, 40]] = 9.0                       # a tie: the first (or with select_last the last)
    x[1, :] = 0.0
    x[1, 3], x[1, 50] = -0.0, -0.0            # zeros of both signs: equal
    x[2, 30], x[2, 60] = np.nan, np.nan       # NaN wins, the first one
    x[3, :] = np.nan
    x[4, :] = -np.inf
    x[5, :] = np.inf
    x[6, 66] = 50.0                           # in the tail
    x[7, 65] = -50.0                          # the minimum in the tail
    x[8, 64:] = np.nan                        # NaN only in the tail
    x[9, 0] = 50.0
    ints = rng.integers(-5, 5, (6, 100))
    ints[0, 99] = 9
    cases = []
    for dt in ("float32", "float64", "float16"):
        xd = x.astype(dt)
        for kind in ("argmax", "argmin"):
            for last in (False, True):
                cases.append((ArgReduce([_t(xd.shape, dt)], kind=kind, axis=1, keepdims=False, select_last=last,
                                        name=f"{kind}_{dt}_{int(last)}"), [xd]))
    for dt in ("int32", "int64"):
        for kind in ("argmax", "argmin"):
            cases.append((ArgReduce([_t(ints.shape, dt)], kind=kind, axis=1, keepdims=True, name=f"{kind}_{dt}"),
                          [ints.astype(dt)]))
    short = (ArgReduce([_t((4, 40))], kind="argmax", axis=1, keepdims=False, name="short"),
             [rng.standard_normal((4, 40)).astype(np.float32)])
    for op, _ in cases:
        text = generate_cpu_source([op]).kernels[0][1]
        assert "_hit |= " in text and "sf_better" not in text, (op.name, text)
    assert "sf_better_max(" in generate_cpu_source([short[0]]).kernels[0][1]
    syms = build_cpu_library([op for op, _ in cases + [short]], str(tmp_path / "arg.so"), cache_dir=kernel_cache,
                             opt_level=2)
    lib = ctypes.CDLL(str(tmp_path / "arg.so"))
    for op, arrays in cases + [short]:
        got = run_kernel(lib, syms[op.name], op, arrays)[0]
        a = arrays[0]
        fn = np.argmax if op.attrs["kind"] == "argmax" else np.argmin
        want = (a.shape[1] - 1 - fn(a[:, ::-1], axis=1)) if op.attrs.get("select_last") else fn(a, axis=1)
        np.testing.assert_array_equal(got.reshape(-1), want, err_msg=op.name)


def test_kernels_leave_the_x87_state_clean(tmp_path, kernel_cache):
    """Kernels never touch MMX registers (``-mno-mmx``, toolchain.compile_flags): GCC 12 spilled 64-bit values
    through them in the unrolled tails of max reductions over 17 or 67 values (a Softmax row, a ReduceMax, an
    ArgMax) and emitted no ``emms``, which left the calling thread's x87 stack full: afterwards every x87
    computation in the process was NaN (numpy's long double arithmetic and its FFT: the ONNX DFT case's expected
    output, built by the onnx package after such a kernel ran, was NaN)."""
    import platform
    import shutil

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x87 state is an x86-64 matter")
    rng = np.random.default_rng(2)
    cases = []
    for n in (17, 67):
        x = rng.standard_normal((12, n)).astype(np.float32)
        cases += [(Reduce([_t(x.shape)], kind="max", axes=(1,), keepdims=False, name=f"max{n}"), [x]),
                  (Softmax([_t(x.shape)], axes=(1,), log=False, name=f"softmax{n}"), [x]),
                  (ArgReduce([_t(x.shape)], kind="argmax", axis=1, keepdims=False, name=f"argmax{n}"), [x])]
    path = tmp_path / "x87.so"
    syms = build_cpu_library([op for op, _ in cases], str(path), cache_dir=kernel_cache, opt_level=2)
    if shutil.which("objdump"):
        text = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, timeout=120).stdout
        assert "%mm" not in text, [ln for ln in text.splitlines() if "%mm" in ln][:5]
    lib = ctypes.CDLL(str(path))
    for op, arrays in cases:
        run_kernel(lib, syms[op.name], op, arrays)
        assert np.longdouble(1.5) + np.longdouble(np.float64(rng.random())) > 1.5, op.name
        assert np.isfinite(np.fft.fft(np.arange(10.0, dtype=np.float32))).all(), op.name


def test_scratch_memory_that_cannot_be_had_stops_the_rank_with_a_message(tmp_path):
    """A kernel has no way to return an error: when its scratch memory (``sf_workspace``) cannot be
    allocated, the rank stops (abort), saying why on stderr first, not silently."""
    import signal

    from shardflow.compiler.codegen.prelude_cpu import PRELUDE

    src, exe = tmp_path / "ws.cpp", tmp_path / "ws"
    src.write_text(PRELUDE + "\nint main() { return sf_workspace(2, size_t(1) << 62) != nullptr; }\n")
    subprocess.run([toolchain.cxx_compiler(), "-std=c++17", "-O1", "-fopenmp", str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT
    assert "scratch memory: cannot allocate 4611686018427387904 bytes (slot 2); the rank stops" in proc.stderr
