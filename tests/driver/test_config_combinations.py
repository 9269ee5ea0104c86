"""Random combinations of distributed_config and optimization_config keys, compiled and run.

Each case draws a model (a residual MLP, the GPT-2 and BERT test exports, or the genai Llama decoding with
its KV cache kept as state), a mesh and a random
choice of the keys that interact (algo, pipeline stages and microbatches, their 'auto' forms, a memory
budget, partial sums, layer aliasing, a rank_map, pinned ops, fusion, shape variants of the MLP) and compiles
it.
Either the compile succeeds, and every rank's run (in-process ranks) gives onnxruntime's outputs, or it
raises a ShardflowError (a ConfigError, ShapeError, ...) with a message: never another exception, never a
half-written out_dir. Two seeds by default; ``SHARDFLOW_RANDOM_SEEDS=A:B`` runs seeds A to B-1 (seeds
0-159 by hand in session 107: see rfcs/0001 "Random combinations of keys").
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from threads import run_threads  # noqa: E402

from shardflow.compiler import compile, compile_variants  # noqa: E402
from shardflow.compiler.errors import ShardflowError  # noqa: E402
from shardflow.runtime import load  # noqa: E402
from shardflow.runtime.comm import InProcessWorld  # noqa: E402
from shardflow.runtime.pipeline import PipelineProgram  # noqa: E402

ort = pytest.importorskip("onnxruntime")
MODELS = Path(__file__).resolve().parents[1] / "models"
SEEDS = range(*(int(v) for v in os.environ.get("SHARDFLOW_RANDOM_SEEDS", "0:2").split(":")))


def _mlp(seed: int, dynamic: bool) -> onnx.ModelProto:
    """``x [batch, seq, 32]`` (named dims when ``dynamic``) through 4 residual blocks and a softmax."""
    from test_pipeline_stages import _residual_mlp

    return _residual_mlp(layers=4, seed=seed, dims=["batch", "seq", 32] if dynamic else [4, 8, 32], softmax=True)


def _draw(seed: int):
    """(model, runs, compile kwargs, variants or None, what) for case ``seed``; ``runs``: ``(feeds, expected
    outputs or None: onnxruntime's on the feeds)`` in the order they run."""
    rng = np.random.default_rng(seed)

    def pick(options: list):
        return options[int(rng.integers(len(options)))]
    kind = pick(["mlp", "mlp", "variants", "gpt2_ts17", "bert_dynamo18", "genai"])
    mesh = pick([[1], [2], [4], [2, 2], [4, 1]])
    cfg: dict = {"mesh_shape": mesh, "algo": pick(["ilp", "ilp", "megatron", "data", "replicate"])}
    stages = pick([1, 2, 2, "auto"])
    if stages != 1:
        cfg["pipeline_stages"] = stages
        micro = pick([1, 2, "auto"])
        if micro != 1:
            cfg["pipeline_microbatches"] = micro
    if rng.random() < 0.3:
        cfg["memory_budget_bytes"] = pick([10 ** 9, 2_000_000, 200_000, 30_000])
    if rng.random() < 0.3:
        cfg["partial_sums"] = bool(rng.random() < 0.5)
    if rng.random() < 0.2:
        cfg["alias_layers"] = False
    if rng.random() < 0.25:  # (the ranks placed on the mesh in another order)
        cfg["rank_map"] = [int(r) for r in rng.permutation(int(np.prod(mesh)))]
    if rng.random() < 0.3:  # (a pin the rules may or may not allow there)
        pattern = {"mlp": "up1", "variants": "up*", "gpt2_ts17": "/model/transformer/h.0/mlp/c_fc/Gemm",
                   "bert_dynamo18": "*", "genai": "/model/layers.1/mlp/*"}[kind]
        cfg["op_placements"] = {pattern: pick(["S(1)", "R", "*", "R, S(1) -> S(1)"]) if len(mesh) == 1
                                else pick(["RR", "S(1)R", "*"])}
    opt = {"target": "cpu", "fuse": bool(rng.random() < 0.8)}
    variants = None
    kwargs = {"distributed_config": cfg, "optimization_config": opt}
    if kind == "genai":  # (three decoding steps, the KV cache kept as state: onnxruntime's fed its own presents)
        from test_state import _cache_state, _llama_steps

        steps = list(_llama_steps(3))
        kwargs.update(input_shapes={k: v.shape for k, v in steps[0][0].items()}, state=_cache_state(2))
        return str(MODELS / "llama_genai_fp32.onnx"), steps, kwargs, None, f"{kind} {cfg} {opt}"
    if kind in ("mlp", "variants"):
        model = _mlp(seed, dynamic=kind == "variants")
        if kind == "variants":
            variants = [{"seq": 8}, {"seq": 4, "batch": 2}]
            feeds = [{"x": rng.standard_normal((4, 8, 32)).astype(np.float32)},
                     {"x": rng.standard_normal((2, 4, 32)).astype(np.float32)}]
        else:
            feeds = [{"x": rng.standard_normal((4, 8, 32)).astype(np.float32)}]
        model = model.SerializeToString()
    else:
        model = str(MODELS / f"{kind}.onnx")
        base = kind.rsplit("_", 1)[0]
        feeds = [dict(np.load(MODELS / f"{base}_inputs.npz"))]
    feeds = [(f, None) for f in feeds]
    if kind == "variants":
        kwargs["dim_sizes"] = {"batch": 4}
    return model, feeds, kwargs, variants, f"{kind} {cfg} {opt}"


def _reference(model, feeds):
    sess = ort.InferenceSession(model if isinstance(model, bytes) else str(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {n: feeds[n] for n in names})))


def _check(seed: int, tmp_path):
    model, feeds, kwargs, variants, what = _draw(seed)
    out = tmp_path / "out"
    try:
        if variants is None:
            res = compile(model, out_dir=out, **kwargs)
        else:
            res = compile_variants(model, variants=variants, out_dir=out, **kwargs)
    except ShardflowError as exc:  # (a typed refusal, with its reason, and nothing left behind)
        assert str(exc).strip(), what
        assert not out.exists(), what
        return "refused"
    world = res.world_size if variants is None else res.results[0].world_size

    def rank(comm):  # (every run on the programs loaded once: a kept state goes from one run to the next)
        prog = load(out, comm.rank, comm)
        names = set(prog.input_names)
        fulls = []
        for given, _ in feeds:
            got = prog.run({k: v for k, v in given.items() if k in names})
            ran = prog if isinstance(prog, PipelineProgram) else getattr(prog, "last", None)
            fulls.append(ran.gather_outputs(got) if isinstance(ran, PipelineProgram) else got)
        prog.close()
        return fulls
    ranks = run_threads(InProcessWorld(world).communicators(), rank, timeout=300)
    for step, ((given, want), got) in enumerate(zip(feeds, ranks[0])):
        want = _reference(model, given) if want is None else want
        assert got and set(got) <= set(want), what
        for k, v in got.items():  # (outputs kept as state are not returned)
            np.testing.assert_allclose(v, want[k], rtol=2e-4, atol=2e-5, err_msg=f"run {step} {k}: {what}")
    return "ran"


@pytest.mark.parametrize("seed", list(SEEDS))
def test_random_config_combinations(tmp_path, seed):
    _check(seed, tmp_path)
