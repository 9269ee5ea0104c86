"""End to end: ResNet-50 (transformers' ``ResNetConfig`` defaults, random weights) on 224x224 images,
Shardflow (one cuda rank) vs torch eager and torch.compile, at batch 1 and 8; or ``--model regnet``,
RegNetY-4GF (``RegNetConfig`` defaults: grouped 3x3 convs of 64 channels a group, squeeze-and-excite).

    python benchmarks/gpu/cnn.py [--model resnet50|regnet] [--batches 1,8] [--precision float16]
                                 [--model-dtype float32]
                                 [--compile-modes default,reduce-overhead] [--repeat 50] [--tiny]
                                 [--dry-run] [--target cpu] [--json OUT.json]

What it measures
    The convolutions of a CNN as a compiled program runs them (rfcs/0005 decisions 55-61: 1x1 convs
    read as they are, convs with a window gathering channels-last images, all on the Hopper wgmma
    template, split-K where few tiles meet a long K, the activations channels-last from conv to
    conv, no copy between them but the stem's; a grouped conv a product per group, decision 62),
    with their batch norms folded,
    ReLUs and residual adds fused, pooling and the classifier. ``kinds`` in the JSON counts the
    program's kernels by kind (``gemm-wgmma-f16`` against the portable ``gemm-f16``, ``transpose``
    for the channels-last copies).

Ours
    ``compile(onnx, distributed_config={"mesh_shape": [1], "algo": "replicate"},
    optimization_config={"target": "cuda", "arch": ARCH, "precision": PRECISION},
    input_shapes={"pixel_values": [B, 3, 224, 224]})`` per batch, ``shardflow.runtime.load`` and
    ``run`` (the CUDA graph replayed from the second run), the logits copied out as ``models.py``
    does; ``ours_view_ms`` leaves them in the program's buffer. With ``--nchw`` (on by default) the
    program compiled with ``channels_last: False`` is timed too (``nchw_ms``: its convs with a
    window on the portable wmma template, as before decision 57): decisions 57-61's gain.

Model dtype
    By default the float32 module is exported and ``--precision float16`` rounds the convs'
    operands (activations between them stay float32: passes/precision.py). ``--model-dtype
    float16`` exports the module cast to float16, as torch runs it: every activation half on both
    sides (like for like); the reference is then the float32 module with the rounded weights.

torch
    The same module under ``torch.no_grad()`` in the precision's type (float16 by default) and
    ``torch.channels_last`` (the layout cuDNN's fastest convolutions take; the input converted once,
    outside the timing), eager and ``torch.compile(mode=MODE)`` for each of ``--compile-modes``.

Timing and accuracy
    As ``models.py``: host wall-clock of a call and a device synchronization, median of
    ``--repeat`` after warm-up; our logits and torch.compile's against torch eager in float32 with
    TF32 off (reported, not asserted).

``--dry-run`` exports and compiles (nvcc, no GPU) and runs nothing; ``--tiny`` is a two-stage
ResNet (or RegNet, groups of 16 channels) on 64x64 images (script tests); ``--target cpu`` runs
this script on a machine without a GPU (our cpu target and torch on the CPU; the figures mean
nothing).
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (Budget, TorchDevice, compile_ours, dump_json, ensure_shardflow, err_text,  # noqa: E402
                    failed, fmt, kernel_kinds, table, time_calls, time_compiled, time_eager, torch_diff,
                    torch_ratios)

BATCHES = (1, 8)
COMPILE_MODES = ("default", "reduce-overhead")
NEED_S = {"compile": 90, "ours": 10, "eager": 10, "torch_compile": 120}


MODELS = ("resnet50", "regnet")


def build(tiny: bool, model: str = "resnet50"):
    """ResNet-50 or RegNetY-4GF (``model``; or a two-stage one, ``tiny``) with random weights,
    returning its logits, and the image size."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    small = {"depths": [1, 1], "hidden_sizes": [32, 64], "embedding_size": 16, "num_labels": 10} if tiny else {}
    if model == "regnet":
        net = T.RegNetForImageClassification(T.RegNetConfig(**small, **({"groups_width": 16} if tiny else {})))
    else:
        net = T.ResNetForImageClassification(T.ResNetConfig(**small))
    net = net.eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, pixel_values):
            return self.net(pixel_values=pixel_values).logits

    return Logits().eval(), (64 if tiny else 224)


def export(path: str, tiny: bool, dtype: str = "float32", name: str = "resnet50") -> tuple:
    """The module and its ONNX export (TorchScript exporter, opset 17, dynamic batch) at ``path``;
    ``dtype`` float16: the module cast to it is exported, and the float32 module returned has the
    rounded weights."""
    import torch

    model, size = build(tiny, name)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype)).float()  # (the weights rounded, the reference's)
    t0 = time.perf_counter()
    exported = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
    with torch.no_grad():
        torch.onnx.export(exported, (torch.zeros(1, 3, size, size, dtype=getattr(torch, dtype)),), path,
                          input_names=["pixel_values"],
                          output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"pixel_values": {0: "batch"}, "logits": {0: "batch"}})
    info = {"size": size, "n_params": sum(p.numel() for p in model.parameters()),
            "export_s": time.perf_counter() - t0, "size_bytes": os.path.getsize(path), "path": path}
    return model, info


def bench(args, work: str, budget: Budget, log=print, save=lambda: None) -> dict:
    """Export the model, compile it per batch and (unless dry-run) time it against torch."""
    ensure_shardflow()
    name = args.model
    res: dict = {"model": name, "precision": args.precision, "model_dtype": args.model_dtype, "arch": args.arch,
                 "target": args.target, "tiny": args.tiny, "dry_run": args.dry_run, "batches": {}}
    try:
        model, info = export(os.path.join(work, f"{name}.onnx"), args.tiny, args.model_dtype, name)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"export failed: {err_text(exc)}"
        log(res["error"])
        return res
    size = info["size"]
    res.update(n_params=info["n_params"], export_s=info["export_s"], image=size)
    log(f"{name}: {info['n_params'] / 1e6:.1f}M parameters, exported in {info['export_s']:.1f} s")
    compiled = {}
    for b in args.batches:
        rec = res["batches"].setdefault(str(b), {"batch": b})
        if not budget.allows(NEED_S["compile"] * (0.2 if args.tiny else 1)):
            rec["ours_skipped"] = "time budget"
            continue
        for layout in ("channels_last", "nchw") if args.nchw else ("channels_last",):
            out_dir = os.path.join(work, f"{name}-b{b}-{layout}")
            pre = "" if layout == "channels_last" else "nchw_"
            try:
                r = compile_ours(info["path"], b, out_dir, target=args.target, arch=args.arch, precision=args.precision,
                                 search_space=None, input_shapes={"pixel_values": [b, 3, size, size]},
                                 channels_last=layout == "channels_last")
                rec.update({pre + k: v for k, v in r.items()}, **{pre + "kinds": kernel_kinds(out_dir)})
                compiled[(b, layout)] = out_dir
                log(f"{name} batch {b} ({layout}): compiled in {r['compile_s']:.1f} s, kernels {rec[pre + 'kinds']}")
            except Exception as exc:  # noqa: BLE001
                failed(rec, pre + "compile_error", exc, f"{name} batch {b} ({layout}): compile", log, args.verbose)
    save()
    if args.dry_run:
        return res

    dev = TorchDevice(args.target)
    torch = dev.torch
    rng = np.random.default_rng(0)
    images = {b: rng.standard_normal((b, 3, size, size)).astype(np.float32) for b in args.batches}
    model = model.to(dev.tdev)
    dev.set_tf32(False)
    with torch.no_grad():
        refs = {b: model(torch.from_numpy(images[b]).to(dev.tdev)).float() for b in args.batches}
    half = args.model_dtype if args.model_dtype != "float32" else args.precision
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(half, torch.float32)
    fmt_kw = {"memory_format": torch.channels_last} if args.target == "cuda" else {}
    model = model.to(dtype=tdtype, **fmt_kw)
    inputs = {b: torch.from_numpy(images[b]).to(dev.tdev).to(dtype=tdtype, **fmt_kw) for b in args.batches}

    for (b, layout), out_dir in compiled.items():  # ours
        rec = res["batches"][str(b)]
        pre = "ours_" if layout == "channels_last" else "nchw_"
        try:
            from shardflow.runtime import load

            prog = load(out_dir)
            feeds = {"pixel_values": dev.ours_input(images[b].astype(args.model_dtype))}
            first = prog.run(feeds)["logits"]  # eager run
            d = torch_diff(dev.as_torch(first).float(), refs[b])
            rec.update(d if layout == "channels_last" else {"nchw_rel_diff": d["rel_diff"]})
            prog.run(feeds)  # captures the CUDA graph
            t = time_calls(lambda: prog.run(feeds), dev.sync, args.repeat, args.warmup)
            rec.update({pre + "ms": t["ms"], pre + "min_ms": t["min_ms"], "repeat": t["repeat"]})
            t = time_calls(lambda: prog.run(feeds, copy_outputs=False), dev.sync, args.repeat, args.warmup)
            rec.update({pre + "view_ms": t["ms"], pre + "view_min_ms": t["min_ms"]})
            log(f"{name} batch {b} ({layout}): ours {rec[pre + 'ms']:.3f} ms ({rec[pre + 'view_ms']:.3f} ms with "
                f"the logits left in place), rel diff vs torch fp32 {fmt(d['rel_diff'], '.1e')}")
            prog.close()
        except Exception as exc:  # noqa: BLE001
            failed(rec, pre + "error", exc, f"{name} batch {b} ({layout}): ours", log, args.verbose)
        gc.collect()
        save()
    for b in args.batches:  # torch eager
        time_eager(res["batches"][str(b)], lambda: model(inputs[b]), dev, args.repeat, args.warmup, log,
                   f"{name} batch {b}", args.verbose)
    for mode in args.compile_modes:  # torch.compile
        torch._dynamo.reset()
        cm = torch.compile(model, dynamic=False, **({} if mode == "default" else {"mode": mode}))
        step = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else (lambda: None)

        def call(b):
            step()
            return cm(inputs[b])

        for b in args.batches:
            tc = res["batches"][str(b)].setdefault("torch_compile", {})
            if not budget.allows(NEED_S["torch_compile"] * (0.2 if args.tiny else 1)):
                tc[mode] = {"skipped": "time budget"}
                continue
            time_compiled(tc, mode, lambda: call(b), refs[b], dev, args.repeat, args.warmup, log,
                          f"{name} batch {b}", args.verbose)
            save()
        cm = None
        torch._dynamo.reset()
    for rec in res["batches"].values():
        torch_ratios(rec)
    recs = list(res["batches"].values())
    worst = [r.get("vs_torch_compile") for r in recs]
    res[f"{name}_vs_torch_compile"] = max(worst) if worst and None not in worst else None
    return res


def format_table(res: dict) -> str:
    rows = []
    for key, r in res.get("batches", {}).items():
        tc = r.get("torch_compile", {})
        note = r.get("compile_error") or r.get("ours_error") or r.get("ours_skipped") or ""
        rows.append([key, fmt(r.get("ours_ms")), fmt(r.get("ours_view_ms")), fmt(r.get("nchw_ms")),
                     fmt(r.get("torch_eager_ms")),
                     fmt(tc.get("default", {}).get("ms")), fmt(tc.get("reduce-overhead", {}).get("ms")),
                     fmt(r.get("vs_torch_compile")), fmt(r.get("vs_torch_eager")), fmt(r.get("rel_diff"), ".1e"),
                     note[:60]])
    return table(["batch", "ours ms", "ours view ms", "nchw ms", "eager ms", "compile ms", "reduce-oh ms",
                  "ours/compile", "ours/eager", "rel diff", "note"], rows, align="<>>>>>>>>><")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="resnet50",
                    help="resnet50, or regnet (RegNetY-4GF: grouped convs, squeeze-and-excite)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--precision", default="float16", help="optimization_config['precision'] (and torch's type)")
    ap.add_argument("--model-dtype", choices=("float32", "float16"), default="float32",
                    help="export the module in this type (float16: activations half on both sides)")
    ap.add_argument("--compile-modes", default=",".join(COMPILE_MODES), help="comma-separated ('' for none)")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--tiny", action="store_true", help="a two-stage model on 64x64 images (script tests)")
    ap.add_argument("--no-nchw", dest="nchw", action="store_false",
                    help="do not also compile and time the program with channels_last=False")
    ap.add_argument("--target", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: self-test of this script without a GPU (numbers meaningless)")
    ap.add_argument("--dry-run", action="store_true", help="export and compile only (no GPU needed)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip steps that no longer fit in this time")
    ap.add_argument("--work-dir", help="where artifacts go (default: a temporary folder, removed)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.compile_modes = [m for m in args.compile_modes.split(",") if m]
    ensure_shardflow()
    with tempfile.TemporaryDirectory(prefix="sf-cnn-", dir=args.work_dir) as work:
        res = bench(args, work, Budget(args.budget_s))
    res["table"] = format_table(res)
    print(res["table"])
    key = f"{args.model}_vs_torch_compile"
    if key in res:
        print(f"{key} = {fmt(res[key])}")
    dump_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
