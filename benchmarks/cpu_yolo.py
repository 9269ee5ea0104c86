"""CPU latency of ultralytics YOLO detectors (random weights, one 640x640 image) vs onnxruntime.

Each model is built from ultralytics' bundled config (``yolov8n.yaml``, ``yolo11n.yaml``,
``yolov5nu.yaml``; no download), exported by torch's TorchScript exporter at opset 17 with the
detection head in export form (one ``[1, 84, 8400]`` output), compiled for one cpu rank and timed
next to onnxruntime with the same thread count (``cpu_latency.bench``). The export runs in a child
process (``cpu_latency.in_child``: torch stays out of the timing process). ultralytics is not a test
extra: install it beside the project without its torch (it pulls a CUDA build) and with the
torchvision that matches torch 2.13, e.g.::

    pip install --target /tmp/ul-site ultralytics opencv-python-headless
    rm -rf /tmp/ul-site/{torch,torch-*,torchgen,nvidia,numpy,numpy-*,numpy.libs,triton*,torchvision*}
    pip install --no-deps --target /tmp/ul-site torchvision==0.28.0
    PYTHONPATH=/tmp/ul-site python benchmarks/cpu_yolo.py [--models yolov8n,yolo11n] [--size 640]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_latency  # noqa: E402


def export(name: str, size: int, path: str) -> None:
    """``name``'s detector (its ultralytics config, random weights) exported to ``path``."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    import torch
    from ultralytics import YOLO

    torch.manual_seed(0)
    model = YOLO(f"{name}.yaml").model.eval()
    for mod in model.modules():  # the head's export form: boxes and classes in one tensor
        if hasattr(mod, "export"):
            mod.export = True
        if hasattr(mod, "format"):
            mod.format = "onnx"
    torch.onnx.export(model, torch.randn(1, 3, size, size), path, opset_version=17, input_names=["x"],
                      output_names=["y"], dynamo=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="yolov8n,yolo11n,yolov5nu")
    ap.add_argument("--size", type=int, default=640)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(f"cpu: {cpu_latency._cpu_model()}, {os.cpu_count()} logical cores; threads: {args.threads}; "
          f"onnxruntime {__import__('onnxruntime').__version__}")
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            path = os.path.join(work, f"{name}_{args.size}.onnx")
            cpu_latency.in_child("cpu_yolo:export", name, args.size, path)
            x = np.random.default_rng(0).random((1, 3, args.size, args.size)).astype(np.float32)
            cpu_latency.bench(f"{name}_{args.size}", path, {"x": x}, args.threads, args.repeat, work)


if __name__ == "__main__":
    main()
