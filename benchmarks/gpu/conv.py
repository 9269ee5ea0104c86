"""Convolutions: our kernel vs torch's (cuDNN), Stable Diffusion 1.5 UNet's convs at batch 2 (and
grouped convs of ResNeXt-50 and RegNetY-4GF).

    python benchmarks/gpu/conv.py [--cases all|1x1|3x3|up] [--shapes proj64,conv64,...] [--dtypes float16,bfloat16]
                                  [--reps 20] [--dry-run] [--json OUT.json]

What is compared
    ``Conv(x, w, bias)`` on ``[2, C, H, W]`` images (Stable Diffusion 1.5 at 512x512 pixels: a
    64x64 latent, two images under classifier-free guidance), in the UNet's shapes: the 1x1 convs
    of its transformer blocks (``proj_in``/``proj_out``, C -> C) and its resnets' shortcuts (C ->
    2C), and its 3x3 convs (padding 1); and the grouped 3x3 convs of ResNeXt-50 (32x4d: 32 groups of
    16 and 32 channels, ``rnx*``) and RegNetY-4GF (groups of 64 channels, ``regy*``) at 224x224
    pixels, each a product per group (rfcs/0005 decision 62); and 2x2 transposed convs at stride 2
    (``--cases up``: SAM's mask decoder upscaling, a UNet's up-convolution), each one product
    (decision 65), against ``conv_transpose2d``. Ours is the ``Conv`` (``ConvTranspose``) op compiled
    alone for ``--arch``
    (float16/bfloat16 operands and output, float32 accumulation), as a compiled program runs it on
    sm_90: a 1x1 conv over a batch whose ``H*W`` is a multiple of 8 takes the Hopper wgmma template
    with the images as the product's batch (rfcs/0005 decision 55); a 3x3 conv two kernels
    (decision 57, ``passes/channels_last.py``): the image's channels-last copy, then the conv on
    the wgmma template gathering its windows from the copy, the weight stored ``[OC, 3, 3, C]`` at
    compile time. ``ours`` times both kernels back to back; the copy alone (``copy``) and, for
    reference, the conv as it was before decision 57 (the portable wmma kernel on the NCHW image,
    ``nchw``) are timed too. Beside them, in the same run: ``torch.nn.functional.conv2d`` on the
    same operands in the same type, NCHW as ours, and channels-last (``torch.channels_last``, the
    layout cuDNN's fastest kernels prefer; its layout conversion not timed).

    ``TFLOP/s`` counts ``2 N OC H W (C / groups) kh kw`` (a transposed conv's ``H W`` its input's).

Timing and correctness
    As ``gemm.py``: CUDA graphs of back-to-back launches rotating over enough input sets that each
    launch reads its operands from device memory (three times the L2 cache, at most 16 sets),
    median over ``--reps`` replays. Before timing, our output is poisoned with NaN and compared with
    torch's conv in float32 on the same rounded operands: ``err = max|y - ref| / max|ref|`` must be
    within the type's tolerance (``TOLERANCE``).

``--dry-run`` generates and compiles every kernel (nvcc, no GPU needed) and prints its launch.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (build_alone, build_cases, dump_json, ensure_shardflow, first_run_error, fmt,  # noqa: E402
                    kernel_bench_args, our_launcher, print_built, run_cases, table)
from gemm import _time  # noqa: E402

#: (name, C, OC, H = W, window[, groups[, transposed]]) of Stable Diffusion 1.5's UNet at a 64x64
#: latent, then grouped convs of ResNeXt-50 32x4d and RegNetY-4GF at 224x224 pixels, then 2x2
#: transposed convs at stride 2 (H = W the input's): SAM's mask decoder, a UNet's decoder
SHAPES = (("proj64", 320, 320, 64, 1), ("proj32", 640, 640, 32, 1), ("proj16", 1280, 1280, 16, 1),
          ("short32", 320, 640, 32, 1), ("short16", 640, 1280, 16, 1),
          ("conv64", 320, 320, 64, 3), ("conv32", 640, 640, 32, 3), ("conv16", 1280, 1280, 16, 3),
          ("conv8", 1280, 1280, 8, 3),
          ("rnx28", 512, 512, 28, 3, 32), ("rnx14", 1024, 1024, 14, 3, 32),
          ("regy28", 192, 192, 28, 3, 3), ("regy14", 512, 512, 14, 3, 8),
          ("samup64", 256, 64, 64, 2, 1, True), ("samup128", 64, 32, 128, 2, 1, True),
          ("unetup32", 512, 256, 32, 2, 1, True))
BATCH = 2
DTYPES = ("float16", "bfloat16")
#: largest error (of the output's largest value) each type may have against float32 on the same operands
TOLERANCE = {"float16": 1e-2, "bfloat16": 2e-2}
MAX_SETS = 16


@dataclass(frozen=True)
class Case:
    name: str
    C: int
    OC: int
    HW: int
    k: int
    dtype: str
    groups: int = 1
    transposed: bool = False

    @property
    def id(self) -> str:
        return f"{self.name}_{self.dtype}"

    @property
    def flops(self) -> float:
        return 2.0 * BATCH * self.OC * self.HW * self.HW * self.C // self.groups * self.k * self.k


def make_cases(which: str = "all", dtypes=DTYPES, shapes=None) -> list[Case]:
    """The cases of kind ``which`` (``all``, ``1x1``, ``3x3``, ``up``: the transposed convs), of
    ``shapes`` (names; None: all)."""
    names = [s[0] for s in SHAPES]
    unknown = sorted((set(shapes or ()) - set(names)) | (set(dtypes) - set(DTYPES)))
    if which not in ("all", "1x1", "3x3", "up") or unknown:
        raise SystemExit(f"unknown case kind, shape(s) or type(s) {[which, *unknown]}; --cases: all, 1x1, 3x3 or up; "
                         f"--shapes: of {names}; --dtypes: of {DTYPES}")
    keep = {"all": (1, 2, 3), "1x1": (1,), "3x3": (3,), "up": (2,)}[which]
    return [Case(*s[:5], dt, *s[5:]) for s in SHAPES if s[4] in keep and (not shapes or s[0] in shapes)
            for dt in dtypes]


def _build_one(case: Case, work: str, arch: str):
    """``(cubin, launch, seconds)`` of the conv's kernel, and for a 3x3 conv ``(cubin, launches)`` of
    the program's two kernels (``copy``, ``conv``) with ``(cubin, launch)`` of the NCHW one (a
    transposed conv: its kernel, NCHW in and out)."""
    from shardflow.compiler.codegen.cuda import build_cuda_library
    from shardflow.compiler.codegen.fusion import fuse
    from shardflow.compiler.ir import Tensor
    from shardflow.compiler.ops.conv import Conv, ConvTranspose
    from shardflow.compiler.ops.transform import Transpose

    if case.transposed:
        ins = [Tensor("x", (BATCH, case.C, case.HW, case.HW), case.dtype),
               Tensor("w", (case.C, case.OC, case.k, case.k), case.dtype), Tensor("b", (case.OC,), case.dtype)]
        return build_alone(ConvTranspose(ins, name=case.id, strides=(case.k, case.k),
                                         output_shape=(case.HW * case.k, case.HW * case.k)), work, arch)
    ins = [Tensor("x", (BATCH, case.C, case.HW, case.HW), case.dtype),
           Tensor("w", (case.OC, case.C // case.groups, case.k, case.k), case.dtype),
           Tensor("b", (case.OC,), case.dtype)]
    nchw = build_alone(Conv(ins, name=case.id, pads=[case.k // 2] * 4, group=case.groups), work, arch)
    if case.k == 1:
        return nchw
    # the program's form (passes/channels_last.py): the image copied channels-last, read back
    # through a Transpose fused into the conv, as is the weight stored [OC, kh, kw, C]
    copy = Transpose([ins[0]], name="copy", perm=(0, 2, 3, 1), channels_last=True)
    w_last = Tensor("w_last", (case.OC, case.k, case.k, case.C // case.groups), case.dtype)
    views = [Transpose([t], name=f"{t.name}.nchw", perm=(0, 3, 1, 2)) for t in (copy.outputs[0], w_last)]
    conv = Conv([views[0].outputs[0], views[1].outputs[0], ins[2]], name="conv", pads=[case.k // 2] * 4,
                group=case.groups)
    path = os.path.join(work, f"{case.id}.last.cubin")
    t0 = time.perf_counter()
    launches = build_cuda_library([copy] + fuse([*views, conv]), path, arch=arch)
    return path, launches["conv"], nchw[2] + time.perf_counter() - t0, launches, nchw[:2]


def run_case(case: Case, cubin: str, launch, reps: int, l2_bytes: int, torch, cp, launches=None,
             nchw=None) -> dict:
    import torch.nn.functional as F

    dev = torch.device("cuda")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[case.dtype]
    xs, ws = (BATCH, case.C, case.HW, case.HW), (case.OC, case.C // case.groups, case.k, case.k)
    ys = (BATCH, case.OC, case.HW, case.HW)
    if case.transposed:
        ws, ys = (case.C, case.OC, case.k, case.k), (BATCH, case.OC, case.HW * case.k, case.HW * case.k)
    set_bytes = 2 * (math.prod(xs) * (2 if launches else 1) + math.prod(ws) + math.prod(ys))
    nsets = max(1, min(MAX_SETS, math.ceil(3 * l2_bytes / set_bytes)))
    n = max(20, nsets)
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case.id.encode()))
    scale = (case.C // case.groups * (1 if case.transposed else case.k * case.k)) ** -0.5
    sets = []
    for _ in range(nsets):
        x = torch.randn(xs, device=dev, generator=gen).to(tdt)
        w = (torch.randn(ws, device=dev, generator=gen) * scale).to(tdt)
        sets.append({"x": x, "w": w, "b": torch.randn((case.OC,), device=dev, generator=gen).to(tdt),
                     "y": torch.empty(ys, device=dev, dtype=tdt)})
        if launches:  # (the copy's output, and the weight as the program stores it)
            sets[-1].update({"copy:0": torch.empty((BATCH, case.HW, case.HW, case.C), device=dev, dtype=tdt),
                             "w_last": w.permute(0, 2, 3, 1).contiguous()})
    last = [[s["x"].contiguous(memory_format=torch.channels_last),
             s["w"].contiguous(memory_format=torch.channels_last), s["b"]] for s in sets]
    theirs_out = [torch.empty(ys, device=dev, dtype=tdt) for _ in range(nsets)]

    def launcher(path, lau, stream=None):  # (its arguments by name: the output is y)
        names = [a if k < lau.num_inputs else "y" for k, a in enumerate(lau.args)]
        return our_launcher(path, lau, [[s[a] for a in names] for s in sets], torch, cp, stream)

    stream, cstream, conv = launcher(cubin, launch)
    ours, extra = conv, {}
    if launches:
        _, _, copy = launcher(cubin, launches["copy"], stream)
        _, _, old = launcher(*nchw, stream)

        def ours(i):
            copy(i)
            conv(i)
        extra = {"copy": copy, "conv": conv, "nchw": old}
    pad, groups = case.k // 2, case.groups

    def torch_conv(x, w, b):  # (the same op in torch: cuDNN)
        if case.transposed:
            return F.conv_transpose2d(x, w, b, stride=case.k)
        return F.conv2d(x, w, b, padding=pad, groups=groups)

    def theirs(i):
        s = sets[i % nsets]
        theirs_out[i % nsets].copy_(torch_conv(s["x"], s["w"], s["b"]))

    def theirs_last(i):
        torch_conv(*last[i % nsets])

    s0 = sets[0]
    torch.backends.cudnn.allow_tf32 = False
    err = first_run_error(ours, cstream, s0["y"], lambda: torch_conv(s0["x"].float(), s0["w"].float(),
                                                                     s0["b"].float()), torch)
    rec = asdict(case)
    rec.update(id=case.id, batch=BATCH, kind=launch.kind, grid=list(launch.grid), block=list(launch.block),
               shared_mem=int(launch.shared_mem), input_sets=nsets, err=err,
               ok=err is not None and err <= TOLERANCE[case.dtype])
    if launches:
        rec.update(nchw_kind=nchw[1].kind, nchw_err=first_run_error(
            extra["nchw"], cstream, s0["y"], lambda: torch_conv(s0["x"].float(), s0["w"].float(), s0["b"].float()),
            torch))
    t_ours = _time(ours, stream, reps, torch, True, n)
    t_theirs = _time(theirs, stream, reps, torch, True, n)
    t_last = _time(theirs_last, stream, reps, torch, True, n)
    rec.update(ours_ms=t_ours, torch_ms=t_theirs, torch_channels_last_ms=t_last, ours_tflops=case.flops / t_ours / 1e9,
               torch_tflops=case.flops / t_theirs / 1e9, torch_channels_last_tflops=case.flops / t_last / 1e9,
               ours_vs_torch=t_theirs / t_ours, ours_vs_torch_channels_last=t_last / t_ours)
    for k, f in extra.items():  # the copy, the conv alone, the NCHW kernel of before
        rec[f"{k}_ms"] = _time(f, stream, reps, torch, True, n)
    return rec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="all", help="all, 1x1, 3x3 or up (the transposed convs)")
    ap.add_argument("--shapes", default="", help=f"comma-separated, of {[s[0] for s in SHAPES]} (default: all)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {DTYPES}")
    kernel_bench_args(ap)
    args = ap.parse_args(argv)
    ensure_shardflow()
    cases = make_cases(args.cases, [d for d in args.dtypes.split(",") if d], [s for s in args.shapes.split(",") if s])
    section: dict = {"arch": args.arch, "batch": BATCH, "tolerance": TOLERANCE}
    with tempfile.TemporaryDirectory(prefix="sf-conv-") as work:
        built = build_cases(_build_one, cases, work, args.arch, args.jobs)
        if args.dry_run:
            print_built(cases, built)
            section["kinds"] = {c.id: built[c.id][1].kind for c in cases}
            return section
        records, device = run_cases(run_case, cases, built, args.reps, lambda rec: (
            f"  {rec['id']:<18} {rec['kind']:<15} ours {rec['ours_ms'] * 1e3:8.1f} us {rec['ours_tflops']:6.1f} "
            f"TFLOP/s  torch {rec['torch_ms'] * 1e3:8.1f} us  channels-last {rec['torch_channels_last_ms'] * 1e3:8.1f}"
            f" us  err {fmt(rec['err'], '.1e')}{'' if rec['ok'] else '  WRONG'}"
            + (f"  (copy {rec['copy_ms'] * 1e3:.1f} us, conv {rec['conv_ms'] * 1e3:.1f} us; before: {rec['nchw_kind']} "
               f"{rec['nchw_ms'] * 1e3:.1f} us, err {fmt(rec['nchw_err'], '.1e')})" if "copy_ms" in rec else "")))
    section.update(device=device, records=records, all_correct=all(r["ok"] for r in records))
    print(table(["case", "kind", "ours us", "ours TFLOP/s", "torch us", "torch/ours", "torch CL us", "CL/ours", "err"],
                [[r["id"], r["kind"], fmt(r["ours_ms"] * 1e3, ".1f"), fmt(r["ours_tflops"], ".1f"),
                  fmt(r["torch_ms"] * 1e3, ".1f"), fmt(r["ours_vs_torch"], ".2f"),
                  fmt(r["torch_channels_last_ms"] * 1e3, ".1f"), fmt(r["ours_vs_torch_channels_last"], ".2f"),
                  fmt(r["err"], ".1e") if r["ok"] else "WRONG"] for r in records], align="<<>>>>>>>"))
    dump_json(args.json, section)
    return section


if __name__ == "__main__":
    main()
