"""CPU latency of one rank vs onnxruntime, per model, in the same run.

Compiles each model for one rank (target cpu), runs it with ``shardflow.runtime.load`` and runs
onnxruntime on the same inputs with the same thread count, and prints median latencies and the
ratio (ours / onnxruntime; lower is better), with each program's weights, arena and kernels' scratch
buffers after the timed runs (``RankProgram.scratch_bytes``). Models: the committed test models, and with
``--sized`` also GPT-2-small-, BERT-base- and Llama-sized exports (124M, 110M, 170M parameters, 128
tokens) and a ResNet-50-sized one
(transformers' ``ResNetConfig`` defaults, random weights, one 3x224x224 image) and MobileNetV2-,
EfficientNet-B0- and ConvNeXt-tiny-sized ones (depthwise convs; the configs' defaults, B0's widths and
depths, one image) and a RegNetY-4GF (grouped convs, squeeze-excitation), exported with
torch.onnx.export at opset 17 (needs torch + transformers; slow; each export runs in a child process, so that
the timing process does not load torch); with ``--light`` the 9 CNNs the
onnx package ships for its backend tests (``onnx/backend/test/data/light``: AlexNet, DenseNet-121,
Inception v1/v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512; full-size graphs with
synthetic weights, one 224x224 image). ``--only`` picks models by name.
``--compare-off KEY`` also times each model compiled with ``optimization_config[KEY] = False`` in the same
run, interleaved with the default build (e.g. ``prepack``: GEMM weights packed on every call; ``blocked``:
the plain layout between convs); ``--compare-prepack`` is ``--compare-off prepack``.
``--bf16`` also times a bfloat16 copy of each transformer and CNN (the committed ResNet; with ``--sized`` the
ResNet-50, MobileNetV2 and ConvNeXt-tiny) (tests/models/to_half.py: weights, casts and graph types in
bfloat16, as an export of the module in bfloat16 stores them), ``<model>_bf16``, next to onnxruntime on the
float32 model with the same rounded weights (onnxruntime has no bfloat16 MatMul on the CPU); its max |diff|
is the bfloat16 roundings'. ``--f16`` likewise in float16 (``<model>_f16``: its products' weights as float16
panels). Both are computed in float32, each op's output rounded to the half type, the bfloat16 products and
convs on the bfloat16 GEMM.
``--precision-bf16`` also times each transformer compiled with ``optimization_config["precision"] =
"bfloat16"`` (its products' operands rounded to bfloat16, sums in float32: the AMX or AVX-512 BF16 GEMM
where the CPU has one), ``<model>_pbf16``, next to onnxruntime on the float32 model (with ``--sized``, the
ResNet-50 too: ``resnet50_224_pbf16``, its convs on the bfloat16 GEMM).
``--int8`` also times two copies of each transformer (the committed ones, and the sized ones with
``--sized``): quantized by onnxruntime's ``quantize_dynamic`` (int8 weights, ``DynamicQuantizeLinear``
and ``MatMulInteger`` per projection), named ``<model>_int8``, and by ``quantize_static`` in the QDQ
format (calibrated on the benchmark's inputs), ``<model>_qdq``; their max |diff| is larger than the
float models' (an activation that rounds the other way in one engine moves the next layer's sums). With
``--sized`` it also times the ResNet-50, MobileNetV2 and ConvNeXt-tiny quantized by ``quantize_static``
(``<model>_224_qdq``: their convs of 64 or more products per output run the integer conv).
``--int4`` also times a copy of each transformer whose MatMul weights ``MatMulNBitsQuantizer`` made 4-bit
(blocks of 32, zero points; ``<model>_int4``), the weights kept packed here (``cpu_library/lowbit.h``), next
to onnxruntime on the same file at ``accuracy_level`` 0 (float32 activations, as ours); ``--int4-gather``
also quantizes the token embedding's ``Gather`` (``GatherBlockQuantized`` on a uint4 table; ``<model>_int4g``).
Each line gives the rank's weight bytes too (``weights``: the artifact's ``weights.bin``).
``--seq N`` exports the sized transformers for N tokens instead of 128 (``--seq 1``: a decoding step's
products, without its KV cache).

    python benchmarks/cpu_latency.py [--threads 2] [--repeat 50] [--sized] [--light] [--only resnet]
                                     [--compare-off blocked] [--int8] [--bf16] [--f16] [--precision-bf16] [--int4 [--int4-gather]] [--seq 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "tests", "models")
COMMITTED = ["gpt2_ts17", "bert_dynamo18", "llama_ts17", "resnet_ts17", "vit_dynamo18", "t5_encoder_ts17"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _medians_ms(fns: list, repeat: int, block: int = 1) -> list[float]:
    """Median latency of each of ``fns`` over ``repeat`` timed calls, taken round-robin in blocks
    of ``block`` calls of each, so that the machine's drifts in speed (neighbours on this VM come
    and go within seconds) fall on all of them alike. With ``block > 1`` each block starts after
    50 ms idle and one untimed call: the previous engine's threads keep spinning after its last
    run (onnxruntime's pool: a count of spins, which goes on for 100 ms and more while another
    engine's threads share the cores), and timed against them our MobileNetV2 took 18.9 ms instead
    of 10.7 (benchmarks/results/...-s22.txt)."""
    for _ in range(3):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range((repeat + block - 1) // block):
        for fn, ts in zip(fns, times):
            if block > 1:
                time.sleep(0.05)
                fn()
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(ts) for ts in times]


def _onnxruntime(model, threads: int):
    """An onnxruntime CPU session on ``model`` (a path or bytes) with ``threads`` intra-op threads."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def bench(name: str, path: str, feeds: dict, threads: int, repeat: int, work: str,
          compare: str | None = None, opt: dict | None = None) -> None:
    from shardflow.compiler import compile
    from shardflow.runtime import load

    progs, weights = [], []
    for on in (True, False) if compare else (True,):
        out = os.path.join(work, f"{name}-{on}")
        res = compile(path, distributed_config={"mesh_shape": [1]},
                      optimization_config={"target": "cpu", **(opt or {}), **({} if on else {compare: False})},
                      out_dir=out)
        progs.append(load(out, rank=0))
        weights.append(res.ranks[0]["weights_bytes"])
    sess = _onnxruntime(path, threads)
    *ours, ref = _medians_ms([lambda p=p: p.run(feeds) for p in progs] + [lambda: sess.run(None, feeds)], repeat,
                             block=5)
    err = max(float(np.max(np.abs(progs[0].run(feeds)[o.name] - r)))
              for o, r in zip(sess.get_outputs(), sess.run(None, feeds)))
    extra = f"   without {compare} {ours[1]:9.3f} ms (ratio {ours[1] / ref:5.2f})" if compare else ""
    scratch = progs[0].scratch_bytes  # (after the timed runs: what the kernels' buffers hold)
    print(f"{name:<22} shardflow {ours[0]:9.3f} ms   onnxruntime {ref:9.3f} ms   ratio {ours[0] / ref:5.2f}   "
          f"max |diff| {err:.1e}   weights {weights[0] / 1e6:7.1f} MB   arena {progs[0].arena.nbytes / 1e6:7.1f} MB   "
          f"scratch {scratch / 1e6:6.1f} MB{extra}", flush=True)


def bench_half(name: str, path: str, feeds: dict, threads: int, repeat: int, work: str,
               half: str = "bfloat16") -> None:
    """A ``half`` (bfloat16 or float16) copy of ``path`` compiled for one cpu rank, timed next to onnxruntime
    on the float32 model with the same rounded weights and inputs."""
    import onnx

    from shardflow.compiler import compile
    from shardflow.runtime import load

    sys.path.insert(0, MODELS)
    from to_half import half_feeds, to_half

    low, ref_model = to_half(onnx.load(path), half)
    low_feeds, ref_feeds = half_feeds(feeds, half)
    tag = "bf16" if half == "bfloat16" else "f16"
    out = os.path.join(work, f"{name}-{tag}")
    compile(low, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
    prog = load(out, rank=0)
    weights = prog.program["weights_bytes"]
    sess = _onnxruntime(ref_model.SerializeToString(), threads)
    ours, ref = _medians_ms([lambda: prog.run(low_feeds), lambda: sess.run(None, ref_feeds)], repeat, block=5)
    got = prog.run(low_feeds)
    err = max(float(np.max(np.abs(got[o.name].astype(np.float32) - r)))
              for o, r in zip(sess.get_outputs(), sess.run(None, ref_feeds)))
    print(f"{name + '_' + tag:<22} shardflow {ours:9.3f} ms   onnxruntime {ref:9.3f} ms   ratio {ours / ref:5.2f}   "
          f"max |diff| {err:.1e}   weights {weights / 1e6:7.1f} MB   (onnxruntime: float32, same weights)", flush=True)


def int8_copy(path: str) -> str:
    """``path`` quantized by onnxruntime's ``quantize_dynamic`` (signed int8 weights), next to it."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = path[:-len(".onnx")] + "_int8.onnx"
    quantize_dynamic(path, out, weight_type=QuantType.QInt8)
    return out


def int4_copy(path: str, gather: bool = False) -> str:
    """``path`` with its MatMul weights (and, with ``gather``, its ``Gather`` tables along their rows)
    quantized to 4 bits by onnxruntime's ``MatMulNBitsQuantizer`` (blocks of 32, a scale and a zero
    point each; ``accuracy_level`` 0), next to it."""
    import logging

    import onnx
    import onnx.version_converter
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model, extra = onnx.load(path), {}
    if gather:  # (its uint4 tables need opset 21, which the quantizer sets without converting the nodes)
        model = onnx.version_converter.convert_version(model, 21)
        extra = {"op_types_to_quantize": ("MatMul", "Gather"), "quant_axes": (("MatMul", 0), ("Gather", 1))}
    q = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=False, accuracy_level=0, **extra)
    q.process()
    out = path[:-len(".onnx")] + ("_int4g.onnx" if gather else "_int4.onnx")
    q.model.save_model_to_file(out, use_external_data_format=False)
    return out


def qdq_copy(path: str, feeds: dict) -> str:
    """``path`` quantized by onnxruntime's ``quantize_static`` in the QDQ format (uint8 activations
    calibrated on ``feeds``, int8 weights per tensor), next to it."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.left = [feeds]

        def get_next(self):
            return self.left.pop() if self.left else None

    out = path[:-len(".onnx")] + "_qdq.onnx"
    quantize_static(path, out, Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    return out


def export_resnet50(path: str) -> dict:
    """Export a randomly initialised ResNet-50 (transformers' ResNetConfig defaults: bottleneck
    blocks, depths 3-4-6-3, widths 256-2048) fed one 3x224x224 image, output ``last_hidden_state``
    ([1, 2048, 7, 7]). Returns the feeds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from export_models import _PixelHidden, export_module
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    model = _PixelHidden(ResNetModel(ResNetConfig()).eval())
    feeds = {"pixel_values": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    export_module(model, feeds, ["pixel_values"], ["last_hidden_state"], path, dynamo=False, opset=17)
    return feeds


def export_vision_model(kind: str, path: str) -> dict:
    """Export a randomly initialised vision model built on depthwise convs, fed one 3x224x224 image,
    output ``last_hidden_state``: ``mobilenet_v2`` (transformers' MobileNetV2Config defaults: 3x3
    depthwise convs with ReLU6, 3.4M parameters), ``efficientnet_b0`` (EfficientNetConfig at B0's widths
    and depths: depthwise convs, SiLU written ``x * sigmoid(x)``, squeeze-excitation; 4M parameters),
    ``convnext_tiny`` (ConvNextConfig defaults: 7x7 depthwise convs, LayerNorm, GELU, 28M parameters) or
    ``regnety_4gf`` (RegNetConfig defaults, RegNetY-4GF: grouped 3x3 convs of 64 channels a group,
    squeeze-excitation, 20M parameters). Returns the feeds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from export_models import _PixelHidden, export_module

    torch.manual_seed(0)
    if kind in ("mobilenet_v2", "efficientnet_b0", "regnety_4gf"):
        if kind == "mobilenet_v2":
            from transformers import MobileNetV2Config, MobileNetV2Model
            model = MobileNetV2Model(MobileNetV2Config(), add_pooling_layer=False)
        elif kind == "regnety_4gf":
            from transformers import RegNetConfig, RegNetModel
            model = RegNetModel(RegNetConfig())
        else:
            from transformers import EfficientNetConfig, EfficientNetModel
            model = EfficientNetModel(EfficientNetConfig(width_coefficient=1.0, depth_coefficient=1.0, image_size=224,
                                                         hidden_dim=1280))
        for mod in model.modules():  # (the configs' init, normal(0.02) for the convs (and EfficientNet's
            # BatchNorms' scales), shrinks the activations to subnormals (EfficientNet by block 3, where both
            # engines run 10-20x slower; MobileNetV2's output near 1e-25 before session 89): He's init and unit
            # scales keep them near 1)
            if isinstance(mod, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(mod.weight, mode="fan_in", nonlinearity="relu")
            elif isinstance(mod, torch.nn.BatchNorm2d):
                torch.nn.init.ones_(mod.weight)
    else:
        from transformers import ConvNextConfig, ConvNextModel
        model = ConvNextModel(ConvNextConfig())
    feeds = {"pixel_values": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    export_module(_PixelHidden(model.eval()), feeds, ["pixel_values"], ["last_hidden_state"], path, dynamo=False,
                  opset=17)
    return feeds


def export_text_model(kind: str, path: str, seq: int = 128) -> dict:
    """Export a randomly initialised text encoder fed one sequence of ``seq`` tokens, output
    ``last_hidden_state``. ``bert``: BERT-base (transformers' BertConfig defaults: 12 layers, 768
    wide, 12 heads, 110M parameters). ``llama``: a Llama of 1024 wide, 8 layers, 16 heads (4 KV
    heads), MLP 2816, vocab 32000 (~170M parameters; a 7B model does not fit this machine's
    benchmark time). Returns the feeds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from export_models import _HiddenState, export_module

    torch.manual_seed(0)
    if kind == "bert":
        from transformers import BertConfig, BertModel
        model = BertModel(BertConfig(attn_implementation="eager"), add_pooling_layer=False).eval()
        vocab = 30522
    else:
        from transformers import LlamaConfig, LlamaModel
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=32000, use_cache=False, attn_implementation="eager")
        model = LlamaModel(cfg).eval()
        vocab = 32000
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, vocab, (1, seq)).astype(np.int64),
             "attention_mask": np.ones((1, seq), np.int64)}
    export_module(_HiddenState(model), feeds, list(feeds), ["last_hidden_state"], path, dynamo=False, opset=17)
    return feeds


def in_child(fn: str, *args, **kwargs):
    """``fn(*args, **kwargs)`` run in a child process, its result returned; ``fn`` names a function of this
    module or ``module:function`` of a module in ``benchmarks/`` or ``tests/models/`` (``export_models:
    export_gpt2``, ``cpu_yolo:export``). Torch stays out of the timing process: with torch loaded, the
    kernels' parallel regions ran on torch's libgomp, under which one kernel ran 6.6 -> 0.71 ms (rfcs/0002
    "Loops unswitched"), and a deployed rank does not load torch. The child's own output goes to stderr."""
    import pickle
    import subprocess

    with tempfile.TemporaryDirectory() as d:
        req, res = os.path.join(d, "request.pkl"), os.path.join(d, "result.pkl")
        with open(req, "wb") as f:
            pickle.dump((fn, args, kwargs), f)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", req, res], check=True,
                       stdout=sys.stderr)
        with open(res, "rb") as f:
            return pickle.load(f)


def _child(req: str, res: str) -> None:
    """:func:`in_child`'s other side."""
    import importlib
    import pickle

    with open(req, "rb") as f:
        fn, args, kwargs = pickle.load(f)
    sys.path.insert(0, MODELS)  # (export_models)
    module, _, name = fn.rpartition(":")
    call = getattr(importlib.import_module(module), name) if module else globals()[name]
    with open(res, "wb") as f:
        pickle.dump(call(*args, **kwargs), f)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--sized", action="store_true", help="also export GPT-2-small-, BERT-base-, Llama- and ResNet-50-sized models (slow)")
    ap.add_argument("--light", action="store_true", help="also the onnx package's light CNN models")
    ap.add_argument("--only", default="", help="only the models whose name contains this text")
    ap.add_argument("--compare-off", default=None, metavar="KEY",
                    help="also time each model compiled with optimization_config[KEY] = False")
    ap.add_argument("--compare-prepack", action="store_true", help="the same as --compare-off prepack")
    ap.add_argument("--bf16", action="store_true",
                    help="also time a bfloat16 copy of each model (next to onnxruntime in float32)")
    ap.add_argument("--f16", action="store_true",
                    help="also time a float16 copy of each model (next to onnxruntime in float32)")
    ap.add_argument("--precision-bf16", action="store_true",
                    help="also time each transformer compiled with precision bfloat16 (next to onnxruntime in float32)")
    ap.add_argument("--int8", action="store_true",
                    help="also time the transformers quantized by onnxruntime's quantize_dynamic")
    ap.add_argument("--int4", action="store_true",
                    help="also time the transformers with 4-bit weights (onnxruntime's MatMulNBitsQuantizer)")
    ap.add_argument("--int4-gather", action="store_true",
                    help="with --int4, also a copy whose token embedding is 4-bit too (GatherBlockQuantized)")
    ap.add_argument("--seq", type=int, default=128, help="tokens of the sized transformers' input")
    args = ap.parse_args(argv)
    compare = "prepack" if args.compare_prepack else args.compare_off

    def bench_halves(name, path, feeds, repeat):
        """The model's bfloat16 and float16 copies (``--bf16``, ``--f16``)."""
        if args.bf16:
            bench_half(name, path, feeds, args.threads, repeat, work)
        if args.f16:
            bench_half(name, path, feeds, args.threads, repeat, work, "float16")

    def bench_text(name, path, feeds, repeat):
        bench(name, path, feeds, args.threads, repeat, work, compare)
        bench_halves(name, path, feeds, repeat)
        if args.precision_bf16:
            bench(f"{name}_pbf16", path, feeds, args.threads, repeat, work, compare, {"precision": "bfloat16"})
        if args.int8:
            bench(f"{name}_int8", int8_copy(path), feeds, args.threads, repeat, work, compare)
            bench(f"{name}_qdq", qdq_copy(path, feeds), feeds, args.threads, repeat, work, compare)
        if args.int4:
            bench(f"{name}_int4", int4_copy(path), feeds, args.threads, repeat, work, compare)
            if args.int4_gather:
                bench(f"{name}_int4g", int4_copy(path, gather=True), feeds, args.threads, repeat, work, compare)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(f"cpu: {_cpu_model()}, {os.cpu_count()} logical cores; threads: {args.threads}; "
          f"onnxruntime {__import__('onnxruntime').__version__}")
    with tempfile.TemporaryDirectory() as work:
        for m in COMMITTED:
            if args.only not in m:
                continue
            feeds = dict(np.load(os.path.join(MODELS, f"{m.rsplit('_', 1)[0]}_inputs.npz")))
            if m.startswith(("gpt2", "bert", "llama")):
                copy = os.path.join(work, f"{m}.onnx")  # (quantize_dynamic writes next to it)
                with open(os.path.join(MODELS, f"{m}.onnx"), "rb") as src, open(copy, "wb") as dst:
                    dst.write(src.read())
                bench_text(m, copy, feeds, args.repeat)
                continue
            bench(m, os.path.join(MODELS, f"{m}.onnx"), feeds, args.threads, args.repeat, work, compare)
            if m.startswith("resnet"):
                bench_halves(m, os.path.join(MODELS, f"{m}.onnx"), feeds, args.repeat)
        if args.light:
            import onnx

            light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
            for f in sorted(os.listdir(light)):
                if f.endswith(".onnx") and args.only in f:
                    path = os.path.join(light, f)
                    graph = onnx.load(path).graph
                    inits = {i.name for i in graph.initializer}
                    inp, = [i for i in graph.input if i.name not in inits]
                    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
                    n = int(np.prod(shape))  # the onnx backend runner's input: a ramp in [0, 1)
                    feeds = {inp.name: (np.arange(n).reshape(shape) / n).astype(np.float32)}
                    bench(f[:-5], path, feeds, args.threads, max(5, args.repeat // 5), work, compare)
        if args.sized:
            sys.path.insert(0, MODELS)
            if args.only in "gpt2_small_124M":
                path = os.path.join(work, "gpt2_small.onnx")
                info = in_child("export_models:export_gpt2", path, n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                seq_len=args.seq, batch=1)
                feeds = {i["name"]: np.random.default_rng(0).integers(0, 50257, i["shape"]).astype(np.int64)
                         if i["name"] == "input_ids" else np.ones(i["shape"], np.int64) for i in info["inputs"]}
                bench_text("gpt2_small_124M", path, feeds, max(5, args.repeat // 10))
            for kind, name in (("bert", "bert_base_110M"), ("llama", "llama_1024x8_170M")):
                if args.only in name:
                    path = os.path.join(work, f"{kind}.onnx")
                    feeds = in_child("export_text_model", kind, path, args.seq)
                    bench_text(name, path, feeds, max(5, args.repeat // 10))
            if args.only in "resnet50_224" or (args.int8 and args.only in "resnet50_224_qdq"):
                path = os.path.join(work, "resnet50.onnx")
                feeds = in_child("export_resnet50", path)
                if args.only in "resnet50_224":
                    bench("resnet50_224", path, feeds, args.threads, max(5, args.repeat // 5), work, compare)
                    if args.precision_bf16:  # (its convs on the bfloat16 GEMM)
                        bench("resnet50_224_pbf16", path, feeds, args.threads, max(5, args.repeat // 5), work,
                              compare, {"precision": "bfloat16"})
                    # (a half CNN: computed in float32, rounded per op; the bfloat16 one's convs on the bfloat16 GEMM)
                    bench_halves("resnet50_224", path, feeds, max(5, args.repeat // 5))
                if args.int8:  # (its convs on the integer conv)
                    bench("resnet50_224_qdq", qdq_copy(path, feeds), feeds, args.threads, max(5, args.repeat // 5),
                          work, compare)
            for kind in ("mobilenet_v2", "efficientnet_b0", "convnext_tiny", "regnety_4gf"):
                if args.only in f"{kind}_224" or (args.int8 and args.only in f"{kind}_224_qdq"):
                    path = os.path.join(work, f"{kind}.onnx")
                    feeds = in_child("export_vision_model", kind, path)
                    if args.only in f"{kind}_224":
                        bench(f"{kind}_224", path, feeds, args.threads, max(5, args.repeat // 5), work,
                              compare)
                        bench_halves(f"{kind}_224", path, feeds, max(5, args.repeat // 5))
                    if args.int8:
                        bench(f"{kind}_224_qdq", qdq_copy(path, feeds), feeds, args.threads, max(5, args.repeat // 5),
                              work, compare)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3])
    else:
        main()
