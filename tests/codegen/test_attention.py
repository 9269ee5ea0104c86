"""Fused attention: the graph pass (compiler/passes/attention.py) and the cuda kernel
(compiler/codegen/cuda_attention.py).

* Without a GPU: the pass on the exported test models keeps every value (the reference evaluator
  gives the same bits before and after), removes the transposes and the softmax, turns a
  constant causal mask into ``is_causal`` (same bits), and the cuda target compiles every
  attention into one ``attention-f16`` kernel (nvcc, sm_90), or at float32 and tf32 into one
  ``attention-f32``/``attention-tf32`` kernel. ONNX ``Attention`` ops (opset 23)
  get half Q, K, V under a half precision and match onnxruntime on one and two ranks; those that
  are float16 in the model compute in float32 (one fused kernel) within float16's tolerance of
  onnxruntime's float16 kernel.
* ``pytest -m gpu``: the kernel against the op's numpy definition at odd sizes (queries and keys
  not multiples of 64, several key steps), head sizes 16-128, grouped heads, bfloat16, 3-D and
  4-D operands, broadcast masks, bool masks shorter than the keys, causal masks (with a KV
  cache's offset), padded KV caches (``nonpad_kv_seqlen``) and rows whose every key is masked.
  Tolerance: ``1e-2`` of the output's scale (the probabilities are rounded to the half type
  before the division by their sum, the definition rounds them after: rfcs/0005-hopper-gemm.md,
  decision 15). The same cases on float32 operands: 3xTF32 within ``1e-5``, TF32 ``3e-3``
  (decision 35; the host emulation runs them all without a GPU, test_cuda_host.py).
"""
from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from model_refs import onnxruntime_reference

from shardflow.compiler import compile, load_onnx
from shardflow.compiler.codegen import cuda as cg
from shardflow.compiler.codegen.cuda import build_cuda_library, generate_cuda_source
from shardflow.compiler.ir import Tensor
from shardflow.compiler.ops.linalg import Attention
from shardflow.compiler.passes.attention import FuseAttention
from shardflow.compiler.passes.precision import HalfPrecisionContractions
from shardflow.runtime.tma import kernel_args

MODELS = Path(__file__).parent.parent / "models"


@pytest.mark.parametrize("model,three_d,y_3d", [("gpt2_ts17", True, True), ("gpt2_dynamo18", True, True),
                                                ("bert_ts17", True, True), ("llama_ts17", False, True),
                                                ("vit_ts17", True, True), ("t5_encoder_ts17", True, True),
                                                ("t5_encoder_dynamo18", True, True)])
def test_the_pass_fuses_every_attention_and_keeps_the_values(model, three_d, y_3d):
    """``three_d``: Q in the [B, S, H*D] form; ``y_3d``: the output (Llama's Q comes out of the
    rotary embedding in heads, but its output is merged for the projection: no transpose left)."""
    feeds = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    ref = HalfPrecisionContractions("float16").run(load_onnx(MODELS / f"{model}.onnx")).run(feeds)
    g = FuseAttention().run(HalfPrecisionContractions("float16").run(load_onnx(MODELS / f"{model}.onnx")))
    g.validate()
    atts = [op for op in g.nodes if op.op_type == "Attention"]
    assert len(atts) == 2  # one per layer
    assert not [op for op in g.nodes if op.op_type == "Softmax"]
    assert all((op.inputs[0].ndim == 3) == three_d and (op.outputs[0].ndim == 3) == y_3d for op in atts)
    # the additive biases in the order they are added (T5: its position bias, then the mask)
    biases = 2 if model.startswith("t5") else 0 if model.startswith("vit") else 1
    assert all(op.attrs.get("extra_biases", 0) == biases and not op.attrs.get("has_mask") for op in atts)
    # grouped heads (Llama's 4 query heads on 2 KV heads): K and V read before their repeat
    kv_heads = 2 if model.startswith("llama") else atts[0].attrs["q_heads"]
    assert all(op._geometry(*op.inputs[:3])[2] == kv_heads for op in atts)
    got = g.run(feeds)
    for k, v in ref.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("model", ["llama_ts17", "llama_dynamo18", "gpt2_ts17"])
def test_the_float32_pass_for_cuda_reads_grouped_heads_once_and_keeps_the_values(model):
    """FuseAttention(float32=True, target="cuda") on a float32 graph: one Attention per layer (the
    cpu template's restrictions do not apply), Llama's on its 2 KV heads (the exporters'
    ``repeat_kv`` left out: the kernel maps query head ``h`` to KV head ``h // 2``), the same bits."""
    feeds = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    g0 = load_onnx(MODELS / f"{model}.onnx")
    ref = g0.run(feeds)
    g = FuseAttention(float32=True, target="cuda").run(load_onnx(MODELS / f"{model}.onnx"))
    g.validate()
    atts = [op for op in g.nodes if op.op_type == "Attention"]
    assert len(atts) == 2 and not [op for op in g.nodes if op.op_type == "Softmax"]
    assert {op._geometry(*op.inputs[:3])[2] for op in atts} == {2 if model.startswith("llama") else 4}
    if model.startswith("llama"):
        assert not [op for op in g.nodes if op.op_type == "Expand" and op.outputs[0].ndim == 5]  # (dead: removed)
    got = g.run(feeds)
    for k, v in ref.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("model", ["gpt2_ts17", "llama_ts17", "bert_ts17"])
def test_rank_graphs_fused_after_partitioning_match_onnxruntime(model):
    """The driver plans the float32 graph, then merges the projections, rounds and fuses each
    rank's graph (so the plan shards the separate ops); two ranks' fused graphs, simulated, give
    the model's outputs."""
    from shardflow.compiler.parallel import partition, search
    from shardflow.compiler.parallel.config import DistributedConfig
    from shardflow.compiler.parallel.simulate import simulate
    from shardflow.compiler.passes.projections import MergeProjections

    feeds, ref = onnxruntime_reference(model)
    g = load_onnx(MODELS / f"{model}.onnx")
    plan = search(g, DistributedConfig.from_dict({"mesh_shape": [2], "algo": "megatron"}))
    ranks = [FuseAttention().run(HalfPrecisionContractions("float16").run(MergeProjections().run(rg)))
             for rg in partition(g, plan)]
    if model != "gpt2_ts17":  # (GPT-2's export has one QKV projection already)
        assert all(sum(op.name.endswith(".merged") for op in rg.nodes) == 2 for rg in ranks)
    assert all(sum(op.op_type == "Attention" for op in rg.nodes) == 2 for rg in ranks)
    got = simulate(ranks, feeds)
    for k, v in ref.items():  # float16 operands: rfcs/0004's tolerance
        np.testing.assert_allclose(got[k], v, rtol=5e-3, atol=5e-3 * float(np.abs(v).max()), err_msg=k)


@pytest.mark.parametrize("model", ["gpt2_ts17", "llama_ts17"])
def test_float32_rank_graphs_fused_for_cuda_match_onnxruntime(model):
    """The float32 pass for cuda on two ranks' graphs (heads split by the plan: Llama's rank has
    2 query heads on 1 KV head): one Attention per layer, simulated, gives the model's outputs."""
    from shardflow.compiler.parallel import partition, search
    from shardflow.compiler.parallel.config import DistributedConfig
    from shardflow.compiler.parallel.simulate import simulate
    from shardflow.compiler.passes.projections import MergeProjections

    feeds, ref = onnxruntime_reference(model)
    g = load_onnx(MODELS / f"{model}.onnx")
    plan = search(g, DistributedConfig.from_dict({"mesh_shape": [2], "algo": "megatron"}))
    ranks = [FuseAttention(float32=True, target="cuda").run(MergeProjections().run(rg)) for rg in partition(g, plan)]
    for rg in ranks:
        atts = [op for op in rg.nodes if op.op_type == "Attention"]
        assert len(atts) == 2
        heads = {op._geometry(*op.inputs[:3])[1:3] for op in atts}
        assert heads == {(2, 1)} if model == "llama_ts17" else all(hq == hk for hq, hk in heads)
    got = simulate(ranks, feeds)
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5 * float(np.abs(v).max()), err_msg=k)


def test_the_pass_leaves_other_patterns_alone():
    """A softmax whose scores are also an output, and a product of float32 operands, stay as they are."""
    from shardflow.compiler.ir.graph import FlowGraph
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.ops.reduce import Softmax

    q, k, v = (Tensor(n, (1, 2, 8, 16), "float32") for n in "qkv")
    from shardflow.compiler.ops.transform import Transpose
    kt = Transpose([k], perm=(0, 1, 3, 2))
    s = MatMul([q, kt.outputs[0]])
    p = Softmax([s.outputs[0]], axes=(3,))
    y = MatMul([p.outputs[0], v])
    g = FuseAttention().run(FlowGraph([q, k, v], y.outputs + s.outputs))
    assert [op.op_type for op in g.nodes] == ["Transpose", "MatMul", "Softmax", "MatMul"]


def _without_mask_input(model: str):
    """The test model with ``attention_mask`` bound to ones, as an export without that input
    (GPT-2 small in benchmarks/gpu/) has it: the mask folds into a constant."""
    import onnx
    from onnx import numpy_helper

    from shardflow.compiler.passes.simplify import FoldConstants

    m = onnx.load(MODELS / f"{model}.onnx")
    feeds = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    m.graph.input.remove(next(i for i in m.graph.input if i.name == "attention_mask"))
    m.graph.initializer.append(numpy_helper.from_array(np.ones_like(feeds.pop("attention_mask")), "attention_mask"))
    return FoldConstants().run(load_onnx(m)), feeds


@pytest.mark.parametrize("model", ["gpt2_ts17", "llama_dynamo18"])
def test_a_constant_causal_mask_becomes_is_causal_with_the_same_values(model):
    g, feeds = _without_mask_input(model)
    g = HalfPrecisionContractions("float16").run(g)
    ref = g.run(feeds)
    g = FuseAttention().run(g)
    atts = [op for op in g.nodes if op.op_type == "Attention"]
    assert len(atts) == 2 and all(op.attrs["is_causal"] and op.attrs["past_len"] == 0 and len(op.inputs) == 3
                                  for op in atts)
    got = g.run(feeds)
    for k, v in ref.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_which_constant_masks_count_as_causal():
    from shardflow.compiler.passes.attention import _causal

    low = np.finfo(np.float32).min
    tri = np.where(np.tril(np.ones((6, 6), bool)), 0, low).astype(np.float32)
    assert _causal(tri, 6, 6) == (0, False)
    assert _causal(np.where(tri == 0, 0, -np.inf).astype(np.float32)[None, None], 6, 6) == (0, False)
    # 3 queries after 5 cached keys: the diagonal moves by L - S; a top-left one (offset 0) too
    last = np.where(np.arange(8)[None] <= np.arange(3)[:, None] + 5, 0, low).astype(np.float32)
    assert _causal(last, 3, 8) == (5, False)
    assert _causal(np.where(np.arange(8)[None] <= np.arange(3)[:, None], 0, low).astype(np.float32), 3, 8) == (0, False)
    padded = tri.copy()
    padded[:, 1] = np.where(np.arange(6) >= 1, low, padded[:, 1])  # key 1 is padding, row 0 keeps key 0
    assert _causal(np.stack([tri, padded])[:, None], 6, 6) == (0, True)
    biased = tri + np.tril(np.full((6, 6), 0.5, np.float32))  # other entries not 0: the mask stays
    assert _causal(biased, 6, 6) == (0, True)
    no_key = tri.copy()
    no_key[2, :] = low  # a row with every key hidden: softmax spreads it over all keys, not causal ones
    assert _causal(no_key, 6, 6) == (None, True)
    assert _causal(np.where(tri == 0, 0, -1e4).astype(np.float32), 6, 6) == (None, True)  # not hidden exactly
    assert _causal(np.zeros((6, 6), np.float32), 6, 6) == (None, True)
    assert _causal(tri[:1], 6, 6) == (None, True)  # one row broadcast: no diagonal
    # a float16 model's mask, its type's lowest value widened: hidden for that model alone
    tri16 = np.where(tri == 0, 0, np.finfo(np.float16).min).astype(np.float32)
    assert _causal(tri16, 6, 6) == (None, True)
    assert _causal(tri16, 6, 6, hidden=float(np.finfo(np.float16).min)) == (0, False)


def _causal_model(dtype: str = "float16", form: str = "add", padding: bool = False, s: int = 24, e: int = 32,
                  heads: int = 2):
    """An attention as transformers' eager forms write it: ``x [2, S, E]`` -> Q, K, V -> heads ->
    ``softmax(Q Kᵀ / sqrt(D) + mask) V`` -> output projection -> ``y``, in ``dtype``, the causal mask
    of the type's lowest value above the diagonal: a constant ``[1, 1, S, S]`` added (``form``
    ``"add"``, today's), or the scores filled where a constant condition hides them (``"where"``,
    GPT-2's ``torch.where(causal_mask, w, mask_value)`` before ``masking_utils``); with ``padding``
    an input ``pad [2, 1, 1, S]`` added after it."""
    from onnx import numpy_helper
    from onnx import helper as oh

    rng = np.random.default_rng(0)
    d, npt = e // heads, np.dtype(dtype)
    low = np.finfo(npt).min
    tril = np.tril(np.ones((s, s), bool))[None, None]
    inits = [numpy_helper.from_array((rng.standard_normal((e, e)) / np.sqrt(e)).astype(npt), n)
             for n in ("wq", "wk", "wv", "wo")]
    inits += [numpy_helper.from_array(np.array([2, s, heads, d], np.int64), "h4"),
              numpy_helper.from_array(np.array([2, s, e], np.int64), "h3"),
              numpy_helper.from_array(np.array(d ** -0.5, npt), "scale"),
              numpy_helper.from_array(np.where(tril, 0, low).astype(npt), "mask"),
              numpy_helper.from_array(tril, "seen"), numpy_helper.from_array(np.array(low, npt), "low")]
    nodes = []
    for t in "qkv":
        nodes += [oh.make_node("MatMul", ["x", f"w{t}"], [t]), oh.make_node("Reshape", [t, "h4"], [f"{t}4"]),
                  oh.make_node("Transpose", [f"{t}4"], [f"{t}t"], perm=[0, 2, 3, 1] if t == "k" else [0, 2, 1, 3])]
    nodes += [oh.make_node("MatMul", ["qt", "kt"], ["s0"]), oh.make_node("Mul", ["s0", "scale"], ["s1"]),
              oh.make_node("Add", ["s1", "mask"], ["s2"]) if form == "add" else
              oh.make_node("Where", ["seen", "s1", "low"], ["s2"])]
    if padding:
        nodes.append(oh.make_node("Add", ["s2", "pad"], ["s3"]))
    nodes += [oh.make_node("Softmax", ["s3" if padding else "s2"], ["p"], axis=-1),
              oh.make_node("MatMul", ["p", "vt"], ["o"]), oh.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              oh.make_node("Reshape", ["ot", "h3"], ["a"]), oh.make_node("MatMul", ["a", "wo"], ["y"])]
    io = oh.make_tensor_value_info
    et = oh.np_dtype_to_tensor_dtype(npt)
    ins = [io("x", et, [2, s, e])] + ([io("pad", et, [2, 1, 1, s])] if padding else [])
    graph = oh.make_graph(nodes, "causal", ins, [io("y", et, [2, s, e])], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


@pytest.mark.parametrize("dtype,form,padding", [("float16", "add", False), ("float16", "where", False),
                                                ("float32", "where", False), ("float16", "where", True)])
def test_a_causal_mask_of_the_types_lowest_value_becomes_is_causal(dtype, form, padding):
    """transformers' float16 models hide a key with their type's lowest value (``finfo.min``,
    -65504), not the float32 ``-1e30`` and below that counts as hidden for any model: the fused
    op adds the half mask in float32, where ``exp`` of a hidden score minus the row's maximum is 0
    as for ``-inf``; a constant causal mask, added or a fill of the scores (a float32 model's fill
    too, a ``Where`` of constants), becomes ``is_causal`` (no bias read, the tiles above the
    diagonal skipped: rfcs/0005 decision 70), the values those of the separate ops within the
    type's rounding, and onnxruntime's. A float16 fill with a padding mask added after it (which
    could hide every key of a row, where the fill's exact value matters) is left alone."""
    model = _causal_model(dtype, form, padding)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 24, 32)).astype(dtype)}
    if padding:
        feeds["pad"] = np.where(np.arange(24) < 20, 0, np.finfo(np.dtype(dtype)).min).astype(dtype).reshape(1, 1, 1, 24)
        feeds["pad"] = np.repeat(feeds["pad"], 2, axis=0)
    g = load_onnx(model)
    ref = g.run(feeds)["y"].astype(np.float32)
    fused = FuseAttention(float32=dtype == "float32", target="cuda").run(g)
    atts = [op for op in fused.nodes if op.op_type == "Attention"]
    if padding:
        assert not atts
        return
    (att,) = atts
    assert att.attrs.get("is_causal") and len(att.inputs) == 3 and not att.attrs.get("extra_biases"), att.attrs
    got = fused.run(feeds)["y"].astype(np.float32)
    tol = 2e-3 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))
    ort = pytest.importorskip("onnxruntime")
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    want = want.astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def _onnx_attention_model(causal: bool, mask: bool, four_d: bool, nonpad: bool = False, b=2, s=40, e=64, hq=4, hk=2):
    """An opset-23 ``Attention`` between projections: ``x [B, S, E]`` -> Q, K, V (``hk`` key/value
    heads, 3-D with head counts or 4-D through reshapes and transposes) -> Attention -> ``out``;
    with ``mask`` a float additive mask ``m [S, S]`` is an input; with ``nonpad`` (opset 24) the
    keys each batch's rows see, ``np [B]``."""
    import onnx
    from onnx import TensorProto, numpy_helper
    from onnx import helper as oh

    rng = np.random.default_rng(3)
    d = e // hq
    w = {n: (rng.standard_normal(sh) * 0.2).astype(np.float32) for n, sh in
         (("wq", (e, e)), ("wk", (e, hk * d)), ("wv", (e, hk * d)), ("wo", (e, e)))}
    nodes = [oh.make_node("MatMul", ["x", f"w{n}"], [f"{n}3"]) for n in "qkv"]
    heads = {}
    for n, h in (("q", hq), ("k", hk), ("v", hk)):
        if four_d:
            w[f"{n}_shape"] = np.array([b, s, h, d], np.int64)
            nodes += [oh.make_node("Reshape", [f"{n}3", f"{n}_shape"], [f"{n}r"]),
                      oh.make_node("Transpose", [f"{n}r"], [f"{n}4"], perm=[0, 2, 1, 3])]
        heads[n] = f"{n}4" if four_d else f"{n}3"
    att = {"is_causal": int(causal)} if four_d else {"is_causal": int(causal), "q_num_heads": hq, "kv_num_heads": hk}
    optional = ["m" if mask else "", "", "", "np"] if nonpad else (["m"] if mask else [])
    nodes.append(oh.make_node("Attention", [heads["q"], heads["k"], heads["v"]] + optional, ["y"], **att))
    if four_d:
        w["y_shape"] = np.array([b, s, e], np.int64)
        nodes += [oh.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]),
                  oh.make_node("Reshape", ["yt", "y_shape"], ["y3"])]
    nodes.append(oh.make_node("MatMul", ["y3" if four_d else "y", "wo"], ["out"]))
    inputs = [oh.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, e])]
    feeds = {"x": rng.standard_normal((b, s, e)).astype(np.float32)}
    if mask:
        inputs.append(oh.make_tensor_value_info("m", TensorProto.FLOAT, [s, s]))
        feeds["m"] = np.where(rng.random((s, s)) > 0.2, rng.standard_normal((s, s)), -np.inf).astype(np.float32)
        feeds["m"][:, 0] = 0.0  # every query keeps key 0
    if nonpad:
        inputs.append(oh.make_tensor_value_info("np", TensorProto.INT64, [b]))
        feeds["np"] = np.array([s, 23][:b], np.int64)
    graph = oh.make_graph(nodes, "attention", inputs, [oh.make_tensor_value_info("out", TensorProto.FLOAT, [b, s, e])],
                          [numpy_helper.from_array(v, n) for n, v in w.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 24 if nonpad else 23)])
    # the IR version of the opset (onnx 1.18 / 1.19), not the onnx package's newest: an onnxruntime
    # older than the package refuses a newer IR version (seen on the GPU image: IR 14, ORT 1.30)
    model.ir_version = 12 if nonpad else 11
    onnx.checker.check_model(model)
    return model, feeds


def _ort(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


ONNX_ATTENTION = {"causal-3d": (True, False, False), "mask-4d": (False, True, True),
                  "causal-mask-4d": (True, True, True), "nonpad-3d": (False, False, False, True),
                  "nonpad-mask-4d": (False, True, True, True)}


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(ONNX_ATTENTION))
def test_onnx_attention_reads_half_operands_and_matches_onnxruntime(case, half):
    """An ONNX ``Attention`` under half precision becomes the mixed-precision op (half Q, K, V
    that the projections write, float32 softmax): one rank and two ranks (simulated, the plan
    on the float32 graph as the driver makes it) within rfcs/0004's tolerance of onnxruntime."""
    from shardflow.compiler.parallel import partition, search
    from shardflow.compiler.parallel.config import DistributedConfig
    from shardflow.compiler.parallel.simulate import simulate

    model, feeds = _onnx_attention_model(*ONNX_ATTENTION[case])
    ref = _ort(model, feeds)
    tol = 5e-3 if half == "float16" else 2e-2
    g = HalfPrecisionContractions(half).run(load_onnx(model))
    g.validate()
    (att,) = [op for op in g.nodes if op.op_type == "Attention"]
    assert [t.dtype for t in att.inputs[:3]] == [half] * 3 and att.attrs["probs_dtype"] == half
    got = g.run(feeds)
    plan = search(load_onnx(model), DistributedConfig.from_dict({"mesh_shape": [2], "algo": "megatron"}))
    ranks = [HalfPrecisionContractions(half).run(rg) for rg in partition(load_onnx(model), plan)]
    for result in (got, simulate(ranks, feeds)):
        v = ref["out"]
        np.testing.assert_allclose(result["out"], v, rtol=tol, atol=tol * float(np.abs(v).max()))


@pytest.mark.parametrize("case", list(ONNX_ATTENTION))
def test_onnx_attention_takes_the_fused_kernel(case):
    """On cuda the projections write the half Q, K, V and the attention is one fused kernel."""
    from shardflow.compiler.codegen.fusion import fuse

    model, _ = _onnx_attention_model(*ONNX_ATTENTION[case])
    g = HalfPrecisionContractions("float16").run(load_onnx(model))
    src = generate_cuda_source(fuse(list(g.nodes), keep=g.output_names), arch="sm_90")
    kinds = [launch.kind for launch in src.launches.values()]
    assert kinds.count("attention-f16") == 1, kinds
    assert ("sf_j <= sf_i" in src.text) == ONNX_ATTENTION[case][0]
    assert ("const int sf_np = " in src.text) == (len(ONNX_ATTENTION[case]) > 3)  # nonpad_kv_seqlen read


def _float16_attention_model(case: str, constant_mask: bool = False):
    """``_onnx_attention_model``'s model and inputs in float16 throughout (weights, input, mask,
    output), as a model exported in half precision is; with ``constant_mask`` the mask is a
    weight instead of an input."""
    import onnx
    from onnx import TensorProto, numpy_helper

    model, feeds = _onnx_attention_model(*ONNX_ATTENTION[case])
    feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    for init in model.graph.initializer:
        a = numpy_helper.to_array(init)
        if a.dtype == np.float32:
            init.CopyFrom(numpy_helper.from_array(a.astype(np.float16), init.name))
    for vi in list(model.graph.input) + list(model.graph.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    if constant_mask:
        model.graph.input.remove(next(i for i in model.graph.input if i.name == "m"))
        model.graph.initializer.append(numpy_helper.from_array(feeds.pop("m"), "m"))
    onnx.checker.check_model(model)
    return model, feeds


def _half_model_softmax_in_float32(half: str, form: str = "scores"):
    """A half model's attention as transformers' Llama asks for it in float16/bfloat16 (a float32
    softmax): ``Cast(Softmax(Cast(Q Kᵀ · c + mask, float32)), half) V`` (``form`` "scores"), or
    as the TorchScript exporter writes it, ``Cast(Cast(Softmax(s), float32), half)`` ("probs");
    the heads merged back to ``[B, S, H*D]`` and scaled; with its inputs."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    b, h, s, n, d = 2, 4, 5, 40, 32
    t = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[half]
    c = numpy_helper.from_array(np.array(d ** -0.5, np.float32), "c")
    c.data_type, c.raw_data = (t, np.array(d ** -0.5, np.float16).tobytes()) if half == "float16" else \
        (t, (np.array(d ** -0.5, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes())
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"]), helper.make_node("Mul", ["s0", "c"], ["s1"]),
             helper.make_node("Add", ["s1", "m"], ["s2"]),
             *([helper.make_node("Cast", ["s2"], ["s3"], to=TensorProto.FLOAT),
                helper.make_node("Softmax", ["s3"], ["p32"], axis=-1)] if form == "scores" else
               [helper.make_node("Softmax", ["s2"], ["ph"], axis=-1),
                helper.make_node("Cast", ["ph"], ["p32"], to=TensorProto.FLOAT)]),
             helper.make_node("Cast", ["p32"], ["p"], to=t),
             helper.make_node("MatMul", ["p", "v"], ["y4"]),
             helper.make_node("Transpose", ["y4"], ["yt"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["yt", "shape"], ["y"]), helper.make_node("Mul", ["y", "c"], ["out"])]
    shape = numpy_helper.from_array(np.array([b, s, h * d], np.int64), "shape")
    ins = [helper.make_tensor_value_info(k, t, sh) for k, sh in (("q", [b, h, s, d]), ("k", [b, h, n, d]),
                                                                ("v", [b, h, n, d]), ("m", [b, 1, s, n]))]
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("out", t, [b, s, h * d])],
                              [c, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(sh).astype(np.float32) for k, sh in (("q", (b, h, s, d)), ("k", (b, h, n, d)),
                                                                          ("v", (b, h, n, d)))}
    feeds["m"] = np.where(rng.random((b, 1, s, n)) > 0.3, 0.0, -np.inf).astype(np.float32)
    feeds = {k: _bits(v, half) for k, v in feeds.items()}
    if half == "bfloat16":
        import ml_dtypes

        feeds = {k: v.view(ml_dtypes.bfloat16) for k, v in feeds.items()}
    return model, feeds


@pytest.mark.parametrize("half,form", [("float16", "scores"), ("bfloat16", "scores"), ("float16", "probs"),
                                       ("bfloat16", "probs")])
def test_a_half_model_softmax_in_float32_is_fused(tmp_path, half, form):
    """transformers' Llama in half precision asks for its softmax in float32 (casts before and
    after it, or after it only, as the TorchScript exporter writes it): FuseAttention takes both
    forms (the op's own softmax is float32), within the half type's tolerance of the separate ops
    (float16: of onnxruntime too); on cuda one fused kernel, no softmax of its own."""
    model, feeds = _half_model_softmax_in_float32(half, form)
    g0 = load_onnx(model)
    g = FuseAttention().run(load_onnx(model))
    g.validate()
    assert [op.op_type for op in g.nodes].count("Attention") == 1 and "Softmax" not in [op.op_type for op in g.nodes]
    want = g0.run(feeds)["out"].astype(np.float32)
    got = g.run(feeds)["out"].astype(np.float32)
    tol = 1e-2 if half == "float16" else 4e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))
    if half == "float16":
        ref = _ort(model, feeds)["out"].astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))
    src = generate_cuda_source([op for op in g.nodes], arch="sm_90")
    kinds = [launch.kind for launch in src.launches.values()]
    assert kinds.count(f"attention-{'f16' if half == 'float16' else 'bf16'}") == 1 and "row" not in kinds, kinds


def _static_cache_step(cmp: str, swap: bool, hide: float, index=None, per_sequence: bool = False,
                       pad: bool = False, rows: int = 1, mul: bool = False):
    """A float16 decoding step's attention over a static cache of 40 rows whose mask hides the
    rows past a runtime ``pos``: ``Where(J cmp pos, 0, hide)`` (``J cmp pos`` written ``pos cmp' J``
    with ``swap``; for ``gt``/``ge`` ``Where(c, hide, 0)``), ``J`` the constant ``index``
    (``arange(40)`` by default); ``pos`` ``[1]``, ``[2, 1, 1, 1]`` (``per_sequence``), or with ``rows``
    queries (a prompt over the cache) one per row, ``[rows, 1]``; with ``pad``
    the test combined with a padding mask input ``pad`` ``[2, 1, 1, 40]`` (``And``, or ``Or`` with its
    negation for ``gt``/``ge``); with ``mul`` (a finite ``hide``) the mask a product,
    ``(1 - Cast(cond)) * hide`` (``Cast(cond) * hide`` for ``gt``/``ge``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    b, h, n, d = 2, 4, 40, 32
    f16 = TensorProto.FLOAT16
    consts = [numpy_helper.from_array(np.arange(n, dtype=np.int64) if index is None else index, "J"),
              numpy_helper.from_array(np.array(0.0, np.float16), "zero"),
              numpy_helper.from_array(np.array(hide, np.float16), "hide"),
              numpy_helper.from_array(np.array(d ** -0.5, np.float16), "c"),
              numpy_helper.from_array(np.array([b, rows, h * d], np.int64), "shape")]
    op = {"le": "LessOrEqual", "lt": "Less", "gt": "Greater", "ge": "GreaterOrEqual"}
    swapped = {"le": "ge", "lt": "gt", "gt": "lt", "ge": "le"}
    compare = helper.make_node(op[swapped[cmp]], ["pos", "J"], ["test"]) if swap else \
        helper.make_node(op[cmp], ["J", "pos"], ["test"])
    combine = [helper.make_node("Identity", ["test"], ["cond"])]
    if pad:
        combine = [helper.make_node("And", ["test", "pad"], ["cond"])] if cmp in ("le", "lt") else \
            [helper.make_node("Not", ["pad"], ["nopad"]), helper.make_node("Or", ["test", "nopad"], ["cond"])]
    where = [helper.make_node("Where", ["cond", "zero", "hide"] if cmp in ("le", "lt") else ["cond", "hide", "zero"],
                              ["bias"])]
    if mul:
        consts.append(numpy_helper.from_array(np.array(1.0, np.float16), "one"))
        where = [helper.make_node("Cast", ["cond"], ["condf"], to=f16)] + (
            [helper.make_node("Sub", ["one", "condf"], ["shown"]), helper.make_node("Mul", ["shown", "hide"], ["bias"])]
            if cmp in ("le", "lt") else [helper.make_node("Mul", ["hide", "condf"], ["bias"])])
    nodes = [compare, *combine, *where, helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"]), helper.make_node("Mul", ["s0", "c"], ["s1"]),
             helper.make_node("Add", ["s1", "bias"], ["s2"]), helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y4"]),
             helper.make_node("Transpose", ["y4"], ["yt"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["yt", "shape"], ["y"]), helper.make_node("Mul", ["y", "c"], ["out"])]
    ins = [helper.make_tensor_value_info(k, f16, sh) for k, sh in (("q", [b, h, rows, d]), ("k", [b, h, n, d]),
                                                                  ("v", [b, h, n, d]))]
    ins.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [b, 1, 1, 1] if per_sequence else
                                             [rows, 1] if rows > 1 else [1]))
    if pad:
        ins.append(helper.make_tensor_value_info("pad", TensorProto.BOOL, [b, 1, 1, n]))
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("out", f16, [b, rows, h * d])], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal(sh).astype(np.float16) for k, sh in (("q", (b, h, rows, d)), ("k", (b, h, n, d)),
                                                                          ("v", (b, h, n, d)))}
    if pad:  # (the second sequence's first 20 rows padding)
        feeds["pad"] = np.ones((b, 1, 1, n), bool)
        feeds["pad"][1, ..., :20] = False
    return model, feeds


@pytest.mark.parametrize("cmp,swap,hide,bound", [
    ("le", False, -np.inf, True), ("lt", False, -np.inf, True), ("gt", False, -np.inf, True),
    ("le", True, -np.inf, True), ("ge", True, float(np.finfo(np.float16).min), True),
    ("le", False, -1.0, False), ("le", False, -np.inf, "reversed"), ("lt", False, -np.inf, "per-sequence"),
    ("le", False, -np.inf, "padded"), ("gt", True, -np.inf, "padded"),
    ("le", False, float(np.finfo(np.float16).min), "padded"), ("le", False, -np.inf, "rows"),
    ("le", False, float(np.finfo(np.float16).min), "rows"), ("le", False, float(np.finfo(np.float16).min), "mul"),
    ("gt", True, float(np.finfo(np.float16).min), "mul")])
def test_a_static_cache_mask_bounds_the_keys(cmp, swap, hide, bound):
    """A mask hiding the cache rows past a runtime position (``j <= pos``, ``j < pos``, ``j > pos``
    hidden, either side of the comparison; ``-inf`` or float16's lowest value; one position for
    the batch, one per sequence, or one per query row of a prompt; beside a padding mask, or per
    row; under a finite lowest value there the bound is 0, every key, for a sequence with a row
    that sees no key below it) gives the fused op a
    key bound (``nonpad_bound``: the kernel
    visits no key block past it) and the same values as the separate ops at every position (the
    first, an inner one, the last, one before the cache: NaN);
    a mask written as a product (``(1 - Cast(j <= pos)) * lowest``, ``Cast(j > pos) * lowest``) too;
    a mask whose hidden value does not hide (-1) or whose index is not ``0..L-1`` gives none
    (the kernel's side: test_cuda_host.py's static cache tests)."""
    index = np.arange(40, dtype=np.int64)[::-1].copy() if bound == "reversed" else None
    model, feeds = _static_cache_step(cmp, swap, hide, index, per_sequence=bound == "per-sequence",
                                      pad=bound == "padded", rows=3 if bound == "rows" else 1, mul=bound == "mul")
    g0 = load_onnx(model)
    g = FuseAttention().run(load_onnx(model))
    (att,) = [op for op in g.nodes if op.op_type == "Attention"]
    bounded = bound in (True, "per-sequence", "padded", "rows", "mul")
    assert bool(att.attrs.get("nonpad_bound")) == bounded, att.attrs
    for pos in (0, 17, 39, -1):
        if hide != -np.inf and pos + (cmp in ("le", "gt")) <= 0:
            continue  # (a row that sees no key: float16's sums round -65504 away, the op's float32 ones do not)
        f = dict(feeds, pos=np.array([pos], np.int64) if bound not in ("per-sequence", "rows") else
                 np.array([pos, 39 - pos], np.int64).reshape(2, 1, 1, 1) if bound == "per-sequence" else
                 np.array([pos - 2, pos - 1, pos], np.int64).reshape(3, 1))
        if hide != -np.inf and bound == "rows" and pos < 2:
            continue  # (a row that sees no key: as above)
        want, got = (x.run(f)["out"].astype(np.float32) for x in (g0, g))
        if hide != -np.inf and bound == "padded" and pos < 20:  # (the padded sequence sees no key: as above)
            want, got = want[:1], got[:1]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-2, atol=1e-2 * float(np.abs(want[ok]).max(initial=1)))
    if bounded:
        assert "const int sf_nkb = (sf_np + 63) / 64;" in generate_cuda_source(list(g.nodes), arch="sm_90").text


HALF_ONNX_ATTENTION = [(case, False) for case in ONNX_ATTENTION] + [("causal-mask-4d", True)]


@pytest.mark.parametrize("case,constant_mask", HALF_ONNX_ATTENTION)
def test_half_onnx_attention_computes_in_float32_and_matches_onnxruntime(case, constant_mask):
    """A float16 ``Attention`` of the model itself (its definition computes in float16) becomes the
    float32 op on the half Q, K, V with a cast of its output (HalfAttentionInFloat32): within
    rfcs/0004's float16 tolerance of onnxruntime's float16 kernel and of the float32 model, and on
    cuda one fused kernel with the output cast and the float16 mask read in its code (no kernel
    of their own)."""
    from shardflow.compiler.codegen.fusion import fuse
    from shardflow.compiler.passes.attention import HalfAttentionInFloat32

    model, feeds = _float16_attention_model(case, constant_mask)
    ref16 = _ort(model, feeds)["out"].astype(np.float32)
    model32, feeds32 = _onnx_attention_model(*ONNX_ATTENTION[case])
    ref32 = _ort(model32, feeds32)["out"]
    g = HalfAttentionInFloat32().run(load_onnx(model))
    g.validate()
    (att,) = [op for op in g.nodes if op.op_type == "Attention"]
    assert [t.dtype for t in att.inputs[:3]] == ["float16"] * 3 and att.outputs[0].dtype == "float32"
    assert att.attrs["acc_dtype"] == "float32" and att.attrs["probs_dtype"] == "float16"
    if att.attrs.get("has_mask"):
        assert att.inputs[3].dtype == "float32" and att.inputs[3].is_constant == constant_mask
    assert g.outputs[0].name == "out" and g.outputs[0].dtype == "float16"
    got = g.run(feeds)["out"].astype(np.float32)
    for ref in (ref16, ref32):
        np.testing.assert_allclose(got, ref, rtol=5e-3, atol=5e-3 * float(np.abs(ref32).max()))
    src = generate_cuda_source(fuse(list(g.nodes), keep=g.output_names), arch="sm_90")
    kinds = [launch.kind for launch in src.launches.values()]
    assert kinds.count("attention-f16") == 1 and "elementwise" not in kinds and "row" not in kinds, kinds


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_which_half_attention_ops_compute_in_float32(half):
    """Q, K, V and the output in one half type, one output, a softmax in the input type or in
    float32: the float32 form (bfloat16 too, its kernel ``attention-bf16``); with the scores as a
    second output (``qk_matmul_output``) or a float64 softmax: as it was."""
    from shardflow.compiler.codegen.fusion import fuse
    from shardflow.compiler.ir.graph import FlowGraph
    from shardflow.compiler.passes.attention import HalfAttentionInFloat32

    def graph(**attrs):
        q, k, v = (Tensor(n, (1, 2, 24, 32), half) for n in "qkv")
        m = Tensor("m", (24, 24), half)
        op = Attention([q, k, v, m], name="att", has_mask=True, scale_sqrt=0.5, **attrs)
        return FlowGraph([q, k, v, m], list(op.outputs))

    for attrs in ({}, {"softmax_dtype": "float32"}):
        g = HalfAttentionInFloat32().run(graph(**attrs))
        g.validate()
        assert [op.op_type for op in g.nodes] == ["Cast", "Attention", "Cast"]
        assert g.nodes[1].attrs["scale"] == 0.25 and g.nodes[1].attrs["softmax_dtype"] is None
        src = generate_cuda_source(fuse(list(g.nodes), keep=g.output_names), arch="sm_90")
        assert [launch.kind for launch in src.launches.values()] == [f"attention-{_MMA_NAME[half]}"]
    for attrs in ({"softmax_dtype": "float64"}, {"qk_mode": 0}):
        g = HalfAttentionInFloat32().run(graph(**attrs))
        assert [op.op_type for op in g.nodes] == ["Attention"]


_MMA_NAME = {"float16": "f16", "bfloat16": "bf16"}


def _hand_written_attention(scale_op: str, bias_left: bool, k_transposed: bool, d: int = 32):
    """softmax(Q K^T / 4 + bias) V on half inputs, written out as the precision pass leaves it."""
    from shardflow.compiler.ir import const_tensor
    from shardflow.compiler.ir.graph import FlowGraph
    from shardflow.compiler.ops.elementwise import Binary, CastOp
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.ops.reduce import Softmax
    from shardflow.compiler.ops.transform import Transpose

    q, v = Tensor("q", (2, 3, 40, d), "float16"), Tensor("v", (2, 3, 70, 16), "float16")
    k = Tensor("k", (2, 3, 70, d) if k_transposed else (2, 3, d, 70), "float16")
    bias = Tensor("bias", (2, 1, 40, 70), "float32")
    ops = []

    def add(op):
        ops.append(op)
        return op.outputs[0]
    kt = add(Transpose([k], name="kt", perm=(0, 1, 3, 2))) if k_transposed else k
    s = add(MatMul([add(CastOp([q], name="q32", to="float32")), add(CastOp([kt], name="k32", to="float32"))],
                   name="qk"))
    c = const_tensor(np.array(4.0 if scale_op == "div" else 0.25, np.float32))
    s = add(Binary([s, c], name="scale", fn=scale_op))
    s = add(Binary([bias, s] if bias_left else [s, bias], name="mask", fn="add"))
    p = add(Softmax([s], name="sm", axes=(3,)))
    p = add(CastOp([add(CastOp([p], name="p16", to="float16"))], name="p32", to="float32"))
    y = add(MatMul([p, add(CastOp([v], name="v32", to="float32"))], name="pv"))
    return FlowGraph([q, k, v, bias], [add(Binary([y, const_tensor(np.float32(1.0))], name="out", fn="mul"))])


@pytest.mark.parametrize("scale_op,bias_left", [("div", True), ("mul", False)])
def test_hand_written_attention_is_fused_and_compiles(scale_op, bias_left):
    """Div or Mul by the scale, the mask on either side of the Add, Kᵀ a transpose of K (the op
    reads K) or Kᵀ stored as such (the op reads a transposed copy of it, head dim contiguous for
    the kernel): fused, same values, and the cuda code takes the fused kernel. Head sizes the
    kernel does not take are left alone."""
    # a head size the fused kernel does not take (not a multiple of 8): the separate ops stay
    g = _hand_written_attention("div", False, True, d=20)
    assert "Attention" not in [op.op_type for op in FuseAttention().run(g).nodes]
    rng = np.random.default_rng(7)
    k_transposed = scale_op == "div"
    g = _hand_written_attention(scale_op, bias_left, k_transposed)
    feeds = {"q": rng.standard_normal((2, 3, 40, 32)).astype(np.float16),
             "k": rng.standard_normal((2, 3, 70, 32) if k_transposed else (2, 3, 32, 70)).astype(np.float16),
             "v": rng.standard_normal((2, 3, 70, 16)).astype(np.float16),
             "bias": np.where(rng.random((2, 1, 40, 70)) > 0.3, 0, -np.inf).astype(np.float32)}
    want = g.run(feeds)
    g = FuseAttention().run(g)
    assert [op.op_type for op in g.nodes].count("Attention") == 1 and "Softmax" not in [op.op_type for op in g.nodes]
    got = g.run(feeds)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w)
    from shardflow.compiler.codegen.cuda import kernel_groups
    groups = kernel_groups(list(g.nodes), "sm_90", keep=[t.name for t in g.outputs])
    src = generate_cuda_source(groups, arch="sm_90")
    assert [launch.kind for launch in src.launches.values()].count("attention-f16") == 1, src.launches
    # (Kᵀ stored as such: K's rows a transposed copy of it, written by its own kernel, by tiles)
    assert ("transpose" in [launch.kind for launch in src.launches.values()]) == (not k_transposed)


@pytest.mark.parametrize("model,fused,mesh", [("gpt2_ts17", 2, [1]), ("bert_dynamo18", 2, [1]), ("llama_ts17", 2, [1]),
                                              ("gpt2_ts17", 2, [2]), ("t5_encoder_ts17", 2, [1]),
                                              ("t5_encoder_dynamo18", 2, [2])])
def test_float32_attention_on_the_cpu_is_one_op_and_matches_onnxruntime(tmp_path, model, fused, mesh):
    """The cpu target at float32 fuses each MatMul/Softmax/MatMul attention (a padding mask as its one bias;
    T5's position bias, then its mask: two) into an ``Attention`` step of the cpu template, on each rank's
    share of the heads. Outputs equal onnxruntime's."""
    from threads import run_ranks

    feeds, want = onnxruntime_reference(model)
    out = tmp_path / "o"
    compile(MODELS / f"{model}.onnx", distributed_config={"mesh_shape": mesh, "algo": "megatron"},
            optimization_config={"target": "cpu"}, out_dir=out)
    for r in range(mesh[0]):
        program = json.loads((out / f"rank{r}" / "program.json").read_text())
        ops = [st.get("node", "") for st in program["steps"] if st["kind"] == "kernel"]
        assert sum(n.endswith(".attention") for n in ops) == fused, ops
        assert fused == 0 or not any("Softmax" in n for n in ops), ops
    got = run_ranks(out, feeds, world=mesh[0])
    for res in got:
        for name, w in want.items():
            np.testing.assert_allclose(res[name], w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()), err_msg=name)


def _float32_attention(bias_shape=(2, 1, 40, 70), biases=None, shapes=(), fill=None, keep=False, clamp=None,
                       scale=None):
    """softmax(Q Kᵀ · 0.25 + bias) V on float32 [2, 3, *, 32] operands, written out as exporters do
    (``scale``: a float32 array instead of 0.25)
    (``biases`` of ``bias_shape`` added in turn, one by default, or one of each of ``shapes``); with
    ``fill``, the scores first filled where a boolean ``hidden`` of ``bias_shape`` is true, ``Where(hidden,
    fill, s)`` (DeBERTa's ``masked_fill`` with ``finfo.min``), or (``keep``) kept where a boolean
    ``shown`` is, ``Where(shown, s, fill)`` (GPT-Neo's causal ``where``), no bias by default; with
    ``clamp``, the sum then clamped from below, ``Max(s, clamp)`` (XGLM's)."""
    from shardflow.compiler.ir import const_tensor
    from shardflow.compiler.ir.graph import FlowGraph
    from shardflow.compiler.ops.elementwise import Binary, Where
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.ops.reduce import Softmax
    from shardflow.compiler.ops.transform import Transpose

    q, k, v = Tensor("q", (2, 3, 40, 32), "float32"), Tensor("k", (2, 3, 70, 32), "float32"), \
        Tensor("v", (2, 3, 70, 16), "float32")
    biases = (0 if fill is not None else 1) if biases is None else biases
    biases = [Tensor("bias" + (str(i + 1) if i else ""), sh, "float32")
              for i, sh in enumerate(shapes or [bias_shape] * biases)]
    hidden = [Tensor("shown" if keep else "hidden", bias_shape, "bool")] if fill is not None else []
    ops = []

    def add(op):
        ops.append(op)
        return op.outputs[0]
    s = add(MatMul([q, add(Transpose([k], name="kt", perm=(0, 1, 3, 2)))], name="qk"))
    s = add(Binary([s, const_tensor(np.array(0.25 if scale is None else scale, np.float32))], name="scale", fn="mul"))
    if hidden:
        h = const_tensor(np.float32(fill))
        s = add(Where([hidden[0], s, h] if keep else [hidden[0], h, s], name="fill"))
    for i, bias in enumerate(biases):
        s = add(Binary([s, bias], name=f"mask{i}", fn="add"))
    if clamp is not None:
        s = add(Binary([s, const_tensor(np.float32(clamp))], name="clamp", fn="max"))
    y = add(MatMul([add(Softmax([s], name="sm", axes=(3,))), v], name="pv"))
    return FlowGraph([q, k, v] + hidden + biases, [add(Binary([y, const_tensor(np.float32(2.0))], name="out",
                                                               fn="mul"))])


def test_float32_attention_keeps_the_softmax_values_and_nan_rows(tmp_path):
    """FuseAttention(float32=True): one op whose reference values are the separate ops' (the scale after the
    sum, the bias after the scale), compiled for the cpu to the same values up to rounding; a query row whose
    bias hides every key is NaN as the Softmax makes it (ONNX Attention's own mask rule would give 0). Two
    biases (a position bias broadcast over the batch, then a mask) likewise; three keep the separate ops (the
    cpu template adds two)."""
    from shardflow.runtime import load

    rng = np.random.default_rng(3)
    g = _float32_attention()
    bias = np.where(rng.random((2, 1, 40, 70)) > 0.3, 0, -np.inf).astype(np.float32)
    bias[1, 0, 5] = -np.inf  # every key of a row hidden
    feeds = {"q": rng.standard_normal((2, 3, 40, 32)).astype(np.float32),
             "k": rng.standard_normal((2, 3, 70, 32)).astype(np.float32),
             "v": rng.standard_normal((2, 3, 70, 16)).astype(np.float32), "bias": bias}
    want = next(iter(g.run(feeds).values()))
    assert np.isnan(want[1, :, 5]).all() and not np.isnan(np.delete(want, 5, axis=2)).any()
    fused = FuseAttention(float32=True).run(g)
    assert [op.op_type for op in fused.nodes] == ["Attention", "Binary"]
    np.testing.assert_allclose(next(iter(fused.run(feeds).values())), want, rtol=1e-5, atol=1e-6, equal_nan=True)
    compile(_float32_attention(), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "o")
    program = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    assert [st["node"] for st in program["steps"] if st["kind"] == "kernel"] == ["pv.attention", "out"]
    got = next(iter(load(tmp_path / "o", 0).run(feeds).values()))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    feeds["bias2"] = bias
    feeds["bias"] = (4 * rng.standard_normal((1, 3, 40, 70))).astype(np.float32)
    two = [(1, 3, 40, 70), (2, 1, 40, 70)]
    want = next(iter(_float32_attention(shapes=two).run(feeds).values()))
    assert np.isnan(want[1, :, 5]).all() and not np.isnan(np.delete(want, 5, axis=2)).any()
    compile(_float32_attention(shapes=two), distributed_config={"mesh_shape": [1]},
            optimization_config={"target": "cpu"}, out_dir=tmp_path / "o2")
    program = json.loads((tmp_path / "o2" / "rank0" / "program.json").read_text())
    assert [st["node"] for st in program["steps"] if st["kind"] == "kernel"] == ["pv.attention", "out"]
    got = next(iter(load(tmp_path / "o2", 0).run(feeds).values()))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert "Attention" not in [op.op_type for op in FuseAttention(float32=True).run(_float32_attention(
        biases=3)).nodes]


def _sdpa_export(form: str, hk: int, b=2, s=40, l_len=70, h=4, d=32, half=False):
    """Attention as torch exports ``scaled_dot_product_attention`` with a boolean mask (transformers'
    default attention): Q and Kᵀ each scaled by the scale's square root, the mask as ``Where(m, 0,
    -inf)``, and the probabilities of a row that sees no key (NaN) made 0, ``Where(IsNaN(p), 0,
    p)``; ``hk`` KV heads (4: as many as the queries', 2: repeated by ``Reshape(Expand(Reshape))``,
    1: broadcast by the products, multi-query); Kᵀ by a 4-D transpose (``ts17``) or by the dynamo
    exporter's ``Reshape(Transpose(Reshape(k, [B*H, L, D]), (0, 2, 1)), [B, H, D, L])``. ``half``:
    a float16 model as the TorchScript exporter writes it, its scaled Q, Kᵀ and their product
    float16, the scores cast to float32 before the mask, the float32 probabilities times V cast
    to float32 (the output float32); ``half="widened"``: the scaled Q, Kᵀ and V widened to float32
    before the products, the rest float32."""
    from shardflow.compiler.ir.graph import FlowGraph, const_tensor
    from shardflow.compiler.ops.elementwise import Binary, CastOp, Unary, Where
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.ops.reduce import Softmax
    from shardflow.compiler.ops.transform import Expand, Reshape, Transpose

    ops = []

    def add(op):
        ops.append(op)
        return op.outputs[0]
    dt = "float16" if half else "float32"
    xq, xk, xv = (Tensor(n, (b, n_, w), dt)
                  for n, n_, w in (("xq", s, h * d), ("xk", l_len, hk * d), ("xv", l_len, hk * d)))
    mask = Tensor("mask", (b, 1, s, l_len), "bool")

    def heads(x, n, name):
        return add(Transpose([add(Reshape([x], name=f"{name}.split", shape=(b, x.shape[1], n, d)))], name=f"{name}.t",
                             perm=(0, 2, 1, 3)))
    q, k, v = heads(xq, h, "q"), heads(xk, hk, "k"), heads(xv, hk, "v")
    kh = h if hk > 1 else 1  # (K's heads as the products see them)
    if 1 < hk < h:  # repeat_kv
        k5, v5 = ((add(Expand([add(Reshape([t], name=f"{n}.unsq", shape=(b, hk, 1, l_len, d)))], name=f"{n}.expand",
                               shape=(b, hk, h // hk, l_len, d)))) for t, n in ((k, "k"), (v, "v")))
        v = add(Reshape([v5], name="v.rep", shape=(b, h, l_len, d)))
        k = k5 if form == "dynamo18" else add(Reshape([k5], name="k.rep", shape=(b, h, l_len, d)))
    if form == "ts17":
        kt = add(Transpose([k], name="kt", perm=(0, 1, 3, 2)))
    else:
        rows = add(Reshape([k], name="k.rows", shape=(b * kh, l_len, d)))
        kt = add(Reshape([add(Transpose([rows], name="kt3", perm=(0, 2, 1)))], name="kt", shape=(b, kh, d, l_len)))
    c = const_tensor(np.dtype(dt).type(d ** -0.25))
    qs, ks = add(Binary([q, c], name="qs", fn="mul")), add(Binary([kt, c], name="ks", fn="mul"))
    if half == "widened":
        qs, ks = (add(CastOp([t], name=f"{t.name}.float32", to="float32")) for t in (qs, ks))
    scores = add(MatMul([qs, ks], name="qk"))
    if half is True:
        scores = add(CastOp([scores], name="qk.float32", to="float32"))
    if half:
        v = add(CastOp([v], name="v.float32", to="float32"))
    bias = add(Where([mask, const_tensor(np.zeros(1, np.float32)), const_tensor(np.full(1, -np.inf, np.float32))],
                     name="bias"))
    p = add(Softmax([add(Binary([scores, bias], name="masked", fn="add"))], name="sm", axes=(3,)))
    p = add(Where([add(Unary([p], name="isnan", fn="isnan")), const_tensor(np.zeros(1, np.float32)), p], name="guard"))
    y = add(MatMul([p, v], name="pv"))
    out = add(Reshape([add(Transpose([y], name="y.t", perm=(0, 2, 1, 3)))], name="merge", shape=(b, s, h * d)))
    return FlowGraph([xq, xk, xv, mask], [add(Binary([out, const_tensor(np.float32(2.0))], name="out", fn="mul"))])


@pytest.mark.parametrize("form", ["ts17", "dynamo18"])
@pytest.mark.parametrize("hk", [4, 2, 1])
def test_sdpa_exports_fuse_with_their_nan_guard(form, hk):
    """torch's export of ``scaled_dot_product_attention`` becomes one Attention (the cuda target's
    float32 form, and the half form after the precision pass): Q's scaling stays Q's producer, Kᵀ's
    is redone on K's rows (bit for bit: a scalar product commutes with the transpose), the grouped or
    single KV heads are read as such, and the mask is the op's mask, whose rule (0 for a row that
    sees no key) is the guard's. Values as the separate ops', the hidden row 0."""
    rng = np.random.default_rng(5)
    mask = rng.random((2, 1, 40, 70)) > 0.3
    mask[1, 0, 5] = False  # a row that sees no key
    feeds = {"xq": rng.standard_normal((2, 40, 128)).astype(np.float32), "mask": mask,
             "xk": rng.standard_normal((2, 70, hk * 32)).astype(np.float32),
             "xv": rng.standard_normal((2, 70, hk * 32)).astype(np.float32)}
    want = next(iter(_sdpa_export(form, hk).run(feeds).values()))
    assert (want[1, 5] == 0).all() and not np.isnan(want).any()
    fused = FuseAttention(float32=True, target="cuda").run(_sdpa_export(form, hk))
    (att,) = [op for op in fused.nodes if op.op_type == "Attention"]
    assert att.attrs["has_mask"] and att.attrs["kv_heads"] == hk and att.attrs["extra_biases"] == 0
    assert not {"Softmax", "MatMul"} & {op.op_type for op in fused.nodes}
    np.testing.assert_allclose(next(iter(fused.run(feeds).values())), want, rtol=1e-5, atol=1e-5)
    half = FuseAttention().run(HalfPrecisionContractions("float16").run(_sdpa_export(form, hk)))
    (att,) = [op for op in half.nodes if op.op_type == "Attention"]
    assert att.attrs["probs_dtype"] == "float16" and att.inputs[1].dtype == "float16"
    np.testing.assert_allclose(next(iter(half.run(feeds).values())), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", ["ts17", "dynamo18"])
@pytest.mark.parametrize("hk", [4, 2, 1])
def test_half_sdpa_export_with_float32_softmax_fuses(form, hk):
    """A float16 model's ``scaled_dot_product_attention`` as the TorchScript exporter writes it:
    half scores widened to float32, a float32 softmax and P·V with V widened. One Attention on the
    half Q, K, V (the probabilities rounded to float16, as a fused kernel's tensor-core product
    does: rfcs/0005 decision 44), as the graph is (the cuda target at float32) and after the
    precision pass (which rounds P and widened V); a float32 attention that only reads V widened
    is left alone (its probabilities are not the model's to round)."""
    rng = np.random.default_rng(6)
    mask = rng.random((2, 1, 40, 70)) > 0.3
    mask[1, 0, 5] = False
    feeds = {"xq": rng.standard_normal((2, 40, 128)).astype(np.float16), "mask": mask,
             "xk": rng.standard_normal((2, 70, hk * 32)).astype(np.float16),
             "xv": rng.standard_normal((2, 70, hk * 32)).astype(np.float16)}
    want = next(iter(_sdpa_export(form, hk, half=True).run(feeds).values()))
    assert want.dtype == np.float32 and (want[1, 5] == 0).all() and not np.isnan(want).any()
    for graph in (_sdpa_export(form, hk, half=True),
                  HalfPrecisionContractions("float16").run(_sdpa_export(form, hk, half=True))):
        fused = FuseAttention().run(graph)
        (att,) = [op for op in fused.nodes if op.op_type == "Attention"]
        assert att.attrs["probs_dtype"] == "float16" and att.attrs["has_mask"] and att.attrs["kv_heads"] == hk
        assert [t.dtype for t in att.inputs[:3]] == ["float16"] * 3 and att.outputs[0].dtype == "float32"
        assert not {"Softmax", "MatMul", "Cast"} & {op.op_type for op in fused.nodes}
        np.testing.assert_allclose(next(iter(fused.run(feeds).values())), want, rtol=5e-3, atol=5e-3)
    assert "Attention" not in {op.op_type for op in FuseAttention().run(_sdpa_export(form, hk, half="widened")).nodes}


def _alibi_attention(form: str, b=2, h=4, s=24, d=32, heads_out=False):
    """BLOOM's attention as torch exports it: ``baddbmm`` on ``[B*H, ..]`` tensors, ``Q Kᵀ ·
    scale + alibi`` (alibi ``[B*H, 1, L]``, a runtime input here), viewed ``[B, H, S, L]`` for the
    mask and the softmax; the probabilities viewed back to ``[B*H, S, L]`` for the product with V
    and its result viewed ``[B, H, S, D]`` (``ts17``), or that product on the 4-D views already
    (``dynamo18``, as onnxscript's optimizer leaves it). ``heads_out``: its ``[B, H, S, D]`` result
    a graph output too."""
    from shardflow.compiler.ir.graph import FlowGraph, const_tensor
    from shardflow.compiler.ops.elementwise import Binary
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.ops.reduce import Softmax
    from shardflow.compiler.ops.transform import Reshape, Transpose

    q4, k4, v4 = (Tensor(n, (b, h, s, d), "float32") for n in "qkv")
    alibi, mask = Tensor("alibi", (b * h, 1, s), "float32"), Tensor("mask", (b, 1, s, s), "float32")
    ops = []

    def add(op):
        ops.append(op)
        return op.outputs[0]
    q3, k3, v3 = (add(Reshape([t], name=f"{t.name}.3d", shape=(b * h, s, d))) for t in (q4, k4, v4))
    kt3 = add(Transpose([k3], name="kt", perm=(0, 2, 1)))
    s3 = add(Binary([add(MatMul([q3, kt3], name="qk")), const_tensor(np.float32(d ** -0.5))], name="scale", fn="mul"))
    s3 = add(Binary([s3, alibi], name="alibi.add", fn="add"))
    s4 = add(Binary([add(Reshape([s3], name="scores.4d", shape=(b, h, s, s))), mask], name="mask.add", fn="add"))
    p4 = add(Softmax([s4], name="sm", axes=(3,)))
    if form == "ts17":
        y = add(Reshape([add(MatMul([add(Reshape([p4], name="p.3d", shape=(b * h, s, s))), v3], name="pv"))],
                        name="y.4d", shape=(b, h, s, d)))
    else:
        y = add(MatMul([p4, v4], name="pv"))
    out = add(Reshape([add(Transpose([y], name="y.t", perm=(0, 2, 1, 3)))], name="merge", shape=(b, s, h * d)))
    return FlowGraph([q4, k4, v4, alibi, mask], [add(Binary([out, const_tensor(np.float32(2.0))], name="out",
                                                             fn="mul"))] + ([y] if heads_out else []))


@pytest.mark.parametrize("form", ["ts17", "dynamo18"])
def test_alibi_attention_on_batched_heads_fuses(form):
    """BLOOM's ``[B*H, ..]`` attention is written on its ``[B, H, ..]`` views (AttentionOnHeads,
    the same values), then fuses: one Attention with the ALiBi bias and the mask as its two biases,
    in float32 (the cuda target's) and after the precision pass (which the cuda driver runs after
    the views are taken)."""
    from shardflow.compiler.passes.attention import AttentionOnHeads

    rng = np.random.default_rng(8)
    feeds = {n: rng.standard_normal((2, 4, 24, 32)).astype(np.float32) for n in "qkv"}
    feeds["alibi"] = (rng.standard_normal((8, 1, 24)) * 3).astype(np.float32)
    feeds["mask"] = np.where(np.tril(np.ones((24, 24))) > 0, 0, np.finfo(np.float32).min).astype(np.float32)[
        None, None].repeat(2, 0)
    want = next(iter(_alibi_attention(form).run(feeds).values()))
    lifted = AttentionOnHeads().run(_alibi_attention(form))
    assert [op.name for op in lifted.nodes if op.op_type in ("MatMul", "Binary") and op.outputs[0].ndim == 3] == ["out"]
    np.testing.assert_allclose(next(iter(lifted.run(feeds).values())), want, rtol=1e-6, atol=1e-6)
    fused = FuseAttention(float32=True, target="cuda").run(_alibi_attention(form))
    (att,) = [op for op in fused.nodes if op.op_type == "Attention"]
    assert att.attrs["extra_biases"] == 2 and att.inputs[3].shape == (2, 4, 1, 24) and not att.attrs.get("has_mask")
    assert not {"Softmax", "MatMul"} & {op.op_type for op in fused.nodes}
    np.testing.assert_allclose(next(iter(fused.run(feeds).values())), want, rtol=1e-5, atol=1e-5)
    exposed = AttentionOnHeads().run(_alibi_attention(form, heads_out=True))  # (outputs keep their names)
    assert [t.name for t in exposed.outputs] == [t.name for t in _alibi_attention(form, heads_out=True).outputs]
    half = FuseAttention().run(HalfPrecisionContractions("float16").run(AttentionOnHeads().run(_alibi_attention(form))))
    (att,) = [op for op in half.nodes if op.op_type == "Attention"]
    assert att.attrs["probs_dtype"] == "float16" and att.inputs[0].dtype == "float16"
    np.testing.assert_allclose(next(iter(half.run(feeds).values())), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", ["fill", "keep", "clamp"])
def test_masked_fill_of_the_scores_fuses_as_a_bias(tmp_path, form):
    """Scores filled with ``finfo.min`` where a mask hides them are the scores plus ``Where(hidden,
    min, 0)`` (``s + min`` rounds to ``min``), an added bias both targets fuse: the same values,
    a row whose every key is hidden uniform over its keys (the mean of V) as the separate ops give
    it. Likewise scores kept where a mask shows them, ``Where(shown, s, min)``, with a bias added
    after (GPT-Neo's causal ``where``, then its padding mask), and a sum clamped from below by
    ``min``, ``Max(s + bias, min)`` (XGLM's), the clamp dropped. A fill above -1e30 (where
    ``s + h`` is not ``h``) keeps the separate ops, and so does a clamp at -1e4."""
    from shardflow.runtime import load

    rng = np.random.default_rng(9)
    hidden = rng.random((2, 1, 40, 70)) > 0.7
    hidden[1, 0, 3] = True  # a row that sees no key
    feeds = {"q": rng.standard_normal((2, 3, 40, 32)).astype(np.float32),
             "k": rng.standard_normal((2, 3, 70, 32)).astype(np.float32),
             "v": rng.standard_normal((2, 3, 70, 16)).astype(np.float32)}
    fill = float(np.finfo(np.float32).min)
    kw = {"fill": dict(fill=fill), "keep": dict(fill=fill, keep=True, biases=1), "clamp": dict(clamp=fill)}[form]
    if form == "fill":
        feeds["hidden"] = hidden
    elif form == "keep":  # (the padding mask hides some keys, none of the hidden row's: min + min is -inf)
        feeds.update(shown=~hidden, bias=np.where(rng.random((2, 1, 40, 70)) > 0.1, 0, fill).astype(np.float32))
        feeds["bias"][1, 0, 3] = 0
    else:
        feeds["bias"] = np.where(hidden, fill, 0).astype(np.float32)
    want = next(iter(_float32_attention(**kw).run(feeds).values()))
    np.testing.assert_allclose(want[1, :, 3], 2 * feeds["v"][1].mean(axis=1), rtol=1e-5, atol=1e-6)
    fused = FuseAttention(float32=True, target="cuda").run(_float32_attention(**kw))
    (att,) = [op for op in fused.nodes if op.op_type == "Attention"]
    assert att.attrs["extra_biases"] == (2 if form == "keep" else 1) and att.inputs[3].shape == (2, 1, 40, 70)
    assert "Max" not in {op.op_type for op in fused.nodes} or form != "clamp"
    np.testing.assert_allclose(next(iter(fused.run(feeds).values())), want, rtol=1e-5, atol=1e-6)
    compile(_float32_attention(**kw), distributed_config={"mesh_shape": [1]},
            optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    program = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    assert "pv.attention" in [st["node"] for st in program["steps"] if st["kind"] == "kernel"]
    np.testing.assert_allclose(next(iter(load(tmp_path / "o", 0).run(feeds).values())), want, rtol=1e-5, atol=1e-5)
    kept = dict(kw, fill=-1e4) if form != "clamp" else dict(kw, clamp=-1e4)
    assert "Attention" not in {op.op_type for op in FuseAttention(float32=True, target="cuda").run(
        _float32_attention(**kept)).nodes}


def test_soft_capped_scores_fuse(tmp_path):
    """Gemma 2's eager attention: ``tanh(s * scale / cap) * cap`` before the mask is the op's
    ``softcap`` (the same operations in the same order), on both targets; the cpu program's values
    are the separate ops'."""
    from shardflow.compiler.ir.graph import FlowGraph, const_tensor
    from shardflow.compiler.ops.elementwise import Binary, Unary
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.ops.reduce import Softmax
    from shardflow.compiler.ops.transform import Transpose
    from shardflow.runtime import load

    def graph():
        q, k, v = Tensor("q", (2, 4, 24, 32), "float32"), Tensor("k", (2, 4, 24, 32), "float32"), \
            Tensor("v", (2, 4, 24, 32), "float32")
        bias = Tensor("bias", (2, 1, 24, 24), "float32")
        ops = []

        def add(op):
            ops.append(op)
            return op.outputs[0]
        s = add(MatMul([q, add(Transpose([k], name="kt", perm=(0, 1, 3, 2)))], name="qk"))
        s = add(Binary([s, const_tensor(np.float32(0.125))], name="scale", fn="mul"))
        s = add(Binary([s, const_tensor(np.float32(3.0))], name="cap.div", fn="div"))
        s = add(Binary([const_tensor(np.float32(3.0)), add(Unary([s], name="cap.tanh", fn="tanh"))], name="cap.mul",
                       fn="mul"))
        s = add(Binary([s, bias], name="mask", fn="add"))
        y = add(MatMul([add(Softmax([s], name="sm", axes=(3,))), v], name="pv"))
        return FlowGraph([q, k, v, bias], [add(Binary([y, const_tensor(np.float32(2.0))], name="out", fn="mul"))])
    rng = np.random.default_rng(7)
    feeds = {n: (4 * rng.standard_normal((2, 4, 24, 32))).astype(np.float32) for n in "qkv"}
    feeds["bias"] = np.where(np.tril(np.ones((24, 24))) > 0, 0, -np.inf).astype(np.float32)[None, None].repeat(2, 0)
    want = next(iter(graph().run(feeds).values()))
    for target in ("cpu", "cuda"):
        fused = FuseAttention(float32=True, target=target).run(graph())
        (att,) = [op for op in fused.nodes if op.op_type == "Attention"]
        assert att.attrs["softcap"] == 3.0 and att.attrs["scale"] == 0.125
        np.testing.assert_allclose(next(iter(fused.run(feeds).values())), want, rtol=1e-6, atol=1e-6)
    compile(graph(), distributed_config={"mesh_shape": [1]}, out_dir=tmp_path / "o")
    program = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    assert "pv.attention" in [st["node"] for st in program["steps"] if st["kind"] == "kernel"]
    np.testing.assert_allclose(next(iter(load(tmp_path / "o", 0).run(feeds).values())), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,moved", [((3, 1, 1), True), ((1, 3, 1, 1), True), ((1, 1, 40, 1), False),
                                         ((3, 40, 1), False)])
def test_a_scale_per_head_moves_onto_the_queries(tmp_path, shape, moved):
    """Swin V2's cosine attention: the scores times a constant with one value per head (its learned
    temperature), ``[H, 1, 1]`` or ``[1, H, 1, 1]``, then a bias: the scale is moved onto Q
    (``MatMul(q * c, kᵀ)``) and the attention fuses on both targets with scale 1, values within
    float32's rounding of the separate ops'; a constant that varies along the queries stays where
    it is (the separate ops)."""
    from shardflow.runtime import load

    rng = np.random.default_rng(8)
    c = (1 + 9 * rng.random(shape)).astype(np.float32)

    def graph():
        return _float32_attention((1, 3, 40, 70), scale=c)
    feeds = {"q": rng.standard_normal((2, 3, 40, 32)).astype(np.float32) / 4,
             "k": rng.standard_normal((2, 3, 70, 32)).astype(np.float32) / 4,
             "v": rng.standard_normal((2, 3, 70, 16)).astype(np.float32),
             "bias": rng.standard_normal((1, 3, 40, 70)).astype(np.float32)}
    want = next(iter(graph().run(feeds).values()))
    for target in ("cpu", "cuda"):
        fused = FuseAttention(float32=True, target=target).run(graph())
        att = [op for op in fused.nodes if op.op_type == "Attention"]
        assert len(att) == moved, [op.op_type for op in fused.nodes]
        if moved:
            assert att[0].attrs["scale"] == 1.0 and att[0].inputs[0].name == "scale.q:0"
        np.testing.assert_allclose(next(iter(fused.run(feeds).values())), want, rtol=1e-5, atol=1e-5)
    compile(graph(), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "o")
    np.testing.assert_allclose(next(iter(load(tmp_path / "o", 0).run(feeds).values())), want, rtol=1e-5, atol=1e-5)


def _time_major_attention(bias_first: bool, b=2, s=20, l_len=30, h=4, d=16):
    """Attention as torch's ``multi_head_attention_forward`` writes it (``nn.MultiheadAttention``
    with its default ``need_weights=True``, WavLM): time-major ``x [S, B, H*D]`` split into heads
    ``[B*H, S, D]`` by ``Transpose(Reshape(x, [S, B*H, D]), (1, 0, 2))``, Q scaled, Kᵀ ``Transpose(
    Reshape(k, [L, B*H, D]), (1, 2, 0))``, the scores as ``baddbmm`` exports them, ``s * 1 + bias *
    1`` with a bias ``[B*H, S, L]`` (on either side of the addition), a softmax of the 3-D scores,
    P·V and the heads merged back time-major ``[S*B, H*D]``."""
    from shardflow.compiler.ir.graph import FlowGraph, const_tensor
    from shardflow.compiler.ops.elementwise import Binary
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.ops.reduce import Softmax
    from shardflow.compiler.ops.transform import Reshape, Transpose

    ops = []

    def add(op):
        ops.append(op)
        return op.outputs[0]
    xq, xk, xv = Tensor("xq", (s, b, h * d), "float32"), Tensor("xk", (l_len, b, h * d), "float32"), \
        Tensor("xv", (l_len, b, h * d), "float32")
    bias = Tensor("bias", (b * h, s, l_len), "float32")

    def heads(x, name, perm):
        return add(Transpose([add(Reshape([x], name=f"{name}.split", shape=(x.shape[0], b * h, d)))], name=f"{name}.t",
                             perm=perm))
    q = add(Binary([heads(xq, "q", (1, 0, 2)), const_tensor(np.float32(d ** -0.5))], name="q.scaled", fn="mul"))
    one = const_tensor(np.float32(1.0))
    scores = add(Binary([add(MatMul([q, heads(xk, "k", (1, 2, 0))], name="qk")), one], name="alpha", fn="mul"))
    masked = add(Binary([bias, one], name="beta", fn="mul"))
    s3 = add(Binary([masked, scores] if bias_first else [scores, masked], name="baddbmm", fn="add"))
    y = add(MatMul([add(Softmax([s3], name="sm", axes=(2,))), heads(xv, "v", (1, 0, 2))], name="pv"))
    merged = add(Reshape([add(Transpose([y], name="y.t", perm=(1, 0, 2)))], name="merge", shape=(s * b, h * d)))
    return FlowGraph([xq, xk, xv, bias], [add(Binary([merged, const_tensor(np.float32(2.0))], name="out", fn="mul"))])


@pytest.mark.parametrize("bias_first", [False, True])
def test_time_major_heads_fuse(tmp_path, bias_first):
    """``nn.MultiheadAttention``'s export (:func:`_time_major_attention`): the softmax and both
    products are computed on the ``[B, H, ..]`` views, K's rows are a transpose of its time-major
    ``[L, B*H, D]`` form, and the attention fuses on both targets (the ``[B*H, S, L]`` bias viewed
    per head) with the separate ops' values; the cpu program too."""
    from shardflow.compiler.codegen.cuda import kernel_groups
    from shardflow.compiler.driver import _is_view
    from shardflow.runtime import load

    rng = np.random.default_rng(10)
    feeds = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in
             (("xq", (20, 2, 64)), ("xk", (30, 2, 64)), ("xv", (30, 2, 64)))}
    feeds["bias"] = np.where(rng.random((8, 20, 30)) > 0.2, rng.standard_normal((8, 20, 30)), -np.inf).astype(
        np.float32)
    feeds["bias"][:, :, 0] = 0.0  # (every row sees a key)
    want = next(iter(_time_major_attention(bias_first).run(feeds).values()))
    for target in ("cpu", "cuda"):
        fused = FuseAttention(float32=True, target=target).run(_time_major_attention(bias_first))
        (att,) = [op for op in fused.nodes if op.op_type == "Attention"]
        assert "Softmax" not in {op.op_type for op in fused.nodes}
        assert att._geometry(*att.inputs[:3]) == (2, 4, 4, 20, 30, 16, 16)
        np.testing.assert_allclose(next(iter(fused.run(feeds).values())), want, rtol=1e-5, atol=1e-5)
        if target == "cuda":  # (grouped as the build groups it: the views read by the kernel)
            groups = kernel_groups(list(fused.nodes), "sm_90", keep=[t.name for t in fused.outputs],
                                   views=[op.name for op in fused.nodes if _is_view(op)])
            kinds = [la.kind for la in generate_cuda_source(groups, arch="sm_90").launches.values()]
            assert kinds.count("attention-f32") == 1, kinds
    compile(_time_major_attention(bias_first), distributed_config={"mesh_shape": [1]},
            optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    program = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    assert any(st.get("node", "").endswith(".attention") for st in program["steps"] if st["kind"] == "kernel")
    np.testing.assert_allclose(next(iter(load(tmp_path / "o", 0).run(feeds).values())), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_view_after_the_attention_keeps_the_fused_kernel(tmp_path, dtype):
    """An attention whose output a ``Reshape`` views at once (SAM's windows: ``[B*nW, H, S, D]`` to
    ``[B*nW, H, h, w, D]``), grouped with it by the build as a view: the fused kernel writes each
    element at its own row-major place, which the view keeps (it fell back to the generic kernel
    before); on the host emulation against the definition."""
    from cuda_host import build, run

    from shardflow.compiler.codegen.cuda import kernel_groups
    from shardflow.compiler.ops.transform import Reshape, Transpose

    rng = np.random.default_rng(11)
    half = {"probs_dtype": dtype} if dtype != "float32" else {}
    q, k, v = (Tensor(n, (2, 4, 16, 40), dtype) for n in "qkv")
    bias = Tensor("bias", (2, 4, 16, 16), "float32")
    att = Attention([q, k, v, bias], name="att", scale=0.25, scale_sqrt=0.5, acc_dtype="float32", extra_biases=1,
                    **half)
    view = Reshape([att.outputs[0]], name="view", shape=(2, 4, 4, 4, 40))
    tr = Transpose([view.outputs[0]], name="tr", perm=(0, 2, 1, 3, 4))
    nodes = [att, view, tr]
    groups = kernel_groups(nodes, "sm_90", keep=[tr.outputs[0].name], views=["view"])
    assert [[m.op_type for m in getattr(g, "members", [g])] for g in groups] == [["Attention", "Reshape"],
                                                                                 ["Transpose"]]
    src = generate_cuda_source(groups, arch="sm_90")
    launch = src.launches[groups[0].name]
    assert launch.kind == ("attention-f32" if dtype == "float32" else "attention-f16")
    arrays = [_rounded(rng.standard_normal((2, 4, 16, 40)).astype(np.float32), dtype) for _ in range(3)]
    arrays.append(rng.standard_normal((2, 4, 16, 16)).astype(np.float32))
    want = att.run(*arrays)[0].reshape(2, 4, 4, 4, 40)
    ins = [_bits(a, dtype) if i < 3 else a for i, a in enumerate(arrays)]
    (got,) = run(build(src.text, str(tmp_path)), launch, ins, [(want.shape, np.float32)])
    check_case("view", got, want, FLOAT32_TOL["float32"] if dtype == "float32" else 1e-2)


def _windowed_attention(relpos: bool, scores_first: bool = True, b=2, hw=(4, 5), h=3, d=16):
    """ViTDet's and SAM's attention on windows as torch exports it: ``x [B, S, E]`` projected to
    ``[B, S, 3*H*D]``, viewed ``[B, S, 3, H, D]``, transposed to ``[3, B, H, S, D]`` and merged to
    ``[3, B*H, S, D]`` (``qkv.reshape(3, B*H, S, D).unbind(0)``), Q scaled, 3-D scores ``[B*H, S, S]``
    with no view on the heads; ``relpos``: the decomposed relative positions added to the scores'
    ``[B*H, qh, qw, kh, kw]`` view (``einsum(q, Rh)`` per key row, ``einsum(q, Rw)`` per key column,
    the scores on the right of the first addition unless ``scores_first``), viewed back; softmax,
    P·V, the heads merged back to ``[B, S, H*D]``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(12)
    (qh, qw), e = hw, h * d
    s_len = qh * qw
    inits = {"w": rng.standard_normal((e, 3 * e)).astype(np.float32) * e ** -0.5,
             "scale": np.array(d ** -0.5, np.float32), "rh": rng.standard_normal((qh, qh, d)).astype(np.float32),
             "rw": rng.standard_normal((qw, qw, d)).astype(np.float32)}
    shapes = {"sh5": (b, s_len, 3, h, d), "sh4": (3, b * h, s_len, d), "shq": (b * h, qh, qw, d),
              "shs": (b * h, qh, qw, qh, qw), "shs3": (b * h, s_len, s_len), "shrh": (b * h, qh, qw, qh, 1),
              "shrw": (b * h, qh, qw, 1, qw), "shy": (b, h, s_len, d), "shy3": (b, s_len, e)}
    inits.update({k: np.array(v, np.int64) for k, v in shapes.items()})
    inits.update({f"i{i}": np.array(i, np.int64) for i in range(3)})
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["qkv"]), n("Reshape", ["qkv", "sh5"], ["qkv5"]),
             n("Transpose", ["qkv5"], ["qkvt"], perm=[2, 0, 3, 1, 4]), n("Reshape", ["qkvt", "sh4"], ["qkv4"])]
    nodes += [n("Gather", ["qkv4", f"i{i}"], [t], axis=0) for i, t in enumerate("qkv")]
    nodes += [n("Mul", ["q", "scale"], ["qs"]), n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
              n("MatMul", ["qs", "kt"], ["scores"])]
    probs_in = "scores"
    if relpos:
        nodes += [n("Reshape", ["q", "shq"], ["qv"]), n("Einsum", ["qv", "rh"], ["relh"], equation="bhwc,hkc->bhwk"),
                  n("Einsum", ["qv", "rw"], ["relw"], equation="bhwc,wkc->bhwk"),
                  n("Reshape", ["scores", "shs"], ["s5"]), n("Reshape", ["relh", "shrh"], ["relh5"]),
                  n("Reshape", ["relw", "shrw"], ["relw5"]),
                  n("Add", ["s5", "relh5"] if scores_first else ["relh5", "s5"], ["b1"]),
                  n("Add", ["b1", "relw5"], ["b2"]), n("Reshape", ["b2", "shs3"], ["biased"])]
        probs_in = "biased"
    nodes += [n("Softmax", [probs_in], ["p"], axis=-1), n("MatMul", ["p", "v"], ["y3"]),
              n("Reshape", ["y3", "shy"], ["y4"]), n("Transpose", ["y4"], ["yt"], perm=[0, 2, 1, 3]),
              n("Reshape", ["yt", "shy3"], ["y"])]
    graph = helper.make_graph(nodes, "windows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (b, s_len, e))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (b, s_len, e))],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {"x": rng.standard_normal((b, s_len, e)).astype(np.float32)}


@pytest.mark.parametrize("relpos,scores_first", [(False, True), (True, True), (True, False)])
def test_windowed_attention_on_merged_heads_fuses(tmp_path, relpos, scores_first):
    """ViTDet's/SAM's attention (:func:`_windowed_attention`): its 3-D scores on ``B*H`` merged heads are
    computed as one batch of ``B*H`` heads, the relative positions added to a 5-D view of them become one
    ``[B*H, S, S]`` bias, and the attention fuses on both targets (one ``attention-f32`` kernel on cuda); the
    cpu program matches onnxruntime."""
    from shardflow.compiler.codegen.cuda import kernel_groups
    from shardflow.compiler.driver import _is_view
    from shardflow.runtime import load

    model, feeds = _windowed_attention(relpos, scores_first)
    want = _ort(model, feeds)["y"]
    for target in ("cpu", "cuda"):
        fused = FuseAttention(float32=True, target=target).run(load_onnx(model))
        (att,) = [op for op in fused.nodes if op.op_type == "Attention"]
        assert "Softmax" not in {op.op_type for op in fused.nodes}
        assert att._geometry(*att.inputs[:3]) == (1, 6, 6, 20, 20, 16, 16)
        assert att.attrs.get("extra_biases", 0) == relpos
        np.testing.assert_allclose(fused.run(feeds)["y"], want, rtol=1e-5, atol=1e-5)
        if target == "cuda":
            groups = kernel_groups(list(fused.nodes), "sm_90", keep=[t.name for t in fused.outputs],
                                   views=[op.name for op in fused.nodes if _is_view(op)])
            kinds = [la.kind for la in generate_cuda_source(groups, arch="sm_90").launches.values()]
            assert kinds.count("attention-f32") == 1, kinds
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "o")
    program = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    assert any(st.get("node", "").endswith(".attention") for st in program["steps"] if st["kind"] == "kernel")
    np.testing.assert_allclose(load(tmp_path / "o", 0).run(feeds)["y"], want, rtol=1e-5, atol=1e-5)


def test_a_mask_on_the_heads_view_keeps_the_heads(tmp_path):
    """XGLM's form: 3-D scores ``[B*H, S, L]`` viewed ``[B, H, S, L]`` for the mask ``[B, 1, S, L]``, viewed
    back for the softmax, P·V on ``[B*H, ..]`` viewed ``[B, H, S, D]``. That view splits the batch alone (the
    heads' view), so the mask is not materialized per head as a split view's biases are
    (:func:`test_windowed_attention_on_merged_heads_fuses`): the fused op has B = 2 batches of H = 3 heads
    and reads the mask as it is; values as onnxruntime's."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(13)
    b, h, s_len, d = 2, 3, 12, 16
    shapes = {"s4": (b, h, s_len, s_len), "s3": (b * h, s_len, s_len)}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in shapes.items()]
    inits.append(numpy_helper.from_array(np.where(rng.random((b, 1, s_len, s_len)) > 0.3, 0, -1e9).astype(
        np.float32), "mask"))
    n = helper.make_node
    nodes = [n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), n("MatMul", ["q", "kt"], ["scores"]),
             n("Reshape", ["scores", "s4"], ["s4v"]), n("Add", ["s4v", "mask"], ["masked"]),
             n("Reshape", ["masked", "s3"], ["s3v"]), n("Softmax", ["s3v"], ["p"], axis=-1),
             n("MatMul", ["p", "v"], ["y3"]), n("Reshape", ["y3", "y4"], ["y4v"]), n("Mul", ["y4v", "two"], ["y"])]
    inits += [numpy_helper.from_array(np.array((b, h, s_len, d), np.int64), "y4"),
              numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    f = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "xglm", [f(t, TensorProto.FLOAT, (b * h, s_len, d)) for t in "qkv"],
                              [f("y", TensorProto.FLOAT, (b, h, s_len, d))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {t: rng.standard_normal((b * h, s_len, d)).astype(np.float32) for t in "qkv"}
    fused = FuseAttention(float32=True, target="cpu").run(load_onnx(model))
    (att,) = [op for op in fused.nodes if op.op_type == "Attention"]
    assert att._geometry(*att.inputs[:3])[:2] == (2, 3) and tuple(att.inputs[3].shape) == (b, 1, s_len, s_len)
    np.testing.assert_allclose(fused.run(feeds)["y"], _ort(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def _split_heads_model(b=2, s=24, h=3, d=8, dv=16):
    """LeViT's attention as torch exports it (opset 17): ``x [B, S, E]`` projected to ``[B, S, H,
    2D + Dv]``, split into Q, K, V on the last axis, Kᵀ a transpose of K's split (perm ``(0, 2, 3,
    1)``: no transpose of a ``[B, H, L, D]`` K), scaled scores plus a learned bias ``[H, S, S]``
    gathered from a table, softmax, P·V, the heads merged and projected; head sizes 8 (Q, K) and 16 (V)."""
    import onnx
    from onnx import TensorProto, numpy_helper
    from onnx import helper as oh

    rng = np.random.default_rng(4)
    e = 32
    w = {"w": (rng.standard_normal((e, h * (2 * d + dv))) * 0.3).astype(np.float32),
         "shape": np.array([b, s, h, 2 * d + dv], np.int64), "split": np.array([d, d, dv], np.int64),
         "scale": np.array(d ** -0.5, np.float32), "table": rng.standard_normal((h, 7)).astype(np.float32),
         "index": rng.integers(0, 7, (s, s)).astype(np.int64), "y_shape": np.array([b, s, h * dv], np.int64),
         "wo": (rng.standard_normal((h * dv, e)) * 0.3).astype(np.float32)}
    nodes = [oh.make_node("MatMul", ["x", "w"], ["p"]), oh.make_node("Reshape", ["p", "shape"], ["p4"]),
             oh.make_node("Split", ["p4", "split"], ["q", "k", "v"], axis=3),
             oh.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]),
             oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1]),
             oh.make_node("Transpose", ["v"], ["vt"], perm=[0, 2, 1, 3]),
             oh.make_node("MatMul", ["qt", "kt"], ["s0"]), oh.make_node("Mul", ["s0", "scale"], ["s1"]),
             oh.make_node("Gather", ["table", "index"], ["bias"], axis=1), oh.make_node("Add", ["s1", "bias"], ["s2"]),
             oh.make_node("Softmax", ["s2"], ["pr"], axis=-1), oh.make_node("MatMul", ["pr", "vt"], ["y"]),
             oh.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]),
             oh.make_node("Reshape", ["yt", "y_shape"], ["y3"]), oh.make_node("MatMul", ["y3", "wo"], ["out"])]
    graph = oh.make_graph(nodes, "levit", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, e])],
                          [oh.make_tensor_value_info("out", TensorProto.FLOAT, [b, s, e])],
                          [numpy_helper.from_array(v, n) for n, v in w.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model, {"x": rng.standard_normal((b, s, e)).astype(np.float32)}


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_keys_transposed_from_split_heads_fuse_on_the_cuda_target(tmp_path, precision):
    """Kᵀ written as a transpose of a split ``[B, L, H, D]`` (LeViT's) fuses: K's rows become a
    transpose of the split, read by the kernel as a view; with head sizes 8 and 16 (padded to 16
    in shared memory on half operands, decision 50). The one-GPU cuda program's graph against
    onnxruntime, each of its kernels on the host emulation against the evaluator."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    from shardflow.compiler.codegen.cuda import kernel_groups
    from shardflow.compiler.driver import OptimizationConfig, _is_view, rank_passes
    from shardflow.compiler.parallel.partition import partition
    from shardflow.compiler.parallel.search import search

    model, feeds = _split_heads_model()
    want = _ort(model, feeds)["out"]
    path = tmp_path / "levit.onnx"
    path.write_bytes(model.SerializeToString())
    graph = load_onnx(str(path))
    (rg,) = partition(graph, search(graph, {"mesh_shape": [1], "algo": "replicate"}))
    rg = rank_passes(rg, OptimizationConfig.from_dict({"target": "cuda", "precision": precision}))
    (att,) = [op for op in rg.nodes if op.op_type == "Attention"]
    assert att._geometry(*att.inputs[:3])[-2:] == (8, 16)
    env = dict(feeds)
    for op in rg.nodes:
        env.update(zip((t.name for t in op.outputs), op.run(*[env[t.name] if t.name in env else t.value
                                                              for t in op.inputs])))
    tol = 1e-5 if precision == "float32" else 2e-2
    np.testing.assert_allclose(env[rg.outputs[0].name].astype(np.float32), want, rtol=tol,
                               atol=tol * float(np.abs(want).max()))
    consts = {t.name: t.value for op in rg.nodes for t in op.inputs if t.value is not None}
    groups = kernel_groups(list(rg.nodes), "sm_90", keep=[t.name for t in rg.outputs],
                           views=[op.name for op in rg.nodes if _is_view(op)])
    src = generate_cuda_source(groups, arch="sm_90", precision=precision)
    groups = [g for g in groups if g.name in src.launches]
    kinds = [src.launches[g.name].kind for g in groups]
    assert kinds.count("attention-f32" if precision == "float32" else "attention-f16") == 1, kinds
    _check_kernels("levit", build(src.text, str(tmp_path)), src, groups, env, consts)


def test_keys_transposed_from_split_heads_fuse_on_two_cpu_ranks(tmp_path):
    """The same model on the cpu target over two ranks (the ILP plan): one ``Attention`` step per
    rank, outputs equal onnxruntime's."""
    from threads import run_ranks

    model, feeds = _split_heads_model()
    want = _ort(model, feeds)["out"]
    path = tmp_path / "levit.onnx"
    path.write_bytes(model.SerializeToString())
    out = tmp_path / "o"
    compile(str(path), distributed_config={"mesh_shape": [2]}, optimization_config={"target": "cpu"}, out_dir=out)
    for r in range(2):
        program = json.loads((out / f"rank{r}" / "program.json").read_text())
        ops = [st.get("node", "") for st in program["steps"] if st["kind"] == "kernel"]
        assert sum(n.endswith(".attention") for n in ops) == 1 and not any("Softmax" in n for n in ops), ops
    got = run_ranks(out, feeds)
    for res in got:
        np.testing.assert_allclose(res["out"], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("model,precision,arch,kind", [
    ("gpt2_ts17", "float16", "sm_90", "attention-f16"), ("t5_encoder_ts17", "float16", "sm_90", "attention-f16"),
    pytest.param("gpt2_ts17", "float32", "sm_90", "attention-f32", marks=pytest.mark.slow),
    pytest.param("t5_encoder_ts17", "tf32", "sm_80", "attention-tf32", marks=pytest.mark.slow),
    pytest.param("llama_ts17", "float16", "sm_80", "attention-f16", marks=pytest.mark.slow),
    ("llama_dynamo18", "float32", "sm_90", "attention-f32")])  # (the slow ones: whole programs checked on the host)
def test_each_attention_compiles_into_one_kernel(tmp_path, model, precision, arch, kind):
    """At every precision (float32 operands: TF32 or 3xTF32 products, as the separate ones); Llama's
    grouped heads too, on sm_80 with the casts its K and V come from written by their producers."""
    out = tmp_path / "o"
    compile(MODELS / f"{model}.onnx", distributed_config={"mesh_shape": [1]},
            optimization_config={"precision": precision, "target": "cuda", "arch": arch}, out_dir=out)
    program = json.loads((out / "rank0" / "program.json").read_text())
    steps = [s for s in program["steps"] if s["kind"] == "kernel"]
    kinds = [s["launch"]["kind"] for s in steps]
    assert kinds.count(kind) == 2, kinds
    assert not any("Softmax" in s.get("node", "") for s in steps), kinds


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_a_half_model_attention_compiles_into_one_kernel_at_every_precision(tmp_path):
    """The driver runs HalfAttentionInFloat32 on cuda whatever ``precision`` says (the model's
    own float16 ``Attention``, on two ranks: each computes its heads)."""
    model, _ = _float16_attention_model("mask-4d")
    for precision in ("float32", "float16"):
        out = tmp_path / precision
        compile(model, distributed_config={"mesh_shape": [2], "algo": "megatron"},
                optimization_config={"precision": precision, "target": "cuda"}, out_dir=out)
        for r in range(2):
            program = json.loads((out / f"rank{r}" / "program.json").read_text())
            kinds = [s["launch"]["kind"] for s in program["steps"] if s["kind"] == "kernel"]
            assert kinds.count("attention-f16") == 1 and "row" not in kinds, kinds


# ----------------------------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------------------------

def _bits(x: np.ndarray, half: str) -> np.ndarray:
    if half == "float32":
        return np.ascontiguousarray(x, np.float32)
    if half == "float16":
        return x.astype(np.float16)
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncated: exact below


def _rounded(x: np.ndarray, half: str) -> np.ndarray:
    """Values exact in ``half``, as float32."""
    if half == "float32":
        return np.ascontiguousarray(x, np.float32)
    if half == "float16":
        return x.astype(np.float16).astype(np.float32)
    return ((np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16) << 16).view(np.float32)


def _case(rng, half, b, hq, hk, s, kv_len, d, dv, three_d, mask_shape, masked_rows=(), causal=None, bool_mask=False,
          extra_shape=None, y_3d=False, more=None):
    def t(*shape):
        return _rounded(rng.standard_normal(shape).astype(np.float32), half)
    if three_d:
        arrays = [t(b, s, hq * d), t(b, kv_len, hk * d), t(b, kv_len, hk * dv)]
    else:
        arrays = [t(b, hq, s, d), t(b, hk, kv_len, d), t(b, hk, kv_len, dv)]
    attrs = {"q_heads": hq, "kv_heads": hk, "scale": 1.0 / np.sqrt(d), "scale_sqrt": d ** -0.25,
             "acc_dtype": "float32", "probs_dtype": half}
    if mask_shape is not None:
        keep = rng.random(mask_shape) > 0.2
        m = keep if bool_mask else np.where(keep, rng.standard_normal(mask_shape), -np.inf).astype(np.float32)
        for r in masked_rows:
            m[..., r, :] = False if bool_mask else -np.inf
        arrays.append(m)
        attrs["has_mask"] = True
    more = dict(more or {})
    if "nonpad" in more:  # ONNX's nonpad_kv_seqlen: the keys each batch's rows see
        arrays.append(np.asarray(more.pop("nonpad"), np.int64))
        attrs["has_nonpad"] = True
    if "sink" in more:  # attention sinks: one more logit per query head
        arrays.append(np.asarray(more.pop("sink"), np.float32))
        attrs["has_sink"] = True
    if causal is not None:
        attrs.update(is_causal=True, past_len=causal)
    if extra_shape is not None:  # an additive bias added after the mask (if any)
        extra = np.where(rng.random(extra_shape) > 0.1, rng.standard_normal(extra_shape),
                         np.finfo(np.float32).min).astype(np.float32)
        if mask_shape is None:
            extra[..., 9, :] = -np.inf  # no mask's rule: softmax over nothing, NaN
        arrays.append(extra)
        attrs["extra_biases"] = 1
    if y_3d:
        attrs["y_3d"] = True
    attrs.update(more)
    return arrays, attrs


CASES = {
    "gpt2-like": ("float16", 2, 3, 3, 128, 128, 64, 64, True, (2, 1, 128, 128), ()),
    "odd-sizes": ("float16", 1, 2, 2, 77, 150, 32, 32, False, (77, 150), ()),
    "head128-v64": ("float16", 1, 2, 2, 65, 65, 128, 64, False, None, ()),
    "grouped-heads": ("float16", 2, 4, 2, 40, 200, 16, 48, True, (2, 1, 1, 200), ()),
    "masked-rows": ("float16", 1, 1, 1, 70, 70, 64, 64, False, (1, 1, 70, 70), (3, 69)),
    "bfloat16": ("bfloat16", 2, 2, 2, 100, 100, 64, 64, True, (2, 2, 100, 100), ()),
    # is_causal: key blocks past the diagonal skipped; a KV cache (past_len) moves the diagonal
    "causal": ("float16", 2, 3, 3, 150, 150, 64, 64, True, None, (), 0),
    "causal-kv-cache": ("float16", 1, 4, 2, 40, 230, 32, 32, False, (1, 1, 40, 230), (), 190),
    "causal-bfloat16": ("bfloat16", 1, 2, 2, 129, 129, 128, 128, False, (129, 129), (5,), 0),
    # a bool mask (ONNX Attention's other kind) shorter than the keys: the keys past it are masked
    "bool-mask-short": ("float16", 2, 2, 1, 50, 100, 32, 32, False, (2, 1, 50, 70), (7,), None, True),
    # T5: a position bias [1, H, S, L], then a padding mask [B, 1, 1, L] added to it
    "two-biases": ("float16", 2, 4, 4, 72, 72, 64, 64, True, (1, 4, 72, 72), (), None, False, (2, 1, 1, 72)),
    # FuseAttention's form: biases without the mask's rule, so a row hidden everywhere is NaN
    "biases-only": ("float16", 1, 2, 2, 66, 66, 32, 32, False, None, (), None, False, (1, 2, 66, 66)),
    # Llama's: 4-D operands (Q and K out of the rotary embedding), causal, the output merged [B, S, H*D]
    "heads-in-merged-out": ("float16", 2, 4, 4, 100, 100, 64, 64, False, None, (), 0, False, None, True),
    # a causal sliding window (Mistral's) with a softcap (Gemma 2's): key blocks before the window skipped
    "window-softcap": ("float16", 2, 2, 2, 200, 200, 64, 64, False, None, (), 0, False, None, False,
                       {"left_window": 70, "softcap": 2.0}),
    # a window on both sides of a KV cache's diagonal, no causal mask, with a mask
    "window-kv-cache": ("bfloat16", 1, 2, 2, 40, 230, 32, 32, False, (1, 1, 40, 230), (), None, False, None, False,
                        {"past_len": 190, "left_window": 50, "right_window": 3}),
    # a padded KV cache (ONNX nonpad_kv_seqlen): keys past each batch's count unseen, their blocks
    # skipped; one batch sees no key (its rows give 0), one sees more keys than there are
    "nonpad": ("float16", 4, 2, 1, 40, 230, 64, 64, True, (4, 1, 40, 230), (), None, False, None, False,
               {"nonpad": [230, 100, 0, 500]}),
    # and causal: the diagonal at nonpad[b] - S (no past), with a sliding window below it
    "nonpad-causal": ("float16", 3, 2, 2, 70, 230, 32, 32, False, None, (), 0, False, None, False,
                      {"nonpad": [230, 131, 60], "left_window": 90}),
    # gpt-oss: attention sinks (a large one in head 2) with grouped heads, a causal window and a bool
    # mask hiding every key of row 5 (its output 0: the sink weighs no value)
    "sinks-window": ("bfloat16", 2, 4, 2, 70, 100, 64, 64, False, (2, 1, 70, 100), (5,), 30, True, None, False,
                     {"sink": [2.0, -1.0, 8.0, 0.5], "left_window": 20}),
    # split-KV (few blocks of queries, long keys): a decoding step's one query over a 1000-key cache
    # with grouped heads and a mask, split over 4 blocks (float32: 8)
    "decode-split": ("float16", 1, 4, 2, 1, 1000, 64, 64, False, (1, 1, 1, 1000), (), 999),
    # a padded cache whose second batch sees 90 keys (the later splits see none) and sinks
    "split-nonpad-sinks": ("bfloat16", 2, 2, 1, 3, 700, 32, 32, True, None, (), None, False, None, False,
                           {"nonpad": [700, 90], "sink": [1.0, 3.0]}),
    # three blocks of queries, causal after a 970-key past, in a 600-key window: each block's steps split
    "causal-window-split": ("float16", 1, 1, 1, 130, 1100, 32, 32, False, None, (), 970, False, None, False,
                            {"left_window": 600}),
    # head size 256 (Gemma's; half operands only): 32 keys a step, V's columns in two blocks' halves,
    # grouped heads, causal with a mask
    "head256": ("float16", 2, 4, 2, 70, 90, 256, 256, False, (2, 1, 70, 90), (3,), 20),
    # head size 256 on Q and K, 128 on V (one block of columns), merged 3-D operands
    "head256-v128": ("bfloat16", 1, 2, 2, 65, 65, 256, 128, True, None, (), 0),
    # a decoding step with head size 256: split-KV and two blocks of V's columns, with sinks
    "head256-decode-split": ("bfloat16", 1, 2, 1, 1, 600, 256, 256, False, None, (), 599, False, None, False,
                             {"sink": [0.5, 2.0]}),
    # five speculative queries of 8 heads over 2 KV heads (Llama 3's 4 to 1), causal after a past,
    # merged 3-D operands, a mask: the 4 heads' 5 queries packed in one block's 20 rows
    "gqa-speculative": ("float16", 2, 8, 2, 5, 300, 128, 128, True, (2, 1, 5, 300), (2,), 295),
    # head sizes that are multiples of 8, not 16 (half operands: zero columns up to 16 in shared memory):
    # Stable Diffusion's 40 on merged 3-D operands; 8 on Q and K, 24 on V (LeViT's kind, test configs'
    # sizes) with grouped heads packed, causal, a mask; a decoding step's split-KV over a V 72 wide
    "head40": ("float16", 2, 2, 2, 100, 77, 40, 40, True, None, ()),
    "head8-v24": ("bfloat16", 2, 2, 1, 30, 70, 8, 24, False, (2, 1, 30, 70), (4,), 40),
    "head72-decode-split": ("float16", 1, 2, 2, 1, 900, 72, 72, False, (1, 1, 1, 900), (), 899),
}


def _ops():
    rng = np.random.default_rng(5)
    res = {}
    for name, (half, *geo) in CASES.items():
        arrays, attrs = _case(rng, half, *geo)
        ins = [Tensor(f"{name}.{k}", a.shape, half if k < 3 else str(a.dtype)) for k, a in enumerate(arrays)]
        res[name] = (Attention(ins, name=name, **attrs), arrays, half)
    return res


#: the float32 kernels' tolerance (of the largest finite output): 3xTF32 about float32's rounding
#: (a TF32 product alone is ~5e-4 off on these cases), one TF32 product its operands' 2**-11
FLOAT32_TOL = {"float32": 1e-5, "tf32": 3e-3}


def _float32_ops():
    """Every case's geometry, masks and attributes on float32 operands (values that no half type
    holds exactly, so a missing 3xTF32 part shows), as FuseAttention's float32 form (no
    ``probs_dtype``)."""
    rng = np.random.default_rng(6)
    res = {}
    for name in float32_cases():  # (head size 256: half operands only)
        arrays, attrs = _case(rng, "float32", *CASES[name][1:])
        del attrs["probs_dtype"]
        ins = [Tensor(f"{name}.{k}", a.shape, str(a.dtype)) for k, a in enumerate(arrays)]
        res[name] = (Attention(ins, name=name, **attrs), arrays)
    return res


@pytest.mark.parametrize("precision,arch", [("float32", "sm_90"), ("tf32", "sm_90"), ("float32", "sm_80")])
def test_every_float32_case_takes_the_fused_kernel(precision, arch):
    """On float32 operands the fused kernel computes with 3xTF32 products at float32 and one TF32
    product at tf32 (as the separate products would), 32 keys a step: Q and two stages of K and V
    at head size 128 in 99 KB, what sm_86 and sm_89 give a block."""
    from shardflow.compiler.codegen.cuda_attention import BLOCK_K_FLOAT, kv_splits

    ops = _float32_ops()
    src = generate_cuda_source([op for op, _ in ops.values()], precision=precision, arch=arch)
    for name, (op, _) in ops.items():
        launch = src.launches[name]
        assert launch.kind == f"attention-{'f32' if precision == 'float32' else 'tf32'}", name
        b_, hq, hk, s_len, l_len, d, dv = op._geometry(*op.inputs[:3])
        rows, heads = (s_len * hq // hk, hk) if name in PACKED else (s_len, hq)
        assert launch.grid == (-(-rows // 64) * kv_splits(b_, heads, rows, l_len, "f32"), heads, b_)
        assert launch.shared_mem == 4 * (64 * (d + 4) + 2 * BLOCK_K_FLOAT * (d + 4 + dv + 4)) <= 99 * 1024
    assert src.text.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") >= (6 if precision == "float32" else 2)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", [pytest.param("sm_80", marks=pytest.mark.slow), "sm_90"])
def test_float32_kernels_keep_their_values_in_registers(tmp_path, arch):
    """GPT-2's and Llama's head sizes (64, 128) with a mask, causal, at both float32 precisions:
    no local memory (the fragments of Q are read from shared memory at each use, where keeping
    them, and 3xTF32's two parts of them, took up to 255 registers and spilled)."""
    import subprocess

    rng = np.random.default_rng(0)
    ops = []
    for precision, d in itertools.product(("float32", "tf32"), (64, 128)):
        arrays, attrs = _case(rng, "float32", 1, 2, 2, 70, 90, d, d, False, (1, 1, 1, 90), (), 0)
        del attrs["probs_dtype"]
        ins = [Tensor(f"x.{k}", a.shape, str(a.dtype)) for k, a in enumerate(arrays)]
        op = Attention(ins, name="x", **attrs)
        src = generate_cuda_source([op], precision=precision, arch=arch)
        assert src.launches["x"].kind.startswith("attention-")
        ops.append(src.text)
    for n, text in enumerate(ops):
        cu = tmp_path / f"k{n}.cu"
        cu.write_text(text)
        res = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-O3", "-std=c++17", "-Xptxas", "-v", "-o",
                              str(tmp_path / f"k{n}.cubin"), str(cu)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", res.stderr)
        assert frames and all(f == ("0", "0") for f in frames), res.stderr


def test_float32_attention_needs_aligned_operands_and_sm80():
    """A float32 operand whose rows are not 16-byte aligned keeps the generic kernel (the copies
    move 4 floats), and so does every float32 attention before sm_80 (no TF32 tensor cores)."""
    from shardflow.compiler.codegen.fusion import fuse
    from shardflow.compiler.ops.transform import Slice

    q, k = Tensor("q", (1, 2, 8, 32), "float32"), Tensor("k", (1, 2, 8, 32), "float32")
    ok = Attention([q, k, Tensor("v", (1, 2, 8, 32), "float32")], name="ok", scale=0.5, acc_dtype="float32")
    assert generate_cuda_source([ok], arch="sm_80").launches["ok"].kind == "attention-f32"
    assert not generate_cuda_source([ok], arch="sm_75").launches["ok"].kind.startswith("attention")
    for width, fused in ((36, True), (34, False)):  # V's rows 36 or 34 floats apart
        sl = Slice([Tensor("wide", (1, 2, 8, width), "float32")], name="v", starts=(0, 0, 0, 0), steps=(1, 1, 1, 1),
                   sizes=(1, 2, 8, 32))
        att = Attention([q, k, sl.outputs[0]], name="att", scale=0.5, acc_dtype="float32")
        (group,) = fuse([sl, att], keep=[att.outputs[0].name])
        kind = generate_cuda_source([group], arch="sm_90").launches[group.name].kind
        assert kind.startswith("attention") == fused, (width, kind)


PACKED = ("sinks-window", "decode-split", "split-nonpad-sinks", "head256", "head256-decode-split", "gqa-speculative",
          "head8-v24")


def test_every_case_takes_the_fused_kernel():
    """One block per 64 queries of a head, times the key splits (1 but for the split-KV cases); with
    grouped heads and few queries (PACKED) one block per 64 rows of a KV head's group of heads."""
    from shardflow.compiler.codegen.cuda_attention import kv_splits, packs_heads, v_chunks

    ops = _ops()
    src = generate_cuda_source([op for op, _, _ in ops.values()], arch="sm_90")
    for name, (op, _, half) in ops.items():
        launch = src.launches[name]
        assert launch.kind == f"attention-{'f16' if half == 'float16' else 'bf16'}", name
        assert launch.block == (128, 1, 1) and launch.shared_mem <= 99 * 1024
        b_, hq, hk, s_len, l_len, d, dv = op._geometry(*op.inputs[:3])
        assert packs_heads(s_len, hq // hk) == (name in PACKED), name
        rows, heads = (s_len * hq // hk, hk) if name in PACKED else (s_len, hq)
        splits = kv_splits(b_, heads, rows, l_len, "f16", d, dv)
        assert (splits > 1) == name.endswith("split") or name == "split-nonpad-sinks", (name, splits)
        assert launch.grid == (-(-rows // 64) * splits * v_chunks(dv), heads, b_)
        assert (v_chunks(dv) > 1) == (name in ("head256", "head256-decode-split"))
    assert [kv_splits(1, 4, 1, 1000, t) for t in ("f16", "f32")] == [4, 8]
    assert kv_splits(8, 12, 128, 128, "f16") == kv_splits(1, 32, 4096, 4096, "f16") == 1  # (GPT-2 8x128; long prefill)
    assert kv_splits(1, 32, 1, 4096, "f16") == 4 and kv_splits(1, 1, 1, 100000, "f16") == 16
    # Llama 3 8B's decoding step (32 query heads, 8 KV heads): 8 blocks of 4 rows, 16 splits each;
    # on an H20's 78 multiprocessors 9 (``sms``: optimization_config["sm_count"])
    assert packs_heads(1, 4) and kv_splits(1, 8, 4, 4096, "f16", 128, 128) == 16
    assert kv_splits(1, 8, 4, 4096, "f16", 128, 128, sms=78) == 9
    small = generate_cuda_source([ops["decode-split"][0]], arch="sm_90", sms=2).launches["decode-split"]
    assert small.grid[0] * small.grid[1] * small.grid[2] == 2 < src.launches["decode-split"].grid[0]
    # not a prompt's full blocks, nor heads of their own, nor where packing saves no block
    assert not any(packs_heads(s, r) for s, r in ((128, 4), (1, 1), (40, 2), (64, 8), (33, 2)))
    assert packs_heads(32, 4) and packs_heads(21, 3) and packs_heads(7, 8) and not packs_heads(63, 8)


@pytest.mark.parametrize("dtype,d,dv", [("float16", 20, 24), ("bfloat16", 32, 12), ("float16", 272, 272),
                                         ("float16", 256, 144), ("float32", 256, 256), ("float32", 64, 144),
                                         ("float32", 36, 36)])
def test_unsupported_head_sizes_keep_the_generic_kernel(dtype, d, dv):
    """Not multiples of 8, beyond 256 (half operands), a V beyond 128 not a multiple of 32, or
    beyond 128 on float32 operands."""
    q, k, v = Tensor("q", (1, 2, 8, d), dtype), Tensor("k", (1, 2, 8, d), dtype), Tensor("v", (1, 2, 8, dv), dtype)
    op = Attention([q, k, v], name="a", scale=0.5, scale_sqrt=0.7, acc_dtype="float32",
                   **({"probs_dtype": dtype} if dtype != "float32" else {}))
    assert not generate_cuda_source([op], arch="sm_90").launches["a"].kind.startswith("attention")


def _last_key(text: str, q0: int) -> int:
    """The last key a block of queries from ``q0`` sees, by the generated ``sf_last`` line."""
    import re

    m = re.search(r"const int sf_last = min\(sf_q0 \+ (\d+), (\d+)\)(?: ([+-]) (\d+))?;", text)
    shift = 0 if m.group(3) is None else int(m.group(4)) * (1 if m.group(3) == "+" else -1)
    return min(q0 + int(m.group(1)), int(m.group(2))) + shift


@pytest.mark.parametrize("s_len,l_len,past", [(150, 150, 0), (40, 230, 190), (129, 129, 0), (64, 300, 5),
                                               (100, 60, 0)])
def test_causal_kernels_visit_every_key_their_rows_see(s_len, l_len, past):
    """The generated bounds of a causal kernel (the key blocks a block of queries visits, taken
    from its source) hold every key ``j <= i + past`` of every row ``i`` of the block: the skipped
    blocks hold none (and, past the last row, a block holds one it must see)."""
    import re

    from shardflow.compiler.codegen.cuda_attention import BLOCK_K, BLOCK_Q

    q, k, v = Tensor("q", (1, 1, s_len, 32), "float16"), Tensor("k", (1, 1, l_len, 32), "float16"), \
        Tensor("v", (1, 1, l_len, 32), "float16")
    op = Attention([q, k, v], name="a", scale=0.5, acc_dtype="float32", probs_dtype="float16", is_causal=True,
                   past_len=past)
    src = generate_cuda_source([op], arch="sm_90")
    assert src.launches["a"].kind == "attention-f16"
    text = src.text
    nkb, step = (int(x) for x in re.search(r"sf_nkb = sf_last < 0 \? 0 : min\((\d+), sf_last / (\d+) \+ 1\);",
                                             text).groups())
    assert step == BLOCK_K and nkb == -(-l_len // BLOCK_K) and "(gridDim.x - 1 - blockIdx.x)" in text
    for q0 in range(0, s_len, BLOCK_Q):
        last = _last_key(text, q0)
        visited = 0 if last < 0 else min(nkb, last // step + 1)
        rows = range(q0, min(q0 + BLOCK_Q, s_len))
        seen = [j for j in range(l_len) if any(j <= i + past for i in rows)]
        assert all(j < visited * BLOCK_K for j in seen), (q0, visited)
        assert not seen or max(seen) >= (visited - 1) * BLOCK_K  # no block visited for nothing


@pytest.mark.parametrize("past,left,right,causal", [(0, 70, -1, True), (190, 50, 3, False), (5, 0, 0, False),
                                                    (0, 200, 64, False)])
def test_window_kernels_visit_the_key_blocks_of_their_band(past, left, right, causal):
    """With sliding windows the generated bounds (first and last key block of a block of queries)
    hold every key ``i + past - left <= j <= i + past + right`` (``j <= i + past`` too if causal)
    of every row of the block, and visit no block before or after those keys."""
    import re

    from shardflow.compiler.codegen.cuda_attention import BLOCK_K, BLOCK_Q

    s_len, l_len = 150, 300
    q, k, v = Tensor("q", (1, 1, s_len, 32), "float16"), Tensor("k", (1, 1, l_len, 32), "float16"), \
        Tensor("v", (1, 1, l_len, 32), "float16")
    op = Attention([q, k, v], name="a", scale=0.5, acc_dtype="float32", probs_dtype="float16", is_causal=causal,
                   past_len=past, left_window=left, right_window=right)
    text = generate_cuda_source([op], arch="sm_90").text
    assert "sf_load_kv(sf_kb0, 0)" in text and "for (int kb = sf_kb0;" in text
    first = re.search(r"const int sf_first = sf_q0(?: ([+-]) (\d+))?;", text)
    lo = 0 if first.group(1) is None else int(first.group(2)) * (1 if first.group(1) == "+" else -1)
    for q0 in range(0, s_len, BLOCK_Q):
        kb0 = 0 if q0 + lo <= 0 else (q0 + lo) // BLOCK_K
        last = _last_key(text, q0)
        end = min(-(-l_len // BLOCK_K), last // BLOCK_K + 1) if last >= 0 else 0
        rows = range(q0, min(q0 + BLOCK_Q, s_len))
        hi = min(right, 0) if causal and right >= 0 else (0 if causal else right)
        seen = [j for j in range(l_len) if any(i + past - left <= j <= i + past + hi for i in rows)]
        assert all(kb0 * BLOCK_K <= j < end * BLOCK_K for j in seen), (q0, kb0, end)
        assert not seen or (min(seen) < (kb0 + 1) * BLOCK_K and max(seen) >= (end - 1) * BLOCK_K)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if cg._find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    d = tmp_path_factory.mktemp("att")
    ops = _ops()
    launches = build_cuda_library([op for op, _, _ in ops.values()], str(d / "k.cubin"), arch="sm_90",
                                  cache_dir=str(d / "c"))
    return ops, launches, str(d / "k.cubin")


def test_the_kernels_compile_for_sm90(library):
    ops, launches, path = library
    assert open(path, "rb").read()[:4] == b"\x7fELF"
    assert all(launches[n].kind.startswith("attention") for n in ops)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_matches_the_definition(library, name):
    ops, launches, path = library
    op, arrays, half = ops[name]
    want = op.run(*arrays)[0]
    got = _run_on_gpu(path, launches[name], [_bits(a, half) if k < 3 else a for k, a in enumerate(arrays)],
                      want.shape)
    check_case(name, got, want)


def _run_on_gpu(path: str, launch, arrays: list, out_shape) -> np.ndarray:
    """Launch a case's kernel from cubin ``path`` on ``arrays`` (skip without a CUDA device),
    with its dynamic shared memory allowed past 48 KB; its float32 output, poisoned with NaN first."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError
    except Exception:
        pytest.skip("no CUDA device (or cupy is not installed)")
    fn = cupy.RawModule(path=path).get_function(launch.symbol)
    if launch.shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = launch.shared_mem
    out = cupy.full(out_shape, np.nan, np.float32)
    fn(launch.grid, launch.block, kernel_args(launch.tensor_maps, [cupy.asarray(a) for a in arrays] + [out]),
       shared_mem=launch.shared_mem)
    return cupy.asnumpy(out)


@pytest.fixture(scope="module", params=["float32", "tf32"])
def float32_library(request, tmp_path_factory):
    """The float32 cases' kernels at ``precision`` (3xTF32 or TF32), compiled for sm_90."""
    if cg._find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    d = tmp_path_factory.mktemp("att32")
    ops = _float32_ops()
    launches = build_cuda_library([op for op, _ in ops.values()], str(d / "k.cubin"), arch="sm_90",
                                  precision=request.param, cache_dir=str(d / "c"))
    return request.param, ops, launches, str(d / "k.cubin")


@pytest.mark.slow  # (nvcc on every case, twice; the registers test and the host emulation cover them by default)
def test_the_float32_kernels_compile_for_sm90(float32_library):
    precision, ops, launches, path = float32_library
    assert open(path, "rb").read()[:4] == b"\x7fELF"
    assert {launches[n].kind for n in ops} == {f"attention-{'f32' if precision == 'float32' else 'tf32'}"}


def float32_cases() -> list[str]:
    """The cases whose head sizes the kernel takes on float32 operands."""
    from shardflow.compiler.codegen.cuda_attention import takes_heads

    return [n for n, (_, *geo) in CASES.items() if takes_heads(geo[5], geo[6], float32=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", float32_cases())
def test_the_float32_kernel_matches_the_definition(float32_library, name):
    """Every case on float32 operands, 3xTF32 to float32 accuracy, TF32 to its own (FLOAT32_TOL)."""
    precision, ops, launches, path = float32_library
    op, arrays = ops[name]
    want = op.run(*arrays)[0]
    check_case(name, _run_on_gpu(path, launches[name], arrays, want.shape), want, FLOAT32_TOL[precision])


def check_case(name: str, got: np.ndarray, want: np.ndarray, tol: float = 1e-2) -> None:
    """A case's kernel output against the op's definition (also run by test_cuda_host.py): within
    ``tol`` (the half types' error budget by default) of the largest finite value, NaN where the
    definition has NaN, and the rows every key of which is masked as the case expects."""
    scale = float(np.abs(want[np.isfinite(want)]).max())
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True)
    if name == "masked-rows":
        assert not got[0, 0, [3, 69]].any()  # every key masked: 0, as the definition says
    if name == "bool-mask-short":
        assert not got[:, :, 7].any()
    if name == "nonpad":
        assert not got[2].any()  # no key seen: 0
    if name == "sinks-window":
        assert not got[:, :, 5].any()
    if name == "biases-only":
        assert np.isnan(want[:, :, 9]).all() and np.isnan(got[:, :, 9]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal-3d", "nonpad-mask-4d"])
def test_a_half_model_attention_on_the_gpu_matches_onnxruntime(tmp_path, case):
    """A float16 model's own ``Attention`` compiled for cuda (one fused kernel computing in
    float32) and run eagerly and as a CUDA graph, against onnxruntime's float16 kernel."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError
    except Exception:
        pytest.skip("no CUDA device (or cupy is not installed)")
    from shardflow.runtime import load

    model, feeds = _float16_attention_model(case)
    ref = _ort(model, feeds)["out"].astype(np.float32)
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cuda"},
            out_dir=tmp_path / "o")
    prog = load(tmp_path / "o")
    for _ in range(2):  # the second run replays the CUDA graph
        got = prog.run(feeds)["out"]
        got = (got.get() if hasattr(got, "get") else got).astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=5e-3, atol=5e-3 * float(np.abs(ref).max()))
