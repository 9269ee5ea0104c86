"""CPU latency of the ops with their own templates beside the GEMM/conv ones, vs onnxruntime.

Transposed convolutions (a U-Net/GAN decoder's upsampling: 2x2 and 4x4 stride 2, 3x3 stride 2 with
output padding; depthwise ones, ``group`` = channels, at 4x4 and 2x2 stride 2), the ONNX ``Attention``
op (opset 23, what torch's dynamo exporter writes for
``scaled_dot_product_attention``: causal, GPT-2-small heads, and grouped K/V heads with a padding
mask, as a Llama exports), depthwise convs (MobileNetV2's 3x3 at 112x112, stride 2 at 56x56 and
14x14; ConvNeXt's 7x7), a 3-D conv (3x3x3, 16 -> 32 channels at 16x32x32) and GroupNormalization (a
diffusion UNet's 32 groups of 320 channels at 64x64). Each model is one op after a ``Split`` of its
input ``x`` (Attention) or the op alone, compiled for one cpu rank and timed with
``shardflow.runtime.load`` against onnxruntime with the same thread count, in the same run. Options
as :mod:`cpu_conv` (``--dirs A,B`` compares builds made with ``--build-only --tag A`` round-robin).

    python benchmarks/cpu_ops.py [--threads 2] [--repeat 30] [--only convT_4x4s2_16,attn_causal_512,dw7_56_96]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_conv import main as _main  # noqa: E402

# name: (input channels, input height = width, output channels, kernel, stride, pad, output padding)
CONV_T = {"convT_2x2s2_56": (64, 56, 32, 2, 2, 0, 0), "convT_3x3s2_28": (128, 28, 64, 3, 2, 1, 1),
          "convT_4x4s2_16": (256, 16, 128, 4, 2, 1, 0)}
# name: (channels, input height = width, kernel, stride)
DEPTHWISE = {"dw3_112_32": (32, 112, 3, 1), "dw3s2_56_144": (144, 56, 3, 2), "dw3_14_576": (576, 14, 3, 1),
             "dw7_56_96": (96, 56, 7, 1)}
# name: (channels, input height = width, kernel, stride, pad): depthwise transposed convs (group = channels: FCN's
# 21-class bilinear upsampling, CenterNet's), a conv per output phase since session 96
DEPTHWISE_T = {"dwT_k4s2_21_64": (21, 64, 4, 2, 1), "dwT_k4s2_64_56": (64, 56, 4, 2, 1),
               "dwT_k2s2_128_32": (128, 32, 2, 2, 0)}
# name: (input channels, depth, height = width, output channels): 3x3x3, pad 1
CONV3D = {"conv3d_16_16": (16, 16, 32, 32)}
# name: (channels, height = width, groups)
GROUP_NORM = {"groupnorm_320_64": (320, 64, 32)}
# name: (op, input shape, attributes): ops whose lowering is the generic loop nest or a plain loop
SIMPLE = {"resize_nearest2x_64_80": ("Resize", (1, 64, 80, 80), {"mode": "nearest", "scale": 2.0}),
          "resize_linear2x_64_80": ("Resize", (1, 64, 80, 80), {"mode": "linear", "scale": 2.0}),
          "resize_linear_ac_256_28": ("Resize", (1, 256, 28, 28), {"mode": "linear", "scale": 2.0,
                                                                   "coordinate_transformation_mode": "align_corners"}),
          "softmax_12x512x512": ("Softmax", (1, 12, 512, 512), {"axis": -1}),
          "layernorm_1024x768": ("LayerNormalization", (1024, 768), {"axis": -1}),
          "instnorm_64_112": ("InstanceNormalization", (1, 64, 112, 112), {})}
# name: (batch, query heads, K/V heads, sequence, head size, causal, padding mask)
ATTENTION = {"attn_causal_128": (1, 12, 12, 128, 64, True, False), "attn_causal_512": (1, 12, 12, 512, 64, True, False),
             "attn_gqa_mask_256": (2, 32, 8, 256, 128, False, True)}


def _model(name: str, path: str):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    info = helper.make_tensor_value_info
    if name in CONV_T:
        C, H, OC, K, S, P, OP = CONV_T[name]
        w = (rng.standard_normal((C, OC, K, K)) * 0.1).astype(np.float32)
        b = rng.standard_normal(OC).astype(np.float32)
        OH = (H - 1) * S - 2 * P + K + OP
        node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], kernel_shape=[K, K], strides=[S, S],
                                pads=[P] * 4, output_padding=[OP, OP])
        g = helper.make_graph([node], name, [info("x", TensorProto.FLOAT, [1, C, H, H])],
                              [info("y", TensorProto.FLOAT, [1, OC, OH, OH])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        return rng.standard_normal((1, C, H, H)).astype(np.float32), 2.0 * OC * C * K * K * H * H
    if name in DEPTHWISE_T:
        C, H, K, S, P = DEPTHWISE_T[name]
        w = (rng.standard_normal((C, 1, K, K)) * 0.1).astype(np.float32)
        b = rng.standard_normal(C).astype(np.float32)
        OH = (H - 1) * S - 2 * P + K
        node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=C, kernel_shape=[K, K], strides=[S, S],
                                pads=[P] * 4)
        g = helper.make_graph([node], name, [info("x", TensorProto.FLOAT, [1, C, H, H])],
                              [info("y", TensorProto.FLOAT, [1, C, OH, OH])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        return rng.standard_normal((1, C, H, H)).astype(np.float32), 2.0 * C * K * K * H * H
    if name in DEPTHWISE:
        C, H, K, S = DEPTHWISE[name]
        w = rng.standard_normal((C, 1, K, K)).astype(np.float32)
        b = rng.standard_normal(C).astype(np.float32)
        OH = (H + 2 * (K // 2) - K) // S + 1
        node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=C, kernel_shape=[K, K], strides=[S, S],
                                pads=[K // 2] * 4)
        g = helper.make_graph([node], name, [info("x", TensorProto.FLOAT, [1, C, H, H])],
                              [info("y", TensorProto.FLOAT, [1, C, OH, OH])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        return rng.standard_normal((1, C, H, H)).astype(np.float32), 2.0 * C * K * K * OH * OH
    if name in CONV3D:
        C, D, H, OC = CONV3D[name]
        w = (rng.standard_normal((OC, C, 3, 3, 3)) * 0.1).astype(np.float32)
        node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3, 3], pads=[1] * 6)
        g = helper.make_graph([node], name, [info("x", TensorProto.FLOAT, [1, C, D, H, H])],
                              [info("y", TensorProto.FLOAT, [1, OC, D, H, H])], [numpy_helper.from_array(w, "w")])
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        return rng.standard_normal((1, C, D, H, H)).astype(np.float32), 2.0 * OC * C * 27 * D * H * H
    if name in GROUP_NORM:
        C, H, G = GROUP_NORM[name]
        node = helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=G)
        g = helper.make_graph([node], name, [info("x", TensorProto.FLOAT, [1, C, H, H])],
                              [info("y", TensorProto.FLOAT, [1, C, H, H])],
                              [numpy_helper.from_array(rng.standard_normal(C).astype(np.float32), "s"),
                               numpy_helper.from_array(rng.standard_normal(C).astype(np.float32), "b")])
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)
        return rng.standard_normal((1, C, H, H)).astype(np.float32), 8.0 * C * H * H  # ~8 flops per element
    if name in SIMPLE:
        return _simple(name, path, rng)
    B, HQ, HK, S, D, causal, padded = ATTENTION[name]
    nodes = [helper.make_node("Split", ["x", "sizes"], ["q", "k", "v"], axis=1),
             helper.make_node("Attention", ["q", "k", "v"] + (["m"] if padded else []), ["y"], is_causal=int(causal))]
    inits = [numpy_helper.from_array(np.array([HQ, HK, HK], np.int64), "sizes")]
    if padded:  # the last quarter of the keys of the second sequence are padding
        mask = np.ones((B, 1, S, S), bool)  # onnxruntime wants the rows spelled out
        mask[-1, ..., -S // 4:] = False
        inits.append(numpy_helper.from_array(mask, "m"))
    g = helper.make_graph(nodes, name, [info("x", TensorProto.FLOAT, [B, HQ + 2 * HK, S, D])],
                          [info("y", TensorProto.FLOAT, [B, HQ, S, D])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), path)
    flops = 4.0 * B * HQ * S * S * D * (0.5 if causal else 1.0)  # the products a causal mask leaves
    return rng.standard_normal((B, HQ + 2 * HK, S, D)).astype(np.float32), flops


def _simple(name: str, path: str, rng):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    op, shape, attrs = SIMPLE[name]
    attrs, inits, ins, out_shape = dict(attrs), [], ["x"], list(shape)
    if op == "Resize":
        scale = attrs.pop("scale")
        scales = np.array([1, 1, scale, scale], np.float32)
        inits.append(numpy_helper.from_array(scales, "scales"))
        ins += ["", "scales"]
        out_shape = [int(d * s) for d, s in zip(shape, scales)]
    elif op in ("LayerNormalization", "InstanceNormalization"):
        n = shape[-1] if op == "LayerNormalization" else shape[1]
        inits += [numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), k) for k in ("s", "b")]
        ins += ["s", "b"]
    info = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node(op, ins, ["y"], **attrs)], name, [info("x", TensorProto.FLOAT, shape)],
                          [info("y", TensorProto.FLOAT, out_shape)], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return rng.standard_normal(shape).astype(np.float32), float(np.prod(out_shape))  # "GF/s": elements per ns


if __name__ == "__main__":
    sys.exit(_main(shapes=dict.fromkeys([*CONV_T, *DEPTHWISE_T, *ATTENTION, *DEPTHWISE, *CONV3D, *GROUP_NORM,
                                         *SIMPLE]), model=_model, description=__doc__))
