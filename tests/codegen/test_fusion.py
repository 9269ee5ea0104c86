"""Operator fusion (compiler/codegen/fusion.py): which ops are grouped, and that a fused kernel
computes exactly what its members compute one after another.

Every op example is wrapped as ``cast -> op -> neg`` (a cheap prologue and an element-wise
epilogue where the rules allow them), fused, compiled by the cpu code generator and compared with
the members' numpy execution; the same fused ops are generated (and, with nvcc, compiled) for cuda.
"""
from __future__ import annotations

import ctypes
import re
import shutil

import numpy as np
import pytest

from shardflow.compiler.codegen import build_cpu_library
from shardflow.compiler.codegen.cuda import build_cuda_library, generate_cuda_source
from shardflow.compiler.codegen.fusion import FusedOp, fuse
from shardflow.compiler.codegen.lower import lowerable
from shardflow.compiler.ir import Tensor, const_tensor
from shardflow.compiler.ops.elementwise import Binary, CastOp, Unary
from shardflow.compiler.ops.linalg import MatMul
from shardflow.compiler.ops.norm import LayerNorm
from shardflow.compiler.ops.reduce import Softmax
from shardflow.compiler.ops.transform import Transpose
from op_examples import op_examples


def _f(*shape):
    return Tensor("x", shape, "float32")


def _kinds(groups):
    return [[m.op_type for m in g.members] if isinstance(g, FusedOp) else g.op_type for g in groups]


# ------------------------------------------------------------------------------------ rules
def test_gemm_epilogue_and_prologue_on_cuda_but_not_around_cpu_templates():
    w, b = const_tensor(np.ones((16, 12), np.float32)), const_tensor(np.ones(12, np.float32))
    t = Transpose([_f(16, 8)], perm=(1, 0))
    mm = MatMul([t.outputs[0], w])
    add = Binary([mm.outputs[0], b], fn="add")
    act = Unary([add.outputs[0]], fn="tanh")
    ops = [t, mm, add, act]
    assert _kinds(fuse(ops)) == [["Transpose", "MatMul", "Binary", "Unary"]]
    assert _kinds(fuse(ops, barriers=lambda op: op.op_type == "MatMul", epilogue_after_reduce=False)) == \
        ["Transpose", "MatMul", ["Binary", "Unary"]]


def test_tensors_to_keep_or_read_by_two_kernels_are_written():
    a = Unary([_f(4, 5)], fn="exp")
    b = Unary([a.outputs[0]], fn="neg")
    c = Binary([a.outputs[0], b.outputs[0]], fn="add")
    # a is read twice, both times inside the group of b and c: it joins them
    assert _kinds(fuse([a, b, c])) == [["Unary", "Unary", "Binary"]]
    # b must be written: a's readers end up in two kernels, so a is written too
    assert _kinds(fuse([a, b, c], keep={b.outputs[0].name})) == ["Unary", "Unary", "Binary"]


def test_a_rotary_embeddings_heads_join_once_their_readers_meet():
    """A partial rotary embedding (GPT-NeoX's, Phi's): the heads ``h = Transpose(x)`` are read by the
    slices of their rotated and passed parts, which meet in one group only once each slice's own
    readers have joined it (the rotated part is read by its product with cos and by the rotation's
    halves): phase 2 repeats until nothing joins, and ``h`` joins them as their prologue. Before
    session 53 it was a kernel of its own, writing the heads once for the rotation to read (NeoX
    test model: 29 -> 25 cuda kernels; Phi exported in float16: 24 -> 20)."""
    from shardflow.compiler.ops.transform import Concat, Slice

    def last(t, start, size):  # (a slice of the last dim)
        return Slice([t], starts=(0, 0, 0, start), steps=(1, 1, 1, 1), sizes=t.shape[:3] + (size,))

    h = Transpose([_f(2, 8, 4, 16)], perm=(0, 2, 1, 3))  # [2, 4, 8, 16]
    rot, keep = last(h.outputs[0], 0, 8), last(h.outputs[0], 8, 8)
    lo, hi = last(rot.outputs[0], 0, 4), last(rot.outputs[0], 4, 4)
    neg = Unary([hi.outputs[0]], fn="neg")
    half = Concat([neg.outputs[0], lo.outputs[0]], axis=3)
    cos, sin = (const_tensor(np.full((8, 8), v, np.float32)) for v in (0.6, 0.8))
    a = Binary([rot.outputs[0], cos], fn="mul")
    b = Binary([half.outputs[0], sin], fn="mul")
    r = Binary([a.outputs[0], b.outputs[0]], fn="add")
    y = Concat([r.outputs[0], keep.outputs[0]], axis=3)
    ops = [h, rot, keep, lo, hi, neg, half, a, b, r, y]
    (group,) = fuse(ops)
    assert isinstance(group, FusedOp) and [m.name for m in group.members] == [op.name for op in ops]
    x = np.random.default_rng(0).standard_normal((2, 8, 4, 16)).astype(np.float32)
    want = x.transpose(0, 2, 1, 3).copy()
    r8 = want[..., :8]
    want[..., :8] = r8 * 0.6 + np.concatenate([-r8[..., 4:], r8[..., :4]], axis=-1) * 0.8
    got = group.numpy(*[x if t is h.inputs[0] else t.value for t in group.inputs])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_gelu_written_as_x_times_f_x_is_the_gemm_epilogue(tmp_path, kernel_cache):
    """GPT-2's tanh GELU reads its input four times: the matmul, its bias and the whole GELU are
    one tensor-core kernel on cuda; on cpu the GEMM stays a template and the GELU one kernel."""
    mm = MatMul([_f(64, 32), const_tensor(np.ones((32, 48), np.float32))])
    x = Binary([mm.outputs[0], const_tensor(np.ones(48, np.float32))], fn="add").outputs[0]
    ops = [mm, x.producer]

    def op(o):
        ops.append(o)
        return o.outputs[0]
    c = lambda v: const_tensor(np.array(v, np.float32))  # noqa: E731
    cube = op(Binary([x, c(3.0)], fn="pow"))
    inner = op(Binary([x, op(Binary([c(0.044715), cube], fn="mul"))], fn="add"))
    th = op(Unary([op(Binary([c(0.7978845608), inner], fn="mul"))], fn="tanh"))
    half = op(Binary([x, c(0.5)], fn="mul"))
    op(Binary([half, op(Binary([c(1.0), th], fn="add"))], fn="mul"))
    groups = fuse(ops)
    assert len(groups) == 1 and len(groups[0].members) == len(ops)
    assert [l.kind for l in generate_cuda_source(groups).launches.values()] == ["gemm-f32"]
    cpu = fuse(ops, barriers=lambda o: o.op_type == "MatMul", epilogue_after_reduce=False)
    assert [len(getattr(g, "members", [g])) for g in cpu] == [1, len(ops) - 1]
    if shutil.which("nvcc") is not None:
        build_cuda_library(ops, str(tmp_path / "g.cubin"), arch="sm_90", cache_dir=str(tmp_path / "c"), fuse=True)
    if shutil.which("g++") is None:
        return
    # the fused GELU kernel against the ops one by one (the whole GEMM+GELU chain fused on the cpu
    # target too when the template is not a barrier: the generic lowering inlines the product)
    a = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    want = {id(mm.inputs[0]): a}
    for o in ops:
        want[id(o.outputs[0])] = o.run(*[want[id(t)] if id(t) in want else t.value for t in o.inputs])[0]
    entries = build_cpu_library(ops, str(tmp_path / "g.so"), cache_dir=kernel_cache, opt_level=1, fuse=True)
    e = entries[ops[-1].name]
    lib = ctypes.CDLL(str(tmp_path / "g.so"))
    tensors = {t.name: (want[id(t)] if id(t) in want else t.value) for o in ops for t in o.inputs}
    ins = [np.ascontiguousarray(tensors[n]) for n in e["inputs"]]
    out = np.empty((64, 48), np.float32)
    fn = getattr(lib, e["symbol"])
    fn.restype = None
    fn((ctypes.c_void_p * len(ins))(*[v.ctypes.data for v in ins]), (ctypes.c_void_p * 1)(out.ctypes.data))
    np.testing.assert_allclose(out, want[id(ops[-1].outputs[0])], rtol=1e-5, atol=1e-6)


def test_reductions_take_element_wise_epilogues_only():
    mm = MatMul([_f(8, 16), _f(16, 12)])
    sm = Softmax([mm.outputs[0]], axes=(1,))  # reads each row many times: would recompute the GEMM
    tr = Transpose([mm.outputs[0]], perm=(1, 0))
    assert _kinds(fuse([mm, sm])) == ["MatMul", "Softmax"]
    assert _kinds(fuse([mm, tr])) == ["MatMul", "Transpose"]
    add = Binary([_f(4, 32), _f(4, 32)], fn="add")
    ln = LayerNorm([add.outputs[0], const_tensor(np.ones(32, np.float32)), const_tensor(np.zeros(32, np.float32))],
                   axis=1, epsilon=1e-5, stash="float32")
    assert _kinds(fuse([add, ln])) == [["Binary", "LayerNorm"]]  # residual add as a prologue
    ex = Unary([_f(16, 12)], fn="exp")
    mm2 = MatMul([_f(8, 16), ex.outputs[0]])
    assert _kinds(fuse([ex, mm2])) == ["Unary", "MatMul"]  # not cheap: would be recomputed per tile


def _decomposed_rms_norm(shape=(4, 6, 96)):
    """Llama's RMSNorm as exporters write it: x * (1 / sqrt(mean(x^2) + eps)) * w."""
    from shardflow.compiler.ops.reduce import Reduce

    c = lambda v: const_tensor(np.array(v, np.float32))  # noqa: E731
    x = Tensor("x", shape, "float32")
    ops = []

    def op(o):
        ops.append(o)
        return o.outputs[0]
    ms = op(Reduce([op(Binary([x, c(2.0)], fn="pow"))], kind="mean", axes=(len(shape) - 1,), keepdims=True))
    r = op(Binary([c(1.0), op(Unary([op(Binary([ms, c(1e-6)], fn="add"))], fn="sqrt"))], fn="div"))
    w = const_tensor(np.random.default_rng(1).standard_normal(shape[-1]).astype(np.float32))
    op(Binary([w, op(Binary([x, r], fn="mul"))], fn="mul"))
    return x, ops


def test_a_row_statistic_and_its_broadcast_readers_are_one_row_kernel(tmp_path, kernel_cache):
    """A decomposed RMSNorm: the reduction's per-row value (``[.., 1]``) read along the row by
    ``x * r`` joins it: one kernel, which computes the statistic once per row (cuda: the row
    kernel), not one kernel for the statistic and one for the product. A contraction's ``[M, 1]``
    output read that way stays its own kernel (its template has no such epilogue)."""
    x, ops = _decomposed_rms_norm()
    groups = fuse(ops)
    assert len(groups) == 1 and len(groups[0].members) == len(ops)
    assert [launch.kind for launch in generate_cuda_source(groups).launches.values()] == ["row"]
    gemv = MatMul([_f(8, 16), _f(16, 1)])
    scaled = Binary([_f(8, 12), gemv.outputs[0]], fn="mul")
    assert _kinds(fuse([gemv, scaled])) == ["MatMul", "Binary"]
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return
    xv = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    want = {id(x): xv}
    for o in ops:
        want[id(o.outputs[0])] = o.run(*[want[id(t)] if id(t) in want else t.value for t in o.inputs])[0]
    entries = build_cpu_library(ops, str(tmp_path / "r.so"), cache_dir=kernel_cache, opt_level=1, fuse=True)
    e = entries[ops[-1].name]
    tensors = {t.name: (want[id(t)] if id(t) in want else t.value) for o in ops for t in o.inputs}
    ins = [np.ascontiguousarray(tensors[n]) for n in e["inputs"]]
    out = np.empty(x.shape, np.float32)
    fn = getattr(ctypes.CDLL(str(tmp_path / "r.so")), e["symbol"])
    fn.restype = None
    fn((ctypes.c_void_p * len(ins))(*[v.ctypes.data for v in ins]), (ctypes.c_void_p * 1)(out.ctypes.data))
    np.testing.assert_allclose(out, want[id(ops[-1].outputs[0])], rtol=1e-5, atol=1e-6)


def test_group_runs_where_its_last_member_ran():
    a = Unary([_f(3)], fn="exp")
    other = Unary([_f(3)], fn="abs")  # read twice: written, not fused
    b = Binary([a.outputs[0], other.outputs[0]], fn="add")
    d = Binary([other.outputs[0], _f(3)], fn="mul")
    groups = fuse([a, other, b, d])
    assert _kinds(groups) == ["Unary", ["Unary", "Binary"], "Binary"]
    fused = groups[1]
    assert fused.outputs[0].name == b.outputs[0].name and [t.name for t in fused.inputs] == [
        a.inputs[0].name, other.outputs[0].name]


def test_an_op_joins_several_cheap_groups():
    x, w = _f(40, 64), const_tensor(np.ones((64, 48), np.float16))
    c = CastOp([x], to="float16")
    c2 = CastOp([c.outputs[0]], to="float32")
    wc = CastOp([w], to="float32")
    mm = MatMul([c2.outputs[0], wc.outputs[0]])
    assert _kinds(fuse([c, c2, wc, mm])) == [["Cast", "Cast", "Cast", "MatMul"]]
    # float32 products of half values run on the half-precision tensor cores
    assert [l.kind for l in generate_cuda_source(fuse([c, c2, wc, mm])).launches.values()] == ["gemm-f16"]


def test_materialized_half_casts_end_their_group():
    """cuda on Hopper: the cast to float16 is written by its producer's kernel and the GEMM reads
    that float16 tensor directly (the wgmma template), instead of inlining both casts."""
    x, w = _f(64, 64), const_tensor(np.ones((64, 48), np.float16))
    e = Unary([x], fn="exp")
    c = CastOp([e.outputs[0]], to="float16")
    c2 = CastOp([c.outputs[0]], to="float32")
    wc = CastOp([w], to="float32")
    mm = MatMul([c2.outputs[0], wc.outputs[0]])
    half = lambda op: op.op_type == "Cast" and op.outputs[0].dtype == "float16"  # noqa: E731
    groups = fuse([e, c, c2, wc, mm], materialize=half)
    assert _kinds(groups) == [["Unary", "Cast"], ["Cast", "Cast", "MatMul"]]
    assert groups[0].outputs[0].dtype == "float16"
    kinds = [l.kind for l in generate_cuda_source(groups, arch="sm_90").launches.values()]
    assert kinds == ["elementwise", "gemm-wgmma-f16"]
    # without: the producer writes the float32 round trip, and the GEMM is a float32 one (3xTF32)
    plain = fuse([e, c, c2, wc, mm])
    assert _kinds(plain) == [["Unary", "Cast", "Cast"], ["Cast", "MatMul"]]
    assert [l.kind for l in generate_cuda_source(plain, arch="sm_90").launches.values()] == ["elementwise",
                                                                                            "gemm-f32"]


# ------------------------------------------------------------------------------- numerics
def _chains():
    """``cast -> op -> neg`` around every single-output lowerable op example with float data."""
    res = []
    for mod, k, cls, arrays, attrs in op_examples():
        ins = [const_tensor(a) for a in arrays]
        try:
            op = cls(ins, name="probe", **attrs)
        except Exception:  # noqa: BLE001
            continue
        if len(op.outputs) != 1 or not lowerable(op) or op.data_dependent_values:
            continue
        if not arrays or np.asarray(arrays[0]).dtype.kind != "f" or op.outputs[0].dtype not in ("float32", "float64"):
            continue
        name = f"{cls.op_type}-{mod}-{k}"
        x0 = Tensor(f"{name}.x0", np.shape(arrays[0]), str(np.asarray(arrays[0]).dtype))
        cast = CastOp([x0], name=f"{name}.cast", to=x0.dtype)
        core = cls([cast.outputs[0]] + ins[1:], name=f"{name}.op", **attrs)
        neg = Unary([core.outputs[0]], name=f"{name}.neg", fn="neg")
        res.append((name, [cast, core, neg], arrays))
    return res


CHAINS = _chains()


def _reference(chain, arrays):
    cast, core, neg = chain
    y = cast.run(arrays[0])[0]
    y = core.run(y, *arrays[1:])[0]
    return neg.run(y)[0]


def test_many_chains_fuse():
    fused = sum(isinstance(g, FusedOp) and len(g.members) == 3 for _, ops, _ in CHAINS for g in fuse(ops))
    assert len(CHAINS) > 60 and fused > len(CHAINS) // 2, (len(CHAINS), fused)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler")
def test_fused_cpu_kernels_match_their_members(tmp_path, kernel_cache):
    ops = [op for _, chain, _ in CHAINS for op in chain]
    entries = build_cpu_library(ops, str(tmp_path / "k.so"), cache_dir=kernel_cache, opt_level=1, fuse=True)
    lib = ctypes.CDLL(str(tmp_path / "k.so"))
    checked = 0
    for name, chain, arrays in CHAINS:
        e = entries[chain[-1].name]
        if isinstance(e, str):  # not fused (a template, or rules): members run one by one elsewhere
            continue
        tensors = {chain[0].inputs[0].name: arrays[0]}
        if entries[chain[0].name] is not None:
            # a template that takes epilogues but no prologue (a depthwise conv): the cast runs alone
            assert entries[chain[1].name] is None and isinstance(entries[chain[0].name], str), name
            tensors[chain[0].outputs[0].name] = chain[0].run(arrays[0])[0]
        tensors.update({t.name: t.value for op in chain for t in op.inputs if t.value is not None})
        ins = [np.ascontiguousarray(tensors[n]) for n in e["inputs"]]
        out = np.empty(chain[-1].outputs[0].shape, chain[-1].outputs[0].dtype)
        ia = (ctypes.c_void_p * len(ins))(*[a.ctypes.data for a in ins])
        oa = (ctypes.c_void_p * 1)(out.ctypes.data)
        fn = getattr(lib, e["symbol"])
        fn.restype = None
        fn(ia, oa)
        with np.errstate(all="ignore"):
            want = _reference(chain, arrays)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=name)
        checked += 1
    assert checked > len(CHAINS) // 2


def test_fused_cuda_kernels_generate_and_compile(tmp_path):
    ops = [op for _, chain, _ in CHAINS for op in chain]
    generate_cuda_source(fuse(ops))
    # a float16-rounded operand, a bias and an activation around a matmul: one tensor-core kernel
    c = CastOp([_f(40, 64)], to="float16")
    c2 = CastOp([c.outputs[0]], to="float32")
    mm = MatMul([c2.outputs[0], const_tensor(np.ones((64, 48), np.float32))])
    add = Binary([mm.outputs[0], const_tensor(np.ones(48, np.float32))], fn="add")
    act = Unary([add.outputs[0]], fn="tanh")
    src = generate_cuda_source(fuse([c, c2, mm, add, act]))
    assert [l.kind for l in src.launches.values()] == ["gemm-f32"]
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    res = build_cuda_library(ops, str(tmp_path / "k.cubin"), arch="sm_90", cache_dir=str(tmp_path / "c"), fuse=True)
    assert (tmp_path / "k.cubin").stat().st_size > 0
    assert any(v is None for v in res.values())


def test_split_views_fuse_and_other_views_stay_views():
    """A reshape that only splits dims (affine input index) joins a GEMM as its epilogue and
    element-wise ops around it; one that merges dims (div/mod index) and views left alone stay
    views (no kernel: drop_views leaves them out)."""
    from shardflow.compiler.codegen.fusion import drop_views
    from shardflow.compiler.ops.transform import Reshape

    rng = np.random.default_rng(0)
    x = const_tensor(rng.standard_normal((2, 8, 16)).astype(np.float32), "x")
    w = const_tensor(rng.standard_normal((16, 24)).astype(np.float32), "w")
    merge = Reshape([x], name="merge", shape=(16, 16))       # [B, S, K] -> [B*S, K]: div/mod index
    mm = MatMul([merge.outputs[0], w], name="mm")
    split = Reshape([mm.outputs[0]], name="split", shape=(2, 8, 24))  # [B*S, N] -> [B, S, N]: affine
    act = Unary([split.outputs[0]], name="act", fn="tanh")
    lone = Reshape([act.outputs[0]], name="lone", shape=(16, 24))
    ops = [merge, mm, split, act, lone]
    views = ["merge", "split", "lone"]
    groups = fuse(ops, views=views)
    assert [g.name for g in groups] == ["merge", "act", "lone"]
    assert _kinds(groups)[1] == ["MatMul", "Reshape", "Unary"]
    compiled = drop_views(groups, views)
    assert [g.name for g in compiled] == ["act"]
    # the fused kernel computes what the members compute; on cuda it is still a GEMM
    want = np.tanh(x.value.reshape(16, 16) @ w.value).reshape(2, 8, 24)
    np.testing.assert_allclose(compiled[0].numpy(x.value.reshape(16, 16), w.value)[0], want, rtol=1e-5)
    src = generate_cuda_source(compiled, arch="sm_90")
    assert src.launches["act"].kind == "gemm-f32"
    # views only: a group of them would be a copy, so they stay views
    v1 = Reshape([_f(4, 6)], name="v1", shape=(2, 2, 6))
    v2 = Reshape([v1.outputs[0]], name="v2", shape=(4, 6))
    assert drop_views(fuse([v1, v2], views=["v1", "v2"]), ["v1", "v2"]) == []


def test_padded_convolution_of_half_values_uses_half_tensor_cores():
    """A convolution reads its (materialized) float16 input through the padding select: its
    values are still exact in float16, so the product runs on the float16 tensor cores."""
    from shardflow.compiler.ops.conv import Conv

    x = _f(1, 16, 14, 14)
    r = Unary([x], fn="abs")
    c1 = CastOp([r.outputs[0]], to="float16")
    c2 = CastOp([c1.outputs[0]], to="float32")
    wc = CastOp([const_tensor(np.ones((32, 16, 3, 3), np.float16))], to="float32")
    conv = Conv([c2.outputs[0], wc.outputs[0]], pads=(1, 1, 1, 1))
    half = lambda op: op.op_type == "Cast" and op.outputs[0].dtype == "float16"  # noqa: E731
    groups = fuse([r, c1, c2, wc, conv], materialize=half)
    assert [l.kind for l in generate_cuda_source(groups, arch="sm_90").launches.values()] == ["elementwise",
                                                                                             "gemm-f16"]
    # a float32 operand (the abs written in float32 after the round trip) stays a float32 product
    plain = fuse([r, c1, c2, wc, conv])
    assert [l.kind for l in generate_cuda_source(plain, arch="sm_90").launches.values()] == ["elementwise",
                                                                                            "gemm-f32"]


def test_a_refused_group_keeps_its_longest_accepted_prefix():
    """A conv's group that ends in a reshape the conv template cannot apply (a ShuffleNet unit's
    channel split) is split into the conv with its element-wise epilogue and the reshape, which then
    runs as a view; a prefix is not cut off where the rest reads one of its inner tensors (the
    conv's output here): the conv then runs alone."""
    from shardflow.compiler.codegen.fusion import drop_views
    from shardflow.compiler.codegen.templates_cpu import accepts_epilogue, accepts_group, template_kind
    from shardflow.compiler.ops.conv import Conv
    from shardflow.compiler.ops.elementwise import Activation, CastOp
    from shardflow.compiler.ops.norm import BatchNorm
    from shardflow.compiler.ops.transform import Reshape

    def c(*shape):
        return const_tensor(np.ones(shape, np.float32))

    def groups(ops, views):
        return fuse(ops, barriers=lambda op: template_kind(op) is not None and not accepts_epilogue(op),
                    no_prologue=accepts_epilogue, accept=accepts_group, views=views)

    conv = Conv([_f(1, 16, 10, 10), c(16, 4, 3, 3)], name="conv", group=4, pads=(1, 1, 1, 1))
    assert template_kind(conv) == "Conv"
    bn = BatchNorm([conv.outputs[0], c(16), c(16), c(16), c(16)], name="bn", epsilon=1e-5)
    relu = Activation([bn.outputs[0]], name="relu", kind="relu")
    split = Reshape([relu.outputs[0]], name="split", shape=(1, 4, 4, 10, 10))
    got = groups([conv, bn, relu, split], ["split"])
    assert _kinds(got) == [["Conv", "BatchNorm", "Activation"], "Reshape"]
    assert template_kind(got[0]) == "Fused" and [g.name for g in drop_views(got, ["split"])] == ["relu"]

    relu = Activation([conv.outputs[0]], name="relu", kind="relu")  # conv -> relu(y) * -y: members that read
    neg = Unary([conv.outputs[0]], name="neg", fn="neg")  # the conv's value and each other's: one epilogue
    mul = Binary([relu.outputs[0], neg.outputs[0]], name="mul", fn="mul")
    got = groups([conv, relu, neg, mul], [])
    assert _kinds(got) == [["Conv", "Activation", "Unary", "Binary"]] and template_kind(got[0]) == "Fused"

    # conv -> relu(y) * float(half(y)): the epilogue computes in float32 only, so the group is refused; the
    # rest reads the conv's value, so no prefix is cut off and the conv runs alone
    half = CastOp([conv.outputs[0]], name="half", to="float16")
    back = CastOp([half.outputs[0]], name="back", to="float32")
    mul = Binary([relu.outputs[0], back.outputs[0]], name="mul", fn="mul")
    got = groups([conv, relu, half, back, mul], [])
    assert _kinds(got) == ["Conv", ["Activation", "Cast", "Cast", "Binary"]]


def _qdq_softmax_model(scores: bool):
    """x -> Q/DQ -> * 0.125 -> Q/DQ -> Softmax -> Q/DQ (``probs``; the softmax's input ``scores``
    also an output with ``scores``) as a QDQ model writes a quantized attention's softmax, and two
    integer casts: ``kept`` = float(uint8(i)) of any int32 (the byte conversion wraps, so it must
    stay), ``clipped`` = the same of Clip(i, 0, 255) (the conversion changes nothing and may go)."""
    from onnx import TensorProto, helper, numpy_helper

    def qdq(x, y, s, z):
        inits.extend([numpy_helper.from_array(np.array(s, np.float32), f"{y}_s"),
                      numpy_helper.from_array(np.array(z, np.uint8), f"{y}_z")])
        nodes.append(helper.make_node("QuantizeLinear", [x, f"{y}_s", f"{y}_z"], [f"{y}_q"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"{y}_q", f"{y}_s", f"{y}_z"], [y]))
    nodes, inits = [], [numpy_helper.from_array(np.array(0.125, np.float32), "eighth"),
                        numpy_helper.from_array(np.array(0, np.int32), "lo"),
                        numpy_helper.from_array(np.array(255, np.int32), "hi")]
    qdq("x", "xq", 0.0887, 114)
    nodes.append(helper.make_node("Mul", ["xq", "eighth"], ["xs"]))
    qdq("xs", "scores", 0.0111, 114)
    nodes.append(helper.make_node("Softmax", ["scores"], ["p"], axis=-1))
    qdq("p", "probs", 1 / 255, 0)
    nodes += [helper.make_node("Cast", ["i"], ["ib"], to=TensorProto.UINT8),
              helper.make_node("Cast", ["ib"], ["kept"], to=TensorProto.FLOAT),
              helper.make_node("Clip", ["i", "lo", "hi"], ["ic"]),
              helper.make_node("Cast", ["ic"], ["icb"], to=TensorProto.UINT8),
              helper.make_node("Cast", ["icb"], ["clipped"], to=TensorProto.FLOAT)]
    f = lambda n, t, s: helper.make_tensor_value_info(n, t, s)  # noqa: E731
    outs = [f(n, TensorProto.FLOAT, [2, 8, 96]) for n in ["probs"] + ["scores"] * scores]
    graph = helper.make_graph(nodes, "qdq_softmax", [f("x", TensorProto.FLOAT, [2, 8, 96]),
                                                     f("i", TensorProto.INT32, [2, 300])],
                              outs + [f("kept", TensorProto.FLOAT, [2, 300]), f("clipped", TensorProto.FLOAT, [2, 300])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_quantize_dequantize_chains_stay_in_32_bit_lanes_and_are_computed_once(tmp_path):
    """A QDQ model's softmax reads ``float(uint8(clamp(round(x / s) + z, 0, 255)))`` per step:
    the byte conversion changes no value (the clamp bounds it), and without it the C compiler
    keeps the chain in 32-bit lanes (2.8x faster); the max pass keeps the chain's values in the
    output's row for the exponent pass (the input is read once per element). Values equal onnxruntime's
    (the scores exactly; the probabilities within one quantization step, exp's rounding), and a
    byte conversion that can wrap stays."""
    from onnxruntime import InferenceSession, SessionOptions

    from shardflow.compiler import compile, load_onnx
    from shardflow.compiler.codegen import generate_cpu_source
    from shardflow.runtime import load

    g = load_onnx(_qdq_softmax_model(scores=False))
    kernels = [text for _, text in generate_cpu_source(fuse(g.nodes, keep={t.name for t in g.outputs})).kernels]
    softmax, = [k for k in kernels if "sf_exp(" in k]
    body = softmax[softmax.index("// output"):]
    assert "(uint8_t)" not in body and body.count("sf_round(") == 3, body
    # (the max pass's values kept in the output's row, the exponentials in a row array)
    assert len(re.findall(r"\bin0\[", body)) == 1 and body.count("alignas(64)") == 1, body
    assert re.search(r"out0\[[^\]]*k0\] = t\d+;", body), body
    kept, clipped = ([k[k.index("// output"):] for k in kernels if f"// ops: Cast({n})" in k] for n in ("kept", "clipped"))
    assert "(uint8_t)" in kept[0] and "(uint8_t)" not in clipped[0]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 8, 96)) * 8).astype(np.float32)
    x[0, 0, :4] = [np.nan, np.inf, -np.inf, 0.04435]   # NaN, saturation, a tie at half a step
    i = np.concatenate([np.arange(-300, 0), np.arange(0, 300) * 1000003 % 700 - 200]).reshape(2, 300).astype(np.int32)
    feeds = {"x": x, "i": i}
    opts = SessionOptions()
    opts.graph_optimization_level = opts.graph_optimization_level.ORT_DISABLE_ALL
    for scores in (False, True):
        model = _qdq_softmax_model(scores)
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                out_dir=str(tmp_path / f"qdq{scores}"))
        got = load(str(tmp_path / f"qdq{scores}"), rank=0).run(feeds)
        sess = InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        if scores:
            np.testing.assert_array_equal(got["scores"], want["scores"])
        np.testing.assert_allclose(got["probs"], want["probs"], rtol=0, atol=1 / 255 + 1e-6)
        np.testing.assert_array_equal(got["kept"], i.astype(np.uint8).astype(np.float32))
        np.testing.assert_array_equal(got["kept"], want["kept"])
        np.testing.assert_array_equal(got["clipped"], np.clip(i, 0, 255).astype(np.float32))


def test_a_layer_norm_output_reads_the_mean_pass_row_of_a_quantized_input(tmp_path):
    """LayerNorm of a dequantized value plus a residual: the mean pass stores the chain's values
    in the output's row, and both the variance pass and the output loop read it (the chain's rounding
    is printed once); values equal onnxruntime's."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime import InferenceSession

    from shardflow.compiler import compile, load_onnx
    from shardflow.compiler.codegen import generate_cpu_source
    from shardflow.runtime import load

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(np.array(0.021, np.float32), "s"),
             numpy_helper.from_array(np.array(7, np.uint8), "z"),
             numpy_helper.from_array(rng.standard_normal(256).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(256).astype(np.float32), "beta")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("Add", ["d", "r"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    f = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "ln", [f("x", TensorProto.FLOAT, [6, 256]), f("r", TensorProto.FLOAT, [6, 256])],
                              [f("y", TensorProto.FLOAT, [6, 256])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    g = load_onnx(model)
    kernel, = [text for _, text in generate_cpu_source(fuse(g.nodes, keep={t.name for t in g.outputs})).kernels]
    body = kernel[kernel.index("// output"):]
    assert body.count("sf_round(") == 1 and re.search(r"out0\[[^\]]*k0\] = t\d+;", body), body
    out_loop = body[body.rindex("for ("):]
    assert "= ((((out0[" in out_loop and "in0[" not in out_loop, out_loop
    feeds = {"x": (rng.standard_normal((6, 256)) * 2).astype(np.float32),
             "r": rng.standard_normal((6, 256)).astype(np.float32)}
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=str(tmp_path))
    got = load(str(tmp_path), rank=0).run(feeds)["y"]
    want = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_scalar_is_computed_once_per_row_and_the_output_loop_vectorizes(tmp_path):
    """A QDQ RMSNorm: the row's quantized ``1 / sqrt(mean(x^2) + eps)`` depends on the row only and
    is computed into a local before the output loop (not per element), and that loop is vectorized
    by the C++ compiler (x86-64-v3). Computed inside it, the clamps' selects on the row value became
    a loop-invariant mask GCC 12 did not vectorize (a QDQ Llama's RMSNorm kernels: 2.5 ms, not 0.2).
    Values equal onnxruntime's."""
    import platform
    import subprocess

    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime import InferenceSession

    from shardflow.compiler import compile, load_onnx
    from shardflow.compiler.codegen import generate_cpu_source, toolchain
    from shardflow.runtime import load

    def qdq(x, y, s, z):
        inits.extend([numpy_helper.from_array(np.array(s, np.float32), f"{y}_s"),
                      numpy_helper.from_array(np.array(z, np.uint8), f"{y}_z")])
        nodes.append(helper.make_node("QuantizeLinear", [x, f"{y}_s", f"{y}_z"], [f"{y}_q"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"{y}_q", f"{y}_s", f"{y}_z"], [y]))
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
             numpy_helper.from_array(rng.standard_normal(512).astype(np.float32), "w")]
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"])]
    qdq("mse", "msq", 0.0045, 0)
    nodes += [helper.make_node("Sqrt", ["msq"], ["rt"]), helper.make_node("Reciprocal", ["rt"], ["inv"])]
    qdq("inv", "invq", 0.0054, 0)
    nodes += [helper.make_node("Mul", ["x", "invq"], ["xn"]), helper.make_node("Mul", ["xn", "w"], ["h"])]
    qdq("h", "y", 0.033, 125)
    f = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "rms", [f("x", TensorProto.FLOAT, [16, 512])],
                              [f("y", TensorProto.FLOAT, [16, 512])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = load_onnx(model)
    src = generate_cpu_source(fuse(g.nodes, keep={t.name for t in g.outputs}))
    kernel, = [text for _, text in src.kernels if "sf_sqrt(" in text]
    loop = kernel.rindex("for (")
    assert "sf_sqrt(" in kernel[kernel.index("// output"):loop] and "sf_sqrt(" not in kernel[loop:], kernel
    if platform.machine() in ("x86_64", "AMD64"):
        whole, _ = src.units(1)[0]
        (tmp_path / "k.cpp").write_text(whole)
        flags = [x for x in toolchain.compile_flags(2) if x not in ("-shared", "-w") and not x.startswith("-m")]
        res = subprocess.run(["g++"] + flags + ["-march=x86-64-v3", "-c", str(tmp_path / "k.cpp"), "-o",
                                                str(tmp_path / "k.o"), "-fopt-info-vec-optimized"],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        line = whole[:whole.index(kernel) + loop].count("\n") + 1
        assert re.search(rf"k\.cpp:{line}:\d+: optimized: loop vectorized", res.stderr), (line, res.stderr[-3000:])
    x = rng.standard_normal((16, 512)).astype(np.float32)
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=str(tmp_path / "o"))
    got = load(str(tmp_path / "o"), rank=0).run({"x": x})["y"]
    want = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=0.033 + 1e-6)


def test_a_concatenations_parts_are_loops_of_their_own(tmp_path):
    """A concatenation over an outer axis, one part SiLU'd (YOLOv8's C2f blocks, channels blocked by 16):
    the branch on the part is printed around copies of the innermost loop, one per part, not inside
    one loop, where GCC if-converted all the parts into masked vector code (32x slower); past
    UNSWITCH_MAX_COPIES parts the rest stay branches. Values equal onnxruntime's."""
    from onnx import TensorProto, helper
    from onnxruntime import InferenceSession

    from shardflow.compiler import compile, load_onnx
    from shardflow.compiler.codegen import generate_cpu_source
    from shardflow.compiler.codegen.cpp import UNSWITCH_MAX_COPIES
    from shardflow.runtime import load

    f = helper.make_tensor_value_info
    for parts in (3, UNSWITCH_MAX_COPIES + 4):
        names = [f"p{k}" for k in range(parts)]
        nodes = [helper.make_node("Sigmoid", ["p0"], ["s"]), helper.make_node("Mul", ["p0", "s"], ["silu"]),
                 helper.make_node("Concat", ["silu"] + names[1:], ["y"], axis=1)]
        graph = helper.make_graph(nodes, "cat", [f(n, TensorProto.FLOAT, [1, 2, 5, 16]) for n in names],
                                  [f("y", TensorProto.FLOAT, [1, 2 * parts, 5, 16])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        g = load_onnx(model)
        kernel, = [text for _, text in generate_cpu_source(fuse(g.nodes)).kernels]
        assert len(re.findall(r"for \(int64_t (\w+) = 0; \1 < 16;", kernel)) == min(parts, UNSWITCH_MAX_COPIES), kernel
        rng = np.random.default_rng(parts)
        feeds = {n: rng.standard_normal((1, 2, 5, 16)).astype(np.float32) * 4 for n in names}
        out = tmp_path / f"o{parts}"
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
        got = load(str(out), rank=0).run(feeds)["y"]
        want = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _scan_model(steps: int, nodes: list, outputs: dict, inits: list):
    """A Scan over the rows of ``x [steps, 4]`` of ``s' = s / 2 + x[t]``, outputs ``last`` (the final
    ``s'``) and ``ys`` (``tanh(s')`` per step), then ``nodes``; ``outputs``: name -> shape."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Mul", ["s", "half"], ["h"]), helper.make_node("Add", ["h", "xt"], ["s2"]),
         helper.make_node("Tanh", ["s2"], ["y"])], "body",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("s", "xt")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("s2", "y")])
    graph = helper.make_graph(
        [helper.make_node("Scan", ["s0", "x"], ["last", "ys"], body=body, num_scan_inputs=1)] + nodes, "scan",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in outputs.items()],
        [helper.make_tensor("s0", TensorProto.FLOAT, [4], [0.0] * 4),
         helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])] + inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_concatenation_read_at_a_known_index_is_lowered_as_the_part_it_reads(tmp_path):
    """A Scan (unrolled at import: one step per row, the outputs concatenated) whose output is read
    at one row fuses into one kernel; the concatenation's tests on the row index are decided at
    lowering (the index is a constant), so the kernel computes that row's chain of steps and no
    other. Undecided, every row's chain was lowered in its branch: a 16-step Scan fused after a
    Loop generated 17 MB of C++ and took 80 s to compile."""
    from onnx import TensorProto, helper

    from shardflow.compiler import compile, load_onnx
    from shardflow.compiler.codegen import generate_cpu_source
    from shardflow.runtime import load

    steps, row = 12, 5
    model = _scan_model(steps, [helper.make_node("Gather", ["ys", "row"], ["out"], axis=0)], {"out": [4]},
                        [helper.make_tensor("row", TensorProto.INT64, [], [row])])
    g = load_onnx(model)
    kernel, = [text for _, text in generate_cpu_source(fuse(g.nodes, keep={t.name for t in g.outputs})).kernels]
    body_text = kernel[kernel.index("// output"):]
    assert body_text.count("sf_tanh(") == 1 and "if (" not in body_text and "?" not in body_text, body_text
    x = np.random.default_rng(0).standard_normal((steps, 4)).astype(np.float32)
    s = np.zeros(4, np.float32)
    for t in range(row + 1):
        s = s * np.float32(0.5) + x[t]
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=str(tmp_path))
    np.testing.assert_allclose(load(str(tmp_path), rank=0).run({"x": x})["out"], np.tanh(s), rtol=1e-6)


def test_an_unrolled_element_wise_scan_fuses_in_bounded_groups(tmp_path):
    """A 100-step Scan of a ``tanh`` recurrence unrolls into about 500 element-wise and layout ops
    that would all fuse into one kernel whose per-element code grows with the square of the steps (each stacked
    output is read in a branch that recomputes the states before it); groups stop at
    MAX_GROUP_OPS members, and the program still computes the recurrence."""
    from onnx import helper

    from shardflow.compiler import compile, load_onnx
    from shardflow.compiler.codegen.fusion import MAX_GROUP_OPS
    from shardflow.runtime import load

    steps = 100
    reduce = helper.make_node("ReduceSum", ["ys"], ["out"], keepdims=0)
    model = _scan_model(steps, [reduce], {"out": [], "last": [4]}, [])
    g = load_onnx(model)
    groups = fuse(g.nodes, keep={t.name for t in g.outputs})
    sizes = [len(k.members) for k in groups if isinstance(k, FusedOp)]
    assert len(g.nodes) > 3 * steps and max(sizes) == MAX_GROUP_OPS, sizes
    x = np.random.default_rng(0).standard_normal((steps, 4)).astype(np.float32)
    s, total = np.zeros(4, np.float32), np.float32(0)
    for t in range(steps):
        s = s * np.float32(0.5) + x[t]
        total = total + np.tanh(s).sum()
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=str(tmp_path))
    got = load(str(tmp_path)).run({"x": x})
    np.testing.assert_allclose(got["last"], s, rtol=1e-5)
    np.testing.assert_allclose(got["out"], total, rtol=1e-4)


def test_element_wise_kernels_merge_trailing_dims_every_operand_spans_alike(tmp_path, kernel_cache):
    """coalesce_elementwise: an element-wise chain's kernel runs over its output's trailing dims merged
    where every tensor spans both or neither (a per-channel scale spans neither of H and W; a row
    vector [1, 1, 1, 7] spans W only and keeps the dims); the kernel computes the same values, and its
    innermost loop walks all of H * W."""
    from shardflow.compiler.codegen.cpp import generate_cpu_source
    from shardflow.compiler.codegen.fusion import coalesce_elementwise

    rng = np.random.default_rng(0)
    x = Tensor("x", (2, 8, 5, 7), "float32")
    scale = const_tensor(rng.standard_normal((1, 8, 1, 1)).astype(np.float32))
    res = Tensor("res", (1, 1, 5, 7), "uint8")
    ops = [Binary([x, scale], fn="mul", name="s")]
    ops.append(Binary([ops[-1].outputs[0], CastOp([res], to="float32", name="c").outputs[0]], fn="add", name="a"))
    ops.insert(1, ops[-1].inputs[1].producer)
    ops.append(Unary([ops[-1].outputs[0]], fn="neg", name="n"))
    group, = fuse(ops)
    merged = coalesce_elementwise(group)
    assert merged.outputs[0].shape == (2, 8, 35) and [t.shape for t in merged.inputs][1:] == [(1, 8, 1), (1, 1, 35)]
    assert "< 35; ++" in generate_cpu_source([group]).text
    row = Binary([x, const_tensor(np.ones((1, 1, 1, 7), np.float32))], fn="add", name="r")
    assert coalesce_elementwise(row) is row
    if shutil.which("g++") is None:
        return
    feeds = {"x": rng.standard_normal((2, 8, 5, 7)).astype(np.float32), "res": rng.integers(0, 256, (1, 1, 5, 7))
             .astype(np.uint8)}
    want = -(feeds["x"] * scale.value + feeds["res"].astype(np.float32))
    entries = build_cpu_library(ops, str(tmp_path / "m.so"), cache_dir=kernel_cache, opt_level=1, fuse=True)
    e = entries["n"]
    lib = ctypes.CDLL(str(tmp_path / "m.so"))
    values = {"x": feeds["x"], "res": feeds["res"], scale.name: scale.value}
    ins = [np.ascontiguousarray(values[n]) for n in e["inputs"]]
    out = np.empty((2, 8, 5, 7), np.float32)
    fn = getattr(lib, e["symbol"])
    fn.restype = None
    fn((ctypes.c_void_p * len(ins))(*[v.ctypes.data for v in ins]), (ctypes.c_void_p * 1)(out.ctypes.data))
    np.testing.assert_array_equal(out, want)
