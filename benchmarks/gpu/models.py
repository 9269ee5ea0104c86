"""End to end: GPT-2 small and a Llama-style model, Shardflow (one cuda rank) vs torch eager and
torch.compile, at batch 1x128 and 8x128.

    python benchmarks/gpu/models.py [--models gpt2_small,llama] [--batches 1,8] [--precision float32]
                                    [--compile-modes default,reduce-overhead] [--dry-run] [--json OUT.json]

Models (see ``export_models.py``): GPT-2 small (``GPT2Config()`` defaults, 124M parameters) and a
Llama-style causal LM (width 1024, 8 layers, 16 heads, SwiGLU 2816, vocabulary 32000; 168M), random
weights, input ``input_ids`` int64 ``[B, 128]``, output the logits. Each is built and exported to
ONNX (TorchScript exporter, opset 17, dynamic batch) on the machine that runs the benchmark, so
torch is timed on exactly the weights we compile; nothing large needs to travel. ``--models
llama7b`` (not in the default set): Llama-2-7B's shapes, 6.7 G parameters, the ONNX file written by
``tests/models/synth_llama.py`` and torch's ``LlamaForCausalLM`` loaded with its weights
(``device_session.sh llama7b``).

Ours
    ``shardflow.compiler.compile(onnx, distributed_config={"mesh_shape": [1], "algo": "replicate"},
    optimization_config={"target": "cuda", "arch": ARCH, "precision": PRECISION}, out_dir=...,
    input_shapes={"input_ids": [B, 128]})`` per batch size, then ``shardflow.runtime.load(out_dir)``.
    ``run({"input_ids": cupy array})`` copies the input into the program's arena, replays the
    program's CUDA graph (captured on the second run; the first runs eagerly), returns the logits in
    a fresh cupy array and synchronizes its stream (since session 8 the last kernel writes them
    straight into that array, rfcs/0003; before, they were copied out of the program's buffer, 206
    MB of float32 logits for GPT-2 at 8x128). Timed a second way with ``run(...,
    copy_outputs=False)`` (``ours_view_ms``): the logits stay in the program's buffer, valid until
    the next run, which is what ``torch.compile(mode="reduce-overhead")`` returns too (its outputs
    live in the CUDA graph's memory pool); ``vs_torch_compile_static`` compares those two, like for
    like.

torch
    The same module on the GPU with transformers' ``"sdpa"`` attention (the default a torch user
    gets; the ONNX was exported with ``"eager"`` attention, same function) and no attention mask,
    under ``torch.no_grad()``. ``torch.compile(model, mode=MODE, dynamic=False)`` for each of
    ``--compile-modes`` (default: ``default`` and ``reduce-overhead``, the latter replays CUDA graphs
    like our runtime does); the torch.compile figure is the faster of the modes for each batch
    (``torch_compile_mode`` in the JSON says which). A mode that fails to compile is recorded with
    its error and left out.

Precision
    ``--precision`` is passed to ``optimization_config`` (``float32``: our GEMMs use 3xTF32,
    fp32-accurate; ``tf32``: one TF32 product). torch's ``allow_tf32`` (matmul and cuDNN) follows
    ``--torch-tf32`` (``auto``: on exactly when our compiled programs contain TF32 GEMM kernels,
    kinds ``gemm-tf32`` and ``gemm-wgmma-tf32``, i.e. with ``--precision tf32``), so both sides use
    the same GEMM arithmetic.
    ``float16``/``bfloat16`` cast the torch model to that dtype.

Model dtype
    ``--model-dtype bfloat16`` (or ``float16``) exports the module cast to that type, as a user with a
    bfloat16 checkpoint would: we compile the bfloat16 ONNX itself (every op in float32, outputs
    rounded to bfloat16; ``--precision`` stays ``float32``) and torch runs the same bfloat16 module.
    The strict reference is the float32 module with the rounded weights.

Timing (same for every contender)
    Host wall-clock of one call followed by a device synchronization, after warm-up calls (our
    first two runs, torch.compile's compiling call, and ``--warmup`` more each); the median over
    ``--repeat`` calls is the latency (``*_min_ms`` is the fastest call). This is end-to-end latency
    as a caller sees it, launch overheads included. Those timings run one contender after the
    other, minutes apart (torch.compile's figure moved by 12% between two runs of session 33, ours
    by 1%); so, with ``--interleave R`` (default 10), once a torch.compile mode is timed, our
    program (kept loaded) and that mode run in alternating rounds, ``--per-round`` timed calls each
    after an untimed one, the order rotating (``interleaved`` in a batch's record,
    ``vs_torch_compile_interleaved`` against the mode faster there).

Accuracy (reported, not asserted)
    Our logits against torch eager in float32 with TF32 off (the strict reference): ``max_abs_diff``
    and ``rel_diff = max_abs_diff / max|ref|``; the torch.compile outputs against the same
    reference, too.

``--dry-run`` exports and compiles (nvcc, no GPU) every model and batch and runs nothing;
``--target cpu`` is a self-test of this script on a machine without a GPU (our cpu target and torch
on the CPU; the figures mean nothing).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (Budget, TorchDevice, compile_ours, dump_json, ensure_shardflow, err_text,  # noqa: E402
                    failed, fmt, interleave_with, load_by_path, table, time_calls, time_compiled, time_eager,
                    torch_diff, torch_ratios)

MODELS = ("gpt2_small", "llama")  # the default set; also export_models.SYNTH's ("llama7b")
BATCHES = (1, 8)
COMPILE_MODES = ("default", "reduce-overhead")
# rough seconds each step needs on an H100 machine (16 cores); a step is skipped when the run's
# time budget no longer holds it (recorded as skipped)
NEED_S = {"compile": 60, "ours": 10, "eager": 10, "torch_compile": 90}


def _export_models():
    """This folder's ``export_models.py`` (by its path: ``tests/models`` has one too)."""
    return load_by_path("sf_gpu_export_models", "benchmarks/gpu/export_models.py")


# ----------------------------------------------------------------------------------------------
# one model
# ----------------------------------------------------------------------------------------------

def prepare(name: str, work: str, export_dir: str | None, tiny: bool, log, dtype: str = "float32") -> tuple:
    """The torch module (CPU, eager attention) and its ONNX path/info: exported into ``work``, or
    reused from ``export_dir`` when it holds ``<name>.onnx``, ``.json`` and ``.state.pt`` (the
    synthetic models: ``.onnx.data`` instead, the weights torch reads back)."""
    import torch

    em = _export_models()

    synth = name in em.SYNTH
    if export_dir:
        paths = [os.path.join(export_dir, f"{name}{ext}") for ext in (".onnx", ".json", ".state.pt")]
        if synth:
            paths[2] = paths[0] + ".data"
        if all(os.path.exists(p) for p in paths):
            with open(paths[1]) as f:
                info = json.load(f)
            if bool(info.get("tiny")) == tiny and info.get("dtype", "float32") == dtype:
                if synth:
                    wrapper, _ = em.synth_module(paths[0], em.synth_preset(name, tiny))
                else:
                    wrapper, _ = em.build(name, "eager", tiny=tiny)
                    wrapper.load_state_dict(torch.load(paths[2], map_location="cpu"))
                info["path"] = paths[0]
                info["reused_export"] = True
                log(f"{name}: reusing {paths[0]}")
                return wrapper, info
    out = export_dir or work
    path = os.path.join(out, f"{name}.onnx")
    wrapper, info = em.export(name, path, tiny=tiny, dtype=dtype)
    if export_dir:
        if not synth:
            torch.save(wrapper.state_dict(), os.path.join(export_dir, f"{name}.state.pt"))
        with open(os.path.join(export_dir, f"{name}.json"), "w") as f:
            json.dump(info, f, indent=1)
    log(f"{name}: {info['n_params'] / 1e6:.1f}M parameters, exported in {info['export_s']:.1f} s "
        f"({info['size_bytes'] / 1e6:.0f} MB)")
    return wrapper, info


def bench_model(name: str, args, work: str, budget: Budget, log, save) -> dict:
    """Export, compile and (unless dry-run) time one model at every batch size."""
    ensure_shardflow()
    res: dict = {"batches": {}}
    try:
        wrapper, info = prepare(name, work, args.export_dir, args.tiny, log, args.model_dtype)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"export failed: {err_text(exc)}"
        log(f"{name}: {res['error']}")
        return res
    res.update(config=info["config"], n_params=info["n_params"], export_s=info["export_s"],
               onnx_bytes=info["size_bytes"], reused_export=bool(info.get("reused_export")))
    vocab = info["config"]["vocab_size"]
    compiled = {}
    for b in args.batches:
        key = f"{b}x128"
        rec = res["batches"].setdefault(key, {"batch": b, "seq": 128})
        if not budget.allows(NEED_S["compile"] * (0.2 if args.tiny else 1)):
            rec["ours_skipped"] = "time budget"
            continue
        out_dir = os.path.join(work, f"{name}-b{b}")
        try:
            rec.update(compile_ours(info["path"], b, out_dir, target=args.target, arch=args.arch,
                                    precision=args.precision, search_space=args.search_space,
                                    gemm_tiles=json.loads(args.gemm_tiles) if args.gemm_tiles else None,
                                    pdl=getattr(args, "pdl", False),
                                    wgmma_fp32=getattr(args, "wgmma_fp32", False)))
            compiled[b] = out_dir
            log(f"{name} {key}: compiled in {rec['compile_s']:.1f} s ({rec['kernels']} kernels, GEMM kinds "
                f"{rec['gemm_kinds']})")
        except Exception as exc:  # noqa: BLE001 - report and go on
            failed(rec, "compile_error", exc, f"{name} {key}: compile", log, args.verbose)
    save()
    if args.dry_run:
        return res

    dev = TorchDevice(args.target)
    torch = dev.torch
    kinds = {k for b in compiled for k in (res["batches"][f"{b}x128"].get("gemm_kinds") or [])}
    tf32 = {"on": True, "off": False}.get(args.torch_tf32, args.precision == "tf32"
                                          or bool(kinds & {"gemm-tf32", "gemm-wgmma-tf32"}))
    res["torch_tf32"] = tf32
    half = args.model_dtype if args.model_dtype != "float32" else args.precision
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(half, torch.float32)
    rng = np.random.default_rng(0)
    ids_np = {b: rng.integers(0, vocab, (b, 128)).astype("int64") for b in args.batches}
    ids_t = {b: torch.from_numpy(ids_np[b]).to(dev.tdev) for b in args.batches}

    # strict fp32 references (TF32 off), eager attention
    em = _export_models()

    model = wrapper.to(dev.tdev)
    dev.set_tf32(False)
    refs = {}
    with torch.no_grad():
        for b in args.batches:
            refs[b] = model(ids_t[b]).float()
    res["attention"] = em.set_attention(model, "sdpa")
    model = model.to(tdtype)
    dev.set_tf32(tf32)

    # ours (the programs kept, with --interleave, for the rounds against torch.compile below)
    progs, feeds_of = {}, {}
    for b, out_dir in compiled.items():
        rec = res["batches"][f"{b}x128"]
        if not budget.allows(NEED_S["ours"]):
            rec["ours_skipped"] = "time budget"
            continue
        try:
            from shardflow.runtime import load

            prog = load(out_dir)
            feeds = {"input_ids": dev.ours_input(ids_np[b])}
            first = prog.run(feeds)["logits"]  # eager run
            rec.update(torch_diff(dev.as_torch(first, args.model_dtype), refs[b]))
            del first
            prog.run(feeds)  # captures the CUDA graph
            t = time_calls(lambda: prog.run(feeds), dev.sync, args.repeat, args.warmup)
            rec.update(ours_ms=t["ms"], ours_min_ms=t["min_ms"], repeat=t["repeat"])
            log(f"{name} {b}x128: ours {t['ms']:.3f} ms  (max |diff| vs torch fp32 {rec['max_abs_diff']:.2e}, "
                f"rel {fmt(rec['rel_diff'], '.1e')})")
            t = time_calls(lambda: prog.run(feeds, copy_outputs=False), dev.sync, args.repeat, args.warmup)
            rec.update(ours_view_ms=t["ms"], ours_view_min_ms=t["min_ms"])
            log(f"{name} {b}x128: ours {t['ms']:.3f} ms with the outputs left in the program's buffers")
            if args.interleave > 0:
                progs[b], feeds_of[b] = prog, feeds
            else:
                prog.close()
        except Exception as exc:  # noqa: BLE001
            failed(rec, "ours_error", exc, f"{name} {b}x128: ours", log, args.verbose)
        gc.collect()
        save()

    # torch eager
    for b in args.batches:
        rec = res["batches"][f"{b}x128"]
        if not budget.allows(NEED_S["eager"]):
            rec["torch_eager_skipped"] = "time budget"
            continue
        time_eager(rec, lambda: model(ids_t[b]), dev, args.repeat, args.warmup, log, f"{name} {b}x128",
                   args.verbose)
    save()

    # torch.compile
    for mode in args.compile_modes:
        torch._dynamo.reset()
        kw = {} if mode == "default" else {"mode": mode}
        cm = torch.compile(model, dynamic=False, **kw)
        step = (lambda: torch.compiler.cudagraph_mark_step_begin()) if mode == "reduce-overhead" else (lambda: None)

        def call(b):
            step()
            return cm(ids_t[b])

        for b in args.batches:
            rec = res["batches"][f"{b}x128"]
            tc = rec.setdefault("torch_compile", {})
            if not budget.allows(NEED_S["torch_compile"] * (0.2 if args.tiny else 1)):
                tc[mode] = {"skipped": "time budget"}
                continue
            time_compiled(tc, mode, lambda: call(b), refs[b], dev, args.repeat, args.warmup, log, f"{name} {b}x128",
                          args.verbose)
            if b in progs and "ms" in tc.get(mode, {}):
                try:
                    interleave_with(rec, mode, lambda: progs[b].run(feeds_of[b]), lambda: call(b), dev.sync,
                                    args.interleave, args.per_round, log, f"{name} {b}x128")
                except Exception as exc:  # noqa: BLE001 - report and go on
                    failed(rec.setdefault("interleaved", {}).setdefault(mode, {}), "error", exc,
                           f"{name} {b}x128: interleaved", log, args.verbose)
            save()
        cm = None
        torch._dynamo.reset()
        gc.collect()

    for prog in progs.values():
        prog.close()
    for rec in res["batches"].values():
        torch_ratios(rec)
    model = refs = None
    gc.collect()
    if args.target == "cuda":
        torch.cuda.empty_cache()
    return res


def headline(res: dict, name: str) -> dict:
    """``<name>_vs_torch_compile``: our latency / torch.compile latency, worst (largest) over the
    batches; ``<name>_vs_torch_compile_static_outputs``: the same with the outputs left in place on
    both sides (ours ``copy_outputs=False``, torch's reduce-overhead mode); None unless every batch
    has both figures."""
    recs = list(res.get("batches", {}).values())

    def worst(key):
        r = [x.get(key) for x in recs]
        return max(r) if r and None not in r else None
    return {f"{name}_vs_torch_compile": worst("vs_torch_compile"),
            f"{name}_vs_torch_compile_static_outputs": worst("vs_torch_compile_static"),
            f"{name}_vs_torch_compile_interleaved": worst("vs_torch_compile_interleaved"),
            f"{name}_vs_torch_eager": worst("vs_torch_eager")}


def format_table(models: dict) -> str:
    rows = []
    for name, res in models.items():
        if "error" in res:
            rows.append([name, "-", res["error"][:60]] + [""] * 9)
            continue
        for key, r in res.get("batches", {}).items():
            tc = r.get("torch_compile", {})
            note = r.get("compile_error") or r.get("ours_error") or r.get("ours_skipped") or ""
            rows.append([name, key, fmt(r.get("ours_ms")), fmt(r.get("ours_view_ms")), fmt(r.get("torch_eager_ms")),
                         fmt(tc.get("default", {}).get("ms")), fmt(tc.get("reduce-overhead", {}).get("ms")),
                         fmt(r.get("vs_torch_compile")), fmt(r.get("vs_torch_compile_static")),
                         fmt(r.get("vs_torch_compile_interleaved")), fmt(r.get("vs_torch_eager")),
                         fmt(r.get("max_abs_diff"), ".1e"), fmt(r.get("compile_s"), ".1f"), note[:60]])
    return table(["model", "batch", "ours ms", "ours view ms", "eager ms", "compile ms", "reduce-oh ms",
                  "ours/compile", "view/reduce-oh", "interleaved", "ours/eager", "max|diff|", "our compile s",
                  "note"], rows, align="<<>>>>>>>>>>><")


# ----------------------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The model options (also used by run_all.py)."""
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--precision", default="float32", help="optimization_config['precision']")
    ap.add_argument("--model-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="export the module cast to this type (the ONNX model itself in it)")
    ap.add_argument("--torch-tf32", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--compile-modes", default=",".join(COMPILE_MODES),
                    help="torch.compile modes, comma-separated ('' for none)")
    ap.add_argument("--repeat", type=int, default=50, help="timed calls per contender (median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--interleave", type=int, default=10,
                    help="rounds of our calls and each torch.compile mode's in turn (0: none)")
    ap.add_argument("--per-round", type=int, default=5, help="timed calls per contender in a round")
    ap.add_argument("--search-space", type=int, default=None, help="optimization_config['search_space']")
    ap.add_argument("--gemm-tiles", default="", help="optimization_config['gemm_tiles'] as JSON, e.g. "
                    "'{\"*lm_head*\": \"pp64x256\"}'")
    ap.add_argument("--pdl", action="store_true",
                    help="optimization_config['pdl']: programmatic dependent launch (sm_90+, rfcs/0005 decision 29)")
    ap.add_argument("--wgmma-fp32", action="store_true",
                    help="optimization_config['wgmma_fp32']: float32 products (tf32, 3xTF32) on the Hopper wgmma "
                         "GEMMs (rfcs/0005 decisions 33-34)")
    ap.add_argument("--export-dir", help="reuse/keep exported models here (<name>.onnx/.json/.state.pt)")
    ap.add_argument("--tiny", action="store_true", help="2-layer narrow models (script tests)")
    ap.add_argument("--target", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: self-test of this script without a GPU (numbers meaningless)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")


def normalize_args(args) -> None:
    if isinstance(args.models, str):
        args.models = [m for m in args.models.split(",") if m]
        known = list(MODELS) + list(_export_models().SYNTH)
        bad = [m for m in args.models if m not in known]
        if bad:
            raise SystemExit(f"unknown model(s) {bad}; choose from {known}")
    if isinstance(args.batches, str):
        args.batches = [int(b) for b in args.batches.split(",") if b]
    if isinstance(args.compile_modes, str):
        args.compile_modes = [m for m in args.compile_modes.split(",") if m]


def bench(args, work: str, budget: Budget, log=print, save=lambda: None, section: dict | None = None) -> dict:
    """Run every model; fills and returns the ``models`` JSON section (``save()`` is called after
    each step so a caller can write partial results)."""
    normalize_args(args)
    section = section if section is not None else {}
    section.update(dry_run=args.dry_run, precision=args.precision, model_dtype=args.model_dtype, arch=args.arch,
                   target=args.target, pdl=getattr(args, "pdl", False),
                   wgmma_fp32=getattr(args, "wgmma_fp32", False),
                   compile_modes=list(args.compile_modes), repeat=args.repeat, warmup=args.warmup,
                   tiny=args.tiny, models={})
    try:
        import torch
        import transformers

        section.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError as exc:
        section["error"] = err_text(exc)
        return section
    for name in args.models:
        section["models"][name] = {}
        section["models"][name] = bench_model(name, args, work, budget, log, save)
        if not args.dry_run:
            section.update(headline(section["models"][name], name))
        save()
    section["table"] = format_table(section["models"])
    return section


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dry-run", action="store_true", help="export and compile only (no GPU needed)")
    ap.add_argument("--work-dir", help="where artifacts go (default: a temporary folder, removed)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip steps that no longer fit in this time")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    ensure_shardflow()
    with tempfile.TemporaryDirectory(prefix="sf-models-", dir=args.work_dir) as work:
        section = bench(args, work, Budget(args.budget_s))
    print(section["table"])
    for name in section.get("models", {}):
        for k in ("vs_torch_compile", "vs_torch_compile_static_outputs", "vs_torch_compile_interleaved"):
            if f"{name}_{k}" in section:
                print(f"{name}_{k} = {fmt(section[f'{name}_{k}'])}")
    dump_json(args.json, section)
    return section


if __name__ == "__main__":
    main()
