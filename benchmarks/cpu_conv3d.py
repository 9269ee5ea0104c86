"""CPU latency of 3-D convolution models against onnxruntime: single Conv nodes over 3 spatial dims (the
small UNet's below, a 3x3x3 stride-2 downsampling and a 5x5x5 one), single ConvTranspose nodes (a 3-D
UNet's 2x2x2 stride-2 upsampling, a 3x3x3 stride-2 one), a small 3-D UNet (16-32-64 channels: 3x3x3
convs with instance norms and LeakyReLU, 2x2x2 max pools and transposed convs, skip concatenations; one
64^3 volume) and a video ResNet's first stages (r3d_18's stem and basic blocks at 64 and 128 channels, 8
frames of 112x112), and other ops of volumes (3-D pools, resizes, pads); the models with random weights, exported by torch's TorchScript exporter at opset 17
in a child process. Each is compiled for one cpu rank and timed next to onnxruntime with the same
thread count (``cpu_latency.bench``; rfcs/0002 "Transposed convs over 3 spatial dims", "3-D convs read in
place", "3-D convs finish a residual and a clamp").

    python benchmarks/cpu_conv3d.py [--threads 2] [--repeat 10] [--no-models] [--only NAME]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_latency  # noqa: E402

#: name: (input channels, input side, output channels, kernel, stride, pad): the UNet's convs (e1..e3 and d2,
#: d1 as in export_unet3d, out its 1x1x1 head), a stride-2 downsampling, a 5x5x5 conv, one of a 128^3 volume (its
#: padded copy 281 MB whole, copied by chunks since session 96), and the tubelet embedding
#: of VideoMAE-base and ViViT-base (16 frames of 224x224 in 2x16x16 tubelets; a tuple gives each dim's extent)
CONVS = {"conv3d_e1_1_16_64": (1, 64, 16, 3, 1, 1), "conv3d_e2_16_32_32": (16, 32, 32, 3, 1, 1),
         "conv3d_e3_32_64_16": (32, 16, 64, 3, 1, 1), "conv3d_d2_64_32_32": (64, 32, 32, 3, 1, 1),
         "conv3d_d1_32_16_64": (32, 64, 16, 3, 1, 1), "conv3d_out_16_3_64": (16, 64, 3, 1, 1, 0),
         "conv3d_s2_16_32_64": (16, 64, 32, 3, 2, 1), "conv3d_k5_8_16_32": (8, 32, 16, 5, 1, 2),
         "conv3d_32_32_128": (32, 128, 32, 3, 1, 1),
         "conv3d_tubelet_3_768": (3, (16, 224, 224), 768, (2, 16, 16), (2, 16, 16), 0)}
TRANSPOSED = {"convT3d_k2s2_64_32_16": (64, 16, 32, 2, 2, 0), "convT3d_k3s2_32_16_16": (32, 16, 16, 3, 2, 1)}
#: other ops of volumes, each then a Relu (so that the op's output is not the graph's): name -> (op, attributes,
#: input [N, C, D, H, W], Resize's scales or Pad's pads); rfcs/0002 "3-D average pools", "Resizes of volumes",
#: "Reflect, edge and wrap pads over three dims"
VOLUME_OPS = {
    "avgpool3d_2s2": ("AveragePool", dict(kernel_shape=[2, 2, 2], strides=[2, 2, 2]), (1, 16, 32, 64, 64), None),
    "avgpool3d_3s1p1": ("AveragePool", dict(kernel_shape=[3, 3, 3], pads=[1] * 6), (1, 16, 32, 64, 64), None),
    "avgpool3d_3s1p1_incl": ("AveragePool", dict(kernel_shape=[3, 3, 3], pads=[1] * 6, count_include_pad=1),
                             (1, 16, 32, 64, 64), None),
    "avgpool3d_4x7x7": ("AveragePool", dict(kernel_shape=[4, 7, 7]), (1, 16, 32, 64, 64), None),
    "maxpool3d_3s2p1": ("MaxPool", dict(kernel_shape=[3, 3, 3], strides=[2, 2, 2], pads=[1] * 6), (1, 16, 32, 64, 64),
                        None),
    "resize3d_trilinear_x2": ("Resize", dict(mode="linear"), (1, 32, 32, 32, 32), [1, 1, 2, 2, 2]),
    "resize3d_trilinear_align": ("Resize", dict(mode="linear", coordinate_transformation_mode="align_corners"),
                                 (1, 32, 32, 32, 32), [1, 1, 2, 2, 2]),
    "resize3d_nearest_x2": ("Resize", dict(mode="nearest"), (1, 32, 32, 32, 32), [1, 1, 2, 2, 2]),
    "pad3d_reflect": ("Pad", dict(mode="reflect"), (1, 32, 32, 32, 32), [0, 0, 1, 1, 1, 0, 0, 1, 1, 1]),
    "pad3d_edge": ("Pad", dict(mode="edge"), (1, 32, 32, 32, 32), [0, 0, 1, 1, 1, 0, 0, 1, 1, 1]),
}


def volume_op_model(op: str, attrs: dict, shape: tuple, extra, path: str) -> dict:
    """A single ``op`` of a volume, then a Relu, written to ``path`` (opset 18); its input feeds."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits, inputs = [], ["x"]
    if op == "Resize":
        inits, inputs = [numpy_helper.from_array(np.array(extra, np.float32), "s")], ["x", "", "s"]
    elif op == "Pad":
        inits, inputs = [numpy_helper.from_array(np.array(extra, np.int64), "p")], ["x", "p"]
    graph = helper.make_graph([helper.make_node(op, inputs, ["q"], **attrs), helper.make_node("Relu", ["q"], ["y"])],
                              op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    onnx.save(model, path)
    return {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


def conv_model(c: int, d, oc: int, k, s, p: int, path: str, transposed: bool = False) -> dict:
    """A single Conv (or ConvTranspose) over 3 spatial dims with a bias (none transposed) written to ``path``;
    its input feeds. ``d`` (the input's extent), ``k`` (kernel) and ``s`` (stride): one per dim, or one for all."""
    from onnx import TensorProto, helper, numpy_helper

    d, k, s = ((v,) * 3 if isinstance(v, int) else tuple(v) for v in (d, k, s))
    rng = np.random.default_rng(0)
    od = [(n - 1) * st - 2 * p + kk if transposed else (n + 2 * p - kk) // st + 1 for n, kk, st in zip(d, k, s)]
    w = (rng.standard_normal((c, oc, *k) if transposed else (oc, c, *k)) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")] + ([] if transposed else [
        numpy_helper.from_array(rng.standard_normal(oc).astype(np.float32), "b")])
    op = "ConvTranspose" if transposed else "Conv"
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w"] + ([] if transposed else ["b"]), ["y"], strides=list(s), pads=[p] * 6)],
        op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, c, *d))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, oc, *od))], inits)
    with open(path, "wb") as f:
        f.write(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return {"x": rng.standard_normal((1, c, *d)).astype(np.float32)}


def export_unet3d(path: str, side: int = 64) -> dict:
    """The small 3-D UNet (random weights, ``torch.manual_seed(0)``) exported to ``path``; its feeds."""
    import torch

    def block(i, o):
        return torch.nn.Sequential(torch.nn.Conv3d(i, o, 3, padding=1), torch.nn.InstanceNorm3d(o, affine=True),
                                   torch.nn.LeakyReLU(0.01))

    class UNet3D(torch.nn.Module):
        def __init__(self, c=16):
            super().__init__()
            self.e1, self.e2, self.e3 = block(1, c), block(c, 2 * c), block(2 * c, 4 * c)
            self.down = torch.nn.MaxPool3d(2)
            self.u2 = torch.nn.ConvTranspose3d(4 * c, 2 * c, 2, stride=2)
            self.u1 = torch.nn.ConvTranspose3d(2 * c, c, 2, stride=2)
            self.d2, self.d1, self.out = block(4 * c, 2 * c), block(2 * c, c), torch.nn.Conv3d(c, 3, 1)

        def forward(self, x):
            a = self.e1(x)
            b = self.e2(self.down(a))
            c = self.e3(self.down(b))
            b = self.d2(torch.cat([self.u2(c), b], 1))
            return self.out(self.d1(torch.cat([self.u1(b), a], 1)))

    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((1, 1, side, side, side)).astype(np.float32)
    torch.onnx.export(UNet3D().eval(), (torch.from_numpy(x),), path, input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False)
    return {"x": x}


def export_video_resnet(path: str, frames: int = 8, side: int = 112) -> dict:
    """A video ResNet's first stages (torchvision's r3d_18 to its second stage, then pooled and classified; random
    weights, ``torch.manual_seed(0)``) exported to ``path``; its feeds (one clip of ``frames`` RGB frames of
    ``side`` x ``side``): a 3x7x7 stem at stride (1, 2, 2), two basic blocks of 3x3x3 convs at 64 channels, two
    at 128 (the first strided, its shortcut a strided 1x1x1 conv), each conv with a batch norm and a ReLU."""
    import torch
    from torch import nn

    def cbr(i, o, k, s, p, relu=True):
        layers = [nn.Conv3d(i, o, k, stride=s, padding=p, bias=False), nn.BatchNorm3d(o)]
        return nn.Sequential(*layers, *([nn.ReLU()] if relu else []))

    class Block(nn.Module):
        def __init__(self, i, o, s):
            super().__init__()
            self.a, self.b = cbr(i, o, 3, s, 1), cbr(o, o, 3, 1, 1, relu=False)
            self.short = cbr(i, o, 1, s, 0, relu=False) if s != 1 or i != o else nn.Identity()

        def forward(self, x):
            return torch.relu(self.b(self.a(x)) + self.short(x))

    class VideoResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = cbr(3, 64, (3, 7, 7), (1, 2, 2), (1, 3, 3))
            self.layers = nn.Sequential(Block(64, 64, 1), Block(64, 64, 1), Block(64, 128, 2), Block(128, 128, 1))
            self.fc = nn.Linear(128, 400)

        def forward(self, x):
            return self.fc(self.layers(self.stem(x)).mean((2, 3, 4)))

    torch.manual_seed(0)
    model = VideoResNet().eval()
    for m in model.modules():  # batch norms with statistics of their own (the fold must carry them)
        if isinstance(m, nn.BatchNorm3d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    x = np.random.default_rng(0).standard_normal((1, 3, frames, side, side)).astype(np.float32)
    torch.onnx.export(model, (torch.from_numpy(x),), path, input_names=["x"], output_names=["y"], opset_version=17,
                      dynamo=False)
    return {"x": x}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-models", action="store_true", help="only the single convs")
    ap.add_argument("--only", default="", help="only the cases whose name contains this")
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_latency._cpu_model()}, {os.cpu_count()} logical cores; threads: {args.threads}", flush=True)
    with tempfile.TemporaryDirectory() as work:
        for name, shape in [*CONVS.items(), *TRANSPOSED.items()]:
            if args.only not in name:
                continue
            path = os.path.join(work, f"{name}.onnx")
            feeds = conv_model(*shape, path, transposed=name in TRANSPOSED)
            cpu_latency.bench(name, path, feeds, args.threads, args.repeat, work)
        for name, (op, attrs, shape, extra) in VOLUME_OPS.items():
            if args.only in name:
                path = os.path.join(work, f"{name}.onnx")
                feeds = volume_op_model(op, attrs, shape, extra, path)
                cpu_latency.bench(name, path, feeds, args.threads, args.repeat, work)
        for name, export in (("unet3d_64", "export_unet3d"), ("video_resnet_8x112", "export_video_resnet")):
            if not args.no_models and args.only in name:
                path = os.path.join(work, f"{name}.onnx")
                feeds = cpu_latency.in_child(f"cpu_conv3d:{export}", path)
                cpu_latency.bench(name, path, feeds, args.threads, max(args.repeat // 2, 3), work)


if __name__ == "__main__":
    main()
