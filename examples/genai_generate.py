"""Greedy generation with an onnxruntime-genai LLM compiled by Shardflow: two programs, compiled once
each, and a KV cache of fixed size; the tokens checked against onnxruntime running the same loop.

    python examples/genai_generate.py [MODEL.onnx] [--prompt-len 8] [--new-tokens 16] [--work DIR]
                                      [--ranks N [--algo megatron] [--stages P [--microbatches M]]] [--batch B]

MODEL.onnx: a model from onnxruntime-genai's builder (``python -m onnxruntime_genai.models.builder``;
weights in the file or next to it), default ``tests/models/llama_genai_int4.onnx`` (a 2-layer Llama
with random weights and 4-bit MatMulNBits). The prompt program takes the prompt with an empty past; the
decoding program takes one token, a mask and a past of ``prompt_len + new_tokens`` positions (zeros
after each sequence's end), so its shapes never change: it is compiled once and run for every new
token. Its presents are compiled as state (``compile(state=...)``): the program keeps them as the next
step's past in its own memory (written in place), so each step passes the token and the mask only.
With ``--ranks N`` both programs are planned on N ranks, run here as N threads on an in-process
communicator; the decoding program's cache is split by KV heads (``input_placements`` and
``output_placements`` ``S(1)`` for each past and present: each rank keeps its heads' part, never
gathered). On more ranks than KV heads (4 or 8 for these models' 2) compile replicates the KV heads
to one a rank (padding the queries by KV group first where they do not divide) and keeps the cache
in that layout, split the same way (``padded_heads`` in the manifest's input entry); the whole past
given at the first step is taken to it. A layer with a windowed cache (``sliding_window_cache``,
gpt-oss's local layers: ``tests/models/gptoss_genai_fp32.onnx``) keeps a buffer of its window's size in
both programs, the prompt's empty, each present the next past as it is (kept as state too, copied
after each step: the window's buffer is compacted, not updated in place). With ``--stages P`` both
programs are cut into P pipeline stages of N / P ranks each (each layer's cache kept by the stage holding
the layer), and with ``--microbatches M`` a run's ``--batch B`` sequences go through the stages in M parts,
each stage keeping an instance of the decoding program per part with its sequences' rows of the cache.
Needs onnxruntime for the comparison only.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT = Path(__file__).resolve().parent.parent / "tests" / "models" / "llama_genai_int4.onnx"


def cache_inputs(model) -> tuple[list[str], int]:
    """The past inputs' names and their kv-head count (dim 1 of ``[batch, kv_heads, past, head]``)."""
    names = [i.name for i in model.graph.input if i.name.startswith("past_key_values.")]
    dims = model.graph.input[[i.name for i in model.graph.input].index(names[0])].type.tensor_type.shape.dim
    return names, dims[1].dim_value


def head_size(model, kv_heads: int) -> int:
    """The head size: the width of the first GroupQueryAttention's packed QKV (its producer's weight
    columns, a MatMul's or a MatMulNBits' N) over ``num_heads + 2 kv_heads``."""
    from onnx import helper

    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    heads = next(helper.get_attribute_value(a) for a in gqa.attribute if a.name == "num_heads")
    proj = next(n for n in model.graph.node if gqa.input[0] in n.output)
    if proj.op_type == "MatMulNBits":
        width = next(helper.get_attribute_value(a) for a in proj.attribute if a.name == "N")
    else:
        width = next(list(i.dims)[-1] for i in model.graph.initializer if i.name == proj.input[1])
    return width // (heads + 2 * kv_heads)


def windowed_caches(model) -> dict[str, int]:
    """The past inputs read by a GroupQueryAttention with ``sliding_window_cache`` = 1, each with its
    buffer's size (the node's ``local_window_size``: onnxruntime-genai's default, no slack)."""
    from onnx import helper

    res = {}
    for n in model.graph.node:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if n.op_type == "GroupQueryAttention" and a.get("sliding_window_cache") == 1:
            res.update({name: int(a["local_window_size"]) for name in n.input[3:5]})
    return res


def runner(out_dir: Path, ranks: int):
    """``run(feeds) -> rank 0's outputs`` of the program in ``out_dir``: loaded once; on several
    ranks one thread per rank, all on one in-process communicator (``shardflow run`` starts
    processes instead); of pipeline stages, every output gathered on rank 0 from the stage making it."""
    from concurrent.futures import ThreadPoolExecutor

    from shardflow.runtime import load
    from shardflow.runtime.comm import InProcessWorld
    from shardflow.runtime.pipeline import PipelineProgram

    if ranks == 1:
        return load(out_dir).run
    world = InProcessWorld(ranks).communicators()
    progs = [load(out_dir, c.rank, c) for c in world]
    pool = ThreadPoolExecutor(ranks)

    def one(prog, feeds):
        out = prog.run(feeds)
        return prog.gather_outputs(out) if isinstance(prog, PipelineProgram) else out
    return lambda feeds: [f.result() for f in [pool.submit(one, p, feeds) for p in progs]][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(DEFAULT))
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--work", default=None, help="where the programs go (default: a temporary folder)")
    ap.add_argument("--ranks", type=int, default=1, help="ranks to plan and run on (threads here; default 1)")
    ap.add_argument("--algo", default="ilp", choices=("ilp", "megatron", "data"), help="plan search (default ilp)")
    ap.add_argument("--stages", type=int, default=1, help="pipeline stages (they split the ranks; default 1)")
    ap.add_argument("--microbatches", type=int, default=1, help="with --stages: a run's sequences in M parts")
    ap.add_argument("--batch", type=int, default=1, help="sequences generated together (default 1)")
    args = ap.parse_args()

    import onnx

    from shardflow.compiler import compile

    model = onnx.load(args.model)
    past_names, kv_heads = cache_inputs(model)
    head = head_size(model, kv_heads)
    windowed = windowed_caches(model)
    vocab = model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value
    total = args.prompt_len + args.new_tokens
    b = args.batch
    prompt = np.random.default_rng(0).integers(0, vocab, (b, args.prompt_len)).astype(np.int64)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        shapes = {"prompt": {"input_ids": (b, args.prompt_len), "attention_mask": (b, args.prompt_len),
                             **{n: (b, kv_heads, windowed.get(n, 0), head) for n in past_names}},
                  "decode": {"input_ids": (b, 1), "attention_mask": (b, total),
                             **{n: (b, kv_heads, windowed.get(n, total), head) for n in past_names}}}
        progs = {}
        state = {n.replace("past_key_values", "present"): n for n in past_names}  # present -> next past
        split = {}  # the decoding program's cache split by KV heads on several ranks
        width = args.ranks // args.stages  # (a stage's ranks: its mesh, on which the placements are)
        if width > 1 and kv_heads % width == 0:
            split = {"input_placements": {n: "S(1)" for n in past_names},
                     "output_placements": {n: "S(1)" for n in state}}
        staged = {"pipeline_stages": args.stages, "pipeline_microbatches": args.microbatches} if args.stages > 1 else {}
        for step, s in shapes.items():
            t = time.perf_counter()
            mesh = {"mesh_shape": [args.ranks], "algo": args.algo, **staged, **(split if step == "decode" else {})}
            res = compile(model, distributed_config=mesh,
                          optimization_config={"target": "cpu"}, out_dir=work / step, input_shapes=s,
                          state=state if step == "decode" else None)
            progs[step] = runner(res.out_dir, args.ranks)
            print(f"compiled the {step} program in {time.perf_counter() - t:.1f} s ({res.ranks[0]['kernels']} kernels"
                  f" per rank" + (f"; {args.stages} pipeline stages" if staged else "") + ")")
        firsts = sorted((work / "decode").glob("stage*/rank0")) or [work / "decode" / "rank0"]  # (each stage's)
        kept = {e["name"]: e["placement"] for d in firsts for e in json.loads((d / "manifest.json").read_text())
                ["inputs"] if e["name"] in past_names}
        assert sorted(kept) == sorted(past_names), kept
        print(f"the decoding program keeps the cache ({', '.join(sorted(set(kept.values())))} on {args.ranks} rank(s))")

        def generate(run, keeps_state: bool) -> list[int]:
            """Greedy tokens; ``run(step, feeds)``. With ``keeps_state`` the decoding program keeps its
            cache: the past goes in once, with the first token; else every step passes its past and
            takes the presents back."""
            empty = {n: np.zeros(shapes["prompt"][n], np.float32) for n in past_names}
            out = run("prompt", {"input_ids": prompt, "attention_mask": np.ones_like(prompt), **empty})
            past = {n: np.zeros(shapes["decode"][n], np.float32) for n in past_names}
            for n in past_names:
                present = out[n.replace("past_key_values", "present")]
                past[n][:, :, :present.shape[2]] = present
            mask = np.zeros((b, total), np.int64)
            mask[:, :args.prompt_len] = 1
            tokens = []  # (per step, each sequence's token)
            for k in range(args.new_tokens):
                tokens.append([int(t) for t in out["logits"][:, -1].argmax(-1)])
                if k == args.new_tokens - 1:
                    break
                mask[:, args.prompt_len + k] = 1
                feeds = {"input_ids": np.array(tokens[-1], np.int64).reshape(b, 1), "attention_mask": mask}
                out = run("decode", {**feeds, **past} if past else feeds)
                past = {} if keeps_state else {n: out[n.replace("past_key_values", "present")] for n in past_names}
            return [list(seq) for seq in zip(*tokens)] if b > 1 else [t[0] for t in tokens]

        t = time.perf_counter()
        ours = generate(lambda step, f: progs[step](f), keeps_state=True)
        print(f"shardflow:   {ours} ({time.perf_counter() - t:.2f} s)")

        import onnxruntime as ort

        sess = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        ref = generate(lambda step, f: dict(zip(names, sess.run(None, f))), keeps_state=False)
        print(f"onnxruntime: {ref}")
        same = ours == ref
        print("the same tokens" if same else "the tokens differ (onnxruntime's int4 kernels quantize activations to "
              "int8 at accuracy level 4: a near tie may go the other way)")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
