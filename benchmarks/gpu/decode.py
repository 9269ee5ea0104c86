"""Decoding steps end to end: a Llama-style model taking one token per sequence over a static KV
cache, Shardflow (one cuda rank, the cache kept on the device) vs torch eager and torch.compile.

    python benchmarks/gpu/decode.py [--batches 1,8] [--max-len 4096] [--model-dtype float16]
                                    [--compile-modes default,reduce-overhead] [--dry-run] [--json OUT.json]

The model (``decode_model.py``): Llama 3.2 1B's attention and MLP shapes (width 2048, 32 heads of
64 over 8 KV heads, SwiGLU 8192) at 8 layers, vocabulary 32000, about 0.6B parameters, random
weights, exported in ``--model-dtype`` (float16: the cache in float16, as a serving stack keeps it)
with the TorchScript exporter on the machine that runs the benchmark. Its cache holds
``--max-len`` positions per layer (``[batch, 8, max_len, 64]`` keys and values); a step writes the
new token's row at ``pos`` and attends over the rows ``<= pos``.

Ours
    ``compile(onnx, optimization_config={"target": "cuda", ...}, input_shapes=..., state={present:
    past})``: the presents are written over the pasts on the device (only the new row: rfcs/0003),
    so a step's inputs are ``input_ids`` and ``pos`` alone, and its output the logits. Per step,
    ``run({"input_ids", "pos"})`` (cupy arrays) replays the program's CUDA graph and returns the
    logits in a fresh cupy array. The kernels a step runs: the products on the GEMV template
    (fewer than 16 rows: rfcs/0005 decision 30), the attention fused with its grouped heads packed
    in a block's rows and split-KV (decisions 36, 39), visiting the cache rows ``<= pos`` only (the
    mask's bound, decision 41).

torch
    The same module (the same weights in the same type) with the cache updated in place
    (``index_copy_`` into buffers) and ``scaled_dot_product_attention(..., enable_gqa=True)`` over
    the rows ``<= pos`` (``DecodeLM.step``); eager, then ``torch.compile(step, dynamic=False)`` in
    each of ``--compile-modes`` (``reduce-overhead`` replays CUDA graphs, as ours does); the
    torch.compile figure is the faster mode's.

Timing (as ``models.py``)
    Host wall-clock of one step followed by a device synchronization, after warm-up steps; median
    over ``--repeat`` steps, every step at position ``--pos`` (default ``max_len // 2``: half the
    cache seen). torch's SDPA reads every row of the cache under the mask; ours reads the rows up
    to ``pos``, so the position moves our attention's share of a step, not torch's: ours is also
    timed at ``--positions`` (``ours_ms_by_pos``; default an eighth of the cache and all of it).

Accuracy (reported, not asserted)
    Before timing, ``--check-steps`` steps from an empty cache (positions 0, 1, ...; greedy tokens
    of the reference) on both sides: our logits against the float32 module's (the strict
    reference, TF32 off), ``rel_diff = max|diff| / max|ref|`` over those steps.

``--dry-run`` exports and compiles (nvcc, no GPU); ``--target cpu`` is a self-test of this script
without a GPU (our cpu target and torch on the CPU; the figures mean nothing).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (Budget, TorchDevice, dump_json, ensure_shardflow, err_text, failed, fmt, table,  # noqa: E402
                    time_calls, torch_diff, torch_ratios)

BATCHES = (1, 8)
COMPILE_MODES = ("default", "reduce-overhead")


def compile_ours(onnx_path: str, info: dict, model, batch: int, out_dir: str, args) -> dict:
    """Compile the step for ``batch`` sequences with the cache kept as state; the record."""
    import decode_model as dm

    from shardflow.compiler import compile as sf_compile

    c = model.c
    ins, _ = dm.io_names(c["layers"])
    cache = (batch, c["kv_heads"], model.max_len, c["hidden"] // c["heads"])
    shapes = {"input_ids": (batch, 1), "pos": (1,), **{n: cache for n in ins[2:]}}
    opt = {"target": args.target, "precision": args.precision}
    if args.target == "cuda":
        opt["arch"] = args.arch
    if args.pdl:
        opt["pdl"] = True
    t0 = time.perf_counter()
    res = sf_compile(onnx_path, distributed_config={"mesh_shape": [1], "algo": "replicate"}, optimization_config=opt,
                     out_dir=out_dir, input_shapes=shapes, state=info["state"])
    rec = {"compile_s": time.perf_counter() - t0, "kernels": res.ranks[0]["kernels"] if res.ranks else None}
    try:
        with open(os.path.join(out_dir, "rank0", "program.json")) as f:
            prog = json.load(f)
        kinds: dict[str, int] = {}
        for s in prog["steps"]:
            if s.get("kind") == "kernel":
                k = str(s.get("launch", {}).get("kind") or args.target)
                kinds[k] = kinds.get(k, 0) + 1
        rec["kernel_kinds"] = kinds
        rec["state_in_place"] = sum(bool(s.get("in_place")) for s in prog.get("state", []))
    except (OSError, KeyError, ValueError):
        rec["kernel_kinds"] = None
    return rec


def _reference_steps(model, batch: int, steps: int, dev, seed: int = 0):
    """The float32 module's logits over ``steps`` steps from an empty cache (TF32 off), with the
    greedy token ids each step was fed: ``([ids], [logits])``."""
    torch = dev.torch
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, model.c["vocab"], (batch, 1)).astype("int64")).to(dev.tdev)
    model.reset_cache(batch)
    fed, outs = [], []
    with torch.no_grad():
        for p in range(steps):
            y = model.step(ids, torch.tensor([p], device=dev.tdev)).float()
            fed.append(ids)
            outs.append(y)
            ids = y[:, -1].argmax(-1)[:, None]
    return fed, outs


def bench(args, work: str, budget: Budget, log=print) -> dict:
    import decode_model as dm

    ensure_shardflow()
    import torch

    section: dict = {"batches": {}, "max_len": args.max_len, "model_dtype": args.model_dtype, "arch": args.arch,
                     "target": args.target, "precision": args.precision, "pdl": args.pdl,
                     "compile_modes": list(args.compile_modes), "repeat": args.repeat, "tiny": args.tiny,
                     "torch": torch.__version__}
    model = dm.build(args.max_len, tiny=args.tiny)
    section["config"] = dict(model.c)
    path = os.path.join(work, "decode.onnx")
    try:
        info = dm.export(model, path, max(args.batches), dtype=args.model_dtype)
    except Exception as exc:  # noqa: BLE001
        section["error"] = f"export failed: {err_text(exc)}"
        log(section["error"])
        return section
    section.update(n_params=info["n_params"], export_s=info["export_s"], onnx_bytes=os.path.getsize(path))
    log(f"decode model: {info['n_params'] / 1e6:.1f}M parameters, exported in {info['export_s']:.1f} s")
    compiled = {}
    for b in args.batches:
        rec = section["batches"].setdefault(str(b), {"batch": b})
        out_dir = os.path.join(work, f"b{b}")
        try:
            rec.update(compile_ours(path, info, model, b, out_dir, args))
            compiled[b] = out_dir
            log(f"batch {b}: compiled in {rec['compile_s']:.1f} s, kernels {rec['kernel_kinds']}, "
                f"{rec.get('state_in_place')} of {2 * model.c['layers']} caches in place")
        except Exception as exc:  # noqa: BLE001
            failed(rec, "compile_error", exc, f"batch {b}: compile", log, args.verbose)
    if args.dry_run:
        return section

    dev = TorchDevice(args.target)
    dev.set_tf32(False)
    model = model.to(dev.tdev)
    refs = {b: _reference_steps(model, b, args.check_steps, dev) for b in args.batches}
    half = model.to({"float16": torch.float16, "bfloat16": torch.bfloat16}.get(args.model_dtype, torch.float32))
    pos = args.pos if args.pos is not None else args.max_len // 2
    positions = [int(p) for p in args.positions.split(",") if p] if args.positions is not None else \
        [args.max_len // 8, args.max_len - 1]
    section["positions"] = positions
    rng = np.random.default_rng(1)
    ids_np = {b: rng.integers(0, model.c["vocab"], (b, 1)).astype("int64") for b in args.batches}
    pos_np = np.array([pos], np.int64)

    for b, out_dir in compiled.items():  # ours
        rec = section["batches"][str(b)]
        try:
            from shardflow.runtime import load

            prog = load(out_dir)
            diffs = []
            for ids, want in zip(*refs[b]):  # from an empty cache (zeros at load)
                p = len(diffs)
                got = prog.run({"input_ids": dev.ours_input(ids.cpu().numpy()),
                                "pos": dev.ours_input(np.array([p], np.int64))})["logits"]
                diffs.append(torch_diff(dev.as_torch(got, args.model_dtype), want))
            rec.update(rel_diff=max(d["rel_diff"] or 0.0 for d in diffs), finite=all(d["finite"] for d in diffs))
            feeds = {"input_ids": dev.ours_input(ids_np[b]), "pos": dev.ours_input(pos_np)}
            t = time_calls(lambda: prog.run(feeds), dev.sync, args.repeat, args.warmup)
            rec.update(ours_ms=t["ms"], ours_min_ms=t["min_ms"])
            log(f"batch {b}: ours {t['ms']:.3f} ms per step (rel diff over {len(diffs)} steps "
                f"{fmt(rec['rel_diff'], '.1e')})")
            by_pos = rec.setdefault("ours_ms_by_pos", {})
            for p in positions:  # (our attention reads the rows <= p)
                at = dict(feeds, pos=dev.ours_input(np.array([p], np.int64)))
                by_pos[str(p)] = time_calls(lambda: prog.run(at), dev.sync, args.repeat, args.warmup)["ms"]
            log(f"batch {b}: ours by position " + ", ".join(f"{p}: {ms:.3f} ms" for p, ms in by_pos.items()))
            prog.close()
        except Exception as exc:  # noqa: BLE001
            failed(rec, "ours_error", exc, f"batch {b}: ours", log, args.verbose)
        gc.collect()

    ids_t = {b: torch.from_numpy(ids_np[b]).to(dev.tdev) for b in args.batches}
    pos_t = torch.tensor([pos], device=dev.tdev)
    for b in args.batches:  # torch eager
        rec = section["batches"][str(b)]
        try:
            half.reset_cache(b)
            with torch.no_grad():
                t = time_calls(lambda: half.step(ids_t[b], pos_t), dev.sync, args.repeat, args.warmup)
            rec.update(torch_eager_ms=t["ms"], torch_eager_min_ms=t["min_ms"])
            log(f"batch {b}: torch eager {t['ms']:.3f} ms per step")
        except Exception as exc:  # noqa: BLE001
            failed(rec, "torch_eager_error", exc, f"batch {b}: torch eager", log, args.verbose)
    for mode in args.compile_modes:  # torch.compile
        for b in args.batches:
            rec = section["batches"][str(b)]
            tc = rec.setdefault("torch_compile", {})
            if not budget.allows(60):
                tc[mode] = {"skipped": "time budget"}
                continue
            torch._dynamo.reset()
            half.reset_cache(b)
            kw = {} if mode == "default" else {"mode": mode}
            step = torch.compile(half.step, dynamic=False, **kw)
            mark = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else (lambda: None)

            def call():
                mark()
                return step(ids_t[b], pos_t)
            try:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    call()
                    dev.sync()
                    compile_s = time.perf_counter() - t0
                    t = time_calls(call, dev.sync, args.repeat, args.warmup)
                tc[mode] = {"ms": t["ms"], "min_ms": t["min_ms"], "compile_s": compile_s}
                log(f"batch {b}: torch.compile({mode}) {t['ms']:.3f} ms per step (compiled in {compile_s:.0f} s)")
            except Exception as exc:  # noqa: BLE001
                failed(tc.setdefault(mode, {}), "error", exc, f"batch {b}: torch.compile({mode})", log, args.verbose)
            step = None
            gc.collect()
    for rec in section["batches"].values():
        torch_ratios(rec)
    return section


def format_table(section: dict) -> str:
    rows = []
    for key, r in section.get("batches", {}).items():
        tc = r.get("torch_compile", {})
        note = r.get("compile_error") or r.get("ours_error") or ""
        rows.append([key, fmt(r.get("ours_ms")), fmt(r.get("torch_eager_ms")), fmt(tc.get("default", {}).get("ms")),
                     fmt(tc.get("reduce-overhead", {}).get("ms")), fmt(r.get("vs_torch_compile")),
                     fmt(r.get("vs_torch_eager")), fmt(r.get("rel_diff"), ".1e"), fmt(r.get("compile_s"), ".1f"),
                     note[:60]])
    return table(["batch", "ours ms", "eager ms", "compile ms", "reduce-oh ms", "ours/compile", "ours/eager",
                  "rel diff", "our compile s", "note"], rows, align="<>>>>>>>><")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--max-len", type=int, default=4096, help="cache positions per layer")
    ap.add_argument("--pos", type=int, default=None, help="the timed steps' position (default max_len // 2)")
    ap.add_argument("--positions", default=None,
                    help="more positions to time ours at, comma-separated (default max_len // 8 and max_len - 1)")
    ap.add_argument("--model-dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    ap.add_argument("--precision", default="float32", help="optimization_config['precision']")
    ap.add_argument("--pdl", action="store_true", help="optimization_config['pdl'] (rfcs/0005 decision 29)")
    ap.add_argument("--compile-modes", default=",".join(COMPILE_MODES))
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--target", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: self-test of this script without a GPU (numbers meaningless)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer narrow model (script tests)")
    ap.add_argument("--dry-run", action="store_true", help="export and compile only (no GPU needed)")
    ap.add_argument("--work-dir", help="keep the model and programs here (default: a temporary folder, removed)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip torch.compile runs that no longer fit")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.compile_modes = [m for m in args.compile_modes.split(",") if m]
    if args.work_dir:  # (kept: the programs in WORK/b<batch>, the model in WORK/decode.onnx)
        os.makedirs(args.work_dir, exist_ok=True)
        section = bench(args, args.work_dir, Budget(args.budget_s))
    else:
        with tempfile.TemporaryDirectory(prefix="sf-decode-") as work:
            section = bench(args, work, Budget(args.budget_s))
    section["table"] = format_table(section)
    print(section["table"])
    dump_json(args.json, section)
    return section


if __name__ == "__main__":
    main()
