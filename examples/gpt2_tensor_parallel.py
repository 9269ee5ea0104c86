"""Tensor-parallel GPT-2 on 2 CPU ranks: export → compile → run → compare with onnxruntime.

    python examples/gpt2_tensor_parallel.py [--layers 2] [--embd 128] [--heads 4] [--nproc 2] [--work DIR]
        [--stages P [--microbatches M]]

With ``--stages P`` the layers are cut into P pipeline stages, each tensor-parallel over
``nproc / P`` ranks (mesh ``[P, nproc / P]``), and with ``--microbatches M`` a run's batch goes
through the stages in M parts.

Needs torch + transformers (to export the model) and onnxruntime (the reference); the run
itself needs only the shardflow runtime (mpiexec is used when available).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def export_gpt2(path: Path, layers: int, embd: int, heads: int, vocab: int, batch: int, seq: int) -> dict:
    """Export a randomly initialised GPT-2 (logits output); return example inputs."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=max(64, seq), n_embd=embd, n_layer=layers, n_head=heads,
                     use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).logits

    rng = np.random.default_rng(0)
    inputs = {"input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64),
              "attention_mask": np.ones((batch, seq), np.int64)}
    with torch.no_grad():
        torch.onnx.export(Logits(model), tuple(torch.from_numpy(inputs[k]) for k in inputs), str(path),
                          input_names=list(inputs), output_names=["logits"], opset_version=17, dynamo=False)
    return inputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (a 1-D mesh)")
    ap.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--stages", type=int, default=1, help="pipeline stages (the mesh's first axis)")
    ap.add_argument("--microbatches", type=int, default=1, help="parts of a run's batch through the stages")
    args = ap.parse_args()

    from shardflow.compiler import compile

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        onnx_path = work / "gpt2.onnx"
        print(f"1. exporting GPT-2 ({args.layers} layers, width {args.embd}) to {onnx_path}")
        inputs = export_gpt2(onnx_path, args.layers, args.embd, args.heads, args.vocab, 2, args.seq)
        np.savez(work / "inputs.npz", **inputs)

        config = {"mesh_shape": [args.nproc], "algo": "megatron"}
        how = "Megatron-style tensor parallelism"
        if args.stages > 1:
            config.update(mesh_shape=[args.stages, args.nproc // args.stages], pipeline_stages=args.stages,
                          pipeline_microbatches=args.microbatches)
            how = f"{args.stages} pipeline stages of {how}, {args.microbatches} microbatch(es)"
        print(f"2. compiling for {args.nproc} ranks ({how}, cpu kernels)")
        t = time.perf_counter()
        result = compile(onnx_path, distributed_config=config, optimization_config={"target": "cpu"},
                         out_dir=work / "out")
        print(f"   {time.perf_counter() - t:.1f} s; plan collectives: "
              f"{sum(r['collectives'] for r in result.ranks[:1])} per rank")
        print("   " + result.summary().replace("\n", "\n   "))

        print(f"3. running on {args.nproc} ranks: shardflow run {work / 'out'} --nproc {args.nproc} ...")
        proc = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "run", str(work / "out"),
                               "--nproc", str(args.nproc), "--inputs", str(work / "inputs.npz"),
                               "--outputs", str(work / "outputs.npz")], timeout=600)
        if proc.returncode != 0:
            print("   the run failed")
            return proc.returncode
        got = np.load(work / "outputs.npz")["logits"]

        print("4. comparing with onnxruntime")
        import onnxruntime as ort

        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        ref = sess.run(None, inputs)[0]
        err = float(np.abs(got - ref).max())
        ok = np.allclose(got, ref, rtol=1e-3, atol=1e-3)
        print(f"   logits {list(got.shape)}: max |shardflow - onnxruntime| = {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
