"""CPU latency of 3-D convolution models against onnxruntime: single Conv nodes over 3 spatial dims (the
small UNet's below, a 3x3x3 stride-2 downsampling and a 5x5x5 one), single ConvTranspose nodes (a 3-D
UNet's 2x2x2 stride-2 upsampling, a 3x3x3 stride-2 one) and a small 3-D UNet (16-32-64
channels: 3x3x3 convs with instance norms and LeakyReLU, 2x2x2 max pools and transposed convs, skip
concatenations; one 64^3 volume, random weights, exported by torch's TorchScript exporter at opset 17
in a child process). Each is compiled for one cpu rank and timed next to onnxruntime with the same
thread count (``cpu_latency.bench``; rfcs/0002 "Transposed convs over 3 spatial dims", "3-D convs read in
place").

    python benchmarks/cpu_conv3d.py [--threads 2] [--repeat 10] [--no-unet] [--only NAME]
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
#: d1 as in export_unet3d, out its 1x1x1 head), a stride-2 downsampling and a 5x5x5 conv
CONVS = {"conv3d_e1_1_16_64": (1, 64, 16, 3, 1, 1), "conv3d_e2_16_32_32": (16, 32, 32, 3, 1, 1),
         "conv3d_e3_32_64_16": (32, 16, 64, 3, 1, 1), "conv3d_d2_64_32_32": (64, 32, 32, 3, 1, 1),
         "conv3d_d1_32_16_64": (32, 64, 16, 3, 1, 1), "conv3d_out_16_3_64": (16, 64, 3, 1, 1, 0),
         "conv3d_s2_16_32_64": (16, 64, 32, 3, 2, 1), "conv3d_k5_8_16_32": (8, 32, 16, 5, 1, 2)}
TRANSPOSED = {"convT3d_k2s2_64_32_16": (64, 16, 32, 2, 2, 0), "convT3d_k3s2_32_16_16": (32, 16, 16, 3, 2, 1)}


def conv_model(c: int, d: int, oc: int, k: int, s: int, p: int, path: str, transposed: bool = False) -> dict:
    """A single Conv (or ConvTranspose) over 3 spatial dims with a bias (none transposed) written to ``path``;
    its input feeds."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    od = (d - 1) * s - 2 * p + k if transposed else (d + 2 * p - k) // s + 1
    w = (rng.standard_normal((c, oc, k, k, k) if transposed else (oc, c, k, k, k)) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")] + ([] if transposed else [
        numpy_helper.from_array(rng.standard_normal(oc).astype(np.float32), "b")])
    op = "ConvTranspose" if transposed else "Conv"
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w"] + ([] if transposed else ["b"]), ["y"], strides=[s] * 3, pads=[p] * 6)],
        op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, c, d, d, d))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, oc, od, od, od))], inits)
    with open(path, "wb") as f:
        f.write(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return {"x": rng.standard_normal((1, c, d, d, d)).astype(np.float32)}


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-unet", action="store_true", help="only the single convs")
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
        if not args.no_unet and args.only in "unet3d_64":
            path = os.path.join(work, "unet3d_64.onnx")
            feeds = cpu_latency.in_child("cpu_conv3d:export_unet3d", path)
            cpu_latency.bench("unet3d_64", path, feeds, args.threads, max(args.repeat // 2, 3), work)


if __name__ == "__main__":
    main()
