"""RNN, GRU and LSTM, unrolled at import (compiler/frontend/handlers_recurrent.py), against onnxruntime.

Each case builds a small model with random weights (fixed seeds) and compares every output with
onnxruntime's CPU kernels; between them the cases cover the three directions, every optional input
(given as a constant and as a graph input), every activation the spec names with its alpha/beta,
``clip``, ``input_forget``, ``linear_before_reset``, ``layout`` and ``sequence_lens`` (constant
and at run time, including an empty sequence). The last tests compile an LSTM for the cpu target
and run a 2-rank sharded plan, and check the typed errors of what is refused.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import ModelFormatError, ShapeError, UnsupportedOperatorError, load_onnx

ort = pytest.importorskip("onnxruntime")

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
              np.dtype(np.int32): TensorProto.INT32}


def operands(op, seq, batch, inp, hidden, nd, *, dtype=np.float32, seed=0, bias=True, lens=None, initial_h=False,
             initial_c=False, peepholes=False, layout=0):
    """Random inputs of ``op`` in ONNX input order (None for the ones left out)."""
    rng = np.random.default_rng(seed)
    g = GATES[op]

    def rand(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    state = (batch, nd, hidden) if layout else (nd, batch, hidden)
    vals = {"X": rand(*((batch, seq, inp) if layout else (seq, batch, inp)), scale=1.0),
            "W": rand(nd, g * hidden, inp), "R": rand(nd, g * hidden, hidden),
            "B": rand(nd, 2 * g * hidden) if bias else None,
            "sequence_lens": None if lens is None else np.asarray(lens, np.int32),
            "initial_h": rand(*state) if initial_h else None}
    if op == "LSTM":
        vals["initial_c"] = rand(*state) if initial_c else None
        vals["P"] = rand(nd, 3 * hidden) if peepholes else None
    return vals


def build(op, vals, attrs, *, opset=14, runtime=("X",), outputs=None, name="rec"):
    """A model with one ``op`` node; the inputs named in ``runtime`` are graph inputs, the others
    initializers. ``outputs`` names the node's outputs ('' leaves one out); by default all of them."""
    n_out = 3 if op == "LSTM" else 2
    outputs = list(outputs) if outputs is not None else ["Y", "Y_h", "Y_c"][:n_out]
    names = list(vals)
    while names and vals[names[-1]] is None:
        names.pop()
    node_inputs, graph_inputs, inits = [], [], []
    for k in names:
        v = vals[k]
        node_inputs.append("" if v is None else k)
        if v is None:
            continue
        if k in runtime:
            graph_inputs.append(helper.make_tensor_value_info(k, NP_TO_ONNX[v.dtype], list(v.shape)))
        else:
            inits.append(numpy_helper.from_array(v, k))
    node = helper.make_node(op, node_inputs, outputs, name=name, **attrs)
    dtype = NP_TO_ONNX[vals["X"].dtype]
    layout, nd = attrs.get("layout", 0), 2 if attrs.get("direction") == "bidirectional" else 1
    x, hidden = vals["X"].shape, attrs["hidden_size"]
    seq, batch = (x[1], x[0]) if layout else (x[0], x[1])
    shapes = {"Y": [batch, seq, nd, hidden] if layout else [seq, nd, batch, hidden],
              "Y_h": [batch, nd, hidden] if layout else [nd, batch, hidden]}
    outs = [helper.make_tensor_value_info(o, dtype, shapes.get(o, shapes["Y_h"])) for o in outputs if o]
    graph = helper.make_graph([node], "g", graph_inputs, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_ours(model, feeds):
    g = load_onnx(model)
    return g.run(feeds), g


def run_ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def check(op, vals, attrs, *, runtime=("X",), opset=14, outputs=None, rtol=1e-4, atol=1e-5):
    """Compare every output of ours with onnxruntime's; return ours. onnxruntime runs float64
    models in float32 (it has no float64 kernels for these ops)."""
    feeds = {k: vals[k] for k in runtime if vals.get(k) is not None}
    model = build(op, vals, attrs, opset=opset, runtime=runtime, outputs=outputs)
    got, _ = run_ours(model, feeds)
    if vals["X"].dtype == np.float64:
        vals = {k: v.astype(np.float32) if v is not None and v.dtype == np.float64 else v for k, v in vals.items()}
        model = build(op, vals, attrs, opset=opset, runtime=runtime, outputs=outputs)
    want = run_ort(model, {k: vals[k] for k in feeds})
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].dtype == feeds["X"].dtype, k
        np.testing.assert_allclose(got[k], v, rtol=rtol, atol=atol, err_msg=k)
    return got


# RNN ------------------------------------------------------------------------------------------------

def test_rnn_forward_with_bias_and_initial_state():
    vals = operands("RNN", 5, 3, 4, 6, 1, initial_h=True)
    check("RNN", vals, {"hidden_size": 6}, runtime=("X", "initial_h"))


def test_rnn_reverse_relu_with_clip_at_opset_7():
    vals = operands("RNN", 4, 2, 3, 5, 1, initial_h=True, seed=1)
    check("RNN", vals, {"hidden_size": 5, "direction": "reverse", "activations": ["Relu"], "clip": 0.7}, opset=7)


def test_rnn_bidirectional_with_runtime_sequence_lens():
    # onnxruntime's RNN reads activation_alpha by direction: give one value per direction
    vals = operands("RNN", 5, 3, 4, 4, 2, lens=[5, 2, 3], initial_h=True, seed=2)
    y = check("RNN", vals, {"hidden_size": 4, "direction": "bidirectional", "activations": ["LeakyRelu", "Elu"],
                            "activation_alpha": [0.3, 0.7]}, runtime=("X", "sequence_lens", "initial_h"))
    assert not y["Y"][2:, :, 1].any() and not y["Y"][3:, :, 2].any()   # zero past each length


@pytest.mark.parametrize("op,opset,attrs", [
    ("RNN", 1, {"activations": ["Softsign"], "output_sequence": 1}),
    ("GRU", 1, {}),
    ("GRU", 3, {"linear_before_reset": 1}),
    ("LSTM", 1, {"input_forget": 1}),
])
def test_old_opsets_match_opset_7(op, opset, attrs):
    """onnxruntime has no kernels before opset 7; the equations are the same."""
    vals = operands(op, 3, 2, 3, 4, 1, initial_h=True, seed=3)
    feeds = {"X": vals["X"]}
    old, _ = run_ours(build(op, vals, {"hidden_size": 4, **attrs}, opset=opset), feeds)
    attrs.pop("output_sequence", None)
    new = run_ort(build(op, vals, {"hidden_size": 4, **attrs}, opset=7), feeds)
    for k in new:
        np.testing.assert_allclose(old[k], new[k], rtol=1e-4, atol=1e-5, err_msg=k)


# GRU ------------------------------------------------------------------------------------------------

def test_gru_defaults_without_bias_only_y_h():
    vals = operands("GRU", 4, 2, 3, 5, 1, bias=False, seed=4)
    check("GRU", vals, {"hidden_size": 5}, outputs=["", "Y_h"])


@pytest.mark.parametrize("lbr", [0, 1])
def test_gru_bidirectional_with_constant_sequence_lens(lbr):
    vals = operands("GRU", 5, 4, 3, 4, 2, lens=[5, 0, 3, 1], initial_h=True, seed=5 + lbr)
    check("GRU", vals, {"hidden_size": 4, "direction": "bidirectional", "linear_before_reset": lbr},
          runtime=("X",), opset=22)


def test_gru_reverse_hardsigmoid_softsign_clip_float64():
    vals = operands("GRU", 4, 3, 2, 3, 1, initial_h=True, dtype=np.float64, lens=[4, 2, 3], seed=7)
    check("GRU", vals, {"hidden_size": 3, "direction": "reverse", "activations": ["HardSigmoid", "Softsign"],
                        "activation_alpha": [0.25], "activation_beta": [0.45], "clip": 1.5, "linear_before_reset": 1},
          runtime=("X", "B", "initial_h", "sequence_lens"))


# LSTM -----------------------------------------------------------------------------------------------

def test_lstm_forward_defaults_at_opset_7():
    vals = operands("LSTM", 5, 2, 3, 4, 1, bias=False, seed=8)
    check("LSTM", vals, {"hidden_size": 4}, opset=7)


def test_lstm_bidirectional_with_every_optional_input_at_run_time():
    vals = operands("LSTM", 6, 4, 3, 5, 2, lens=[6, 3, 0, 1], initial_h=True, initial_c=True, peepholes=True, seed=9)
    y = check("LSTM", vals, {"hidden_size": 5, "direction": "bidirectional"},
              runtime=("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"), opset=22)
    assert not y["Y_h"][:, 2].any() and not y["Y_c"][:, 2].any()     # the empty sequence


def test_lstm_reverse_input_forget_clip_peepholes_constant_lens():
    vals = operands("LSTM", 5, 3, 4, 3, 1, lens=[2, 5, 4], initial_h=True, initial_c=True, peepholes=True, seed=10)
    check("LSTM", vals, {"hidden_size": 3, "direction": "reverse", "input_forget": 1, "clip": 0.8},
          runtime=("X", "initial_c"))


def test_lstm_every_remaining_activation_with_alpha_and_beta():
    vals = operands("LSTM", 4, 2, 3, 4, 2, initial_h=True, seed=11)
    acts = ["Sigmoid", "Affine", "ScaledTanh", "HardSigmoid", "ThresholdedRelu", "Softplus"]
    # consumed in order by the activations that take them: Affine, ScaledTanh, HardSigmoid, ThresholdedRelu
    check("LSTM", vals, {"hidden_size": 4, "direction": "bidirectional", "activations": acts,
                         "activation_alpha": [0.8, 1.3, 0.3, 0.1], "activation_beta": [0.1, 0.6, 0.4]})


def test_lstm_relu_cell_and_lower_case_names():
    vals = operands("LSTM", 3, 2, 3, 4, 1, seed=12)
    check("LSTM", vals, {"hidden_size": 4, "activations": ["sigmoid", "relu", "tanh"]})


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_layout_1_is_the_transpose_of_layout_0(op):
    nd = 2
    vals = operands(op, 4, 3, 2, 3, nd, lens=[4, 1, 3], initial_h=True, initial_c=True, layout=1, seed=13)
    runtime = ("X", "sequence_lens", "initial_h", "initial_c")
    attrs = {"hidden_size": 3, "direction": "bidirectional"}
    got, _ = run_ours(build(op, vals, {**attrs, "layout": 1}, runtime=runtime),
                      {k: vals[k] for k in runtime if vals.get(k) is not None})
    time_major = dict(vals, X=vals["X"].transpose(1, 0, 2), initial_h=vals["initial_h"].transpose(1, 0, 2))
    if op == "LSTM":
        time_major["initial_c"] = vals["initial_c"].transpose(1, 0, 2)
    want = run_ort(build(op, time_major, attrs, runtime=runtime),
                   {k: time_major[k] for k in runtime if time_major.get(k) is not None})
    np.testing.assert_allclose(got["Y"], want["Y"].transpose(2, 0, 1, 3), rtol=1e-4, atol=1e-5)
    for k in ("Y_h", "Y_c")[:2 if op == "LSTM" else 1]:
        np.testing.assert_allclose(got[k], want[k].transpose(1, 0, 2), rtol=1e-4, atol=1e-5)


def test_constant_lengths_leave_out_the_steps_nobody_needs():
    vals = operands("LSTM", 6, 2, 3, 4, 1, lens=[2, 3], seed=14)
    _, g = run_ours(build("LSTM", vals, {"hidden_size": 4}), {"X": vals["X"]})
    assert sum(op.op_type == "Gemm" for op in g.nodes) == 1 + 3   # the input projection + 3 live steps
    assert {op.op_type for op in g.nodes} <= {"Gemm", "Slice", "Reshape", "Concat", "Binary", "Activation",
                                               "Unary", "Where", "Clip", "Transpose"}


# compiled and sharded ---------------------------------------------------------------------------------

def lstm_model():
    vals = operands("LSTM", 3, 4, 8, 8, 2, lens=[3, 2, 3, 1], initial_h=True, peepholes=True, seed=15)
    runtime = ("X", "sequence_lens")
    model = build("LSTM", vals, {"hidden_size": 8, "direction": "bidirectional"}, runtime=runtime)
    feeds = {k: vals[k] for k in runtime}
    return model, feeds, run_ort(model, feeds)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_lstm_compiled_for_cpu_matches_onnxruntime(tmp_path):
    from shardflow.compiler import compile
    from shardflow.runtime import load

    model, feeds, want = lstm_model()
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path)
    got = load(tmp_path).run(feeds)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_lstm_on_two_ranks_matches_onnxruntime():
    """The unrolled LSTM split over two ranks under a memory budget that replication does not fit
    (the Megatron baseline keeps its products whole now: each step reads the whole state, so a
    column split is gathered every step; the ILP still finds that plan, the cheapest that fits)."""
    from shardflow.compiler.parallel import partition, search, simulate

    model, feeds, want = lstm_model()
    g = load_onnx(model)
    assert search(g, {"mesh_shape": [2], "algo": "megatron"}).to_text().count("via ") == 0
    plan = search(g, {"mesh_shape": [2], "memory_budget_bytes": 8200})
    ranks = partition(g, plan)
    assert {op.op_type for op in ranks[0].nodes} - {op.op_type for op in g.nodes}   # collectives were injected
    got = simulate(ranks, feeds)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


# what is refused --------------------------------------------------------------------------------------

def refused(op, vals, attrs, error, match, **kw):
    with pytest.raises(error, match=match) as info:
        load_onnx(build(op, vals, attrs, **kw))
    assert "node rec" in str(info.value)


def test_too_long_a_sequence_is_refused():
    vals = operands("GRU", 4097, 1, 1, 1, 1, bias=False)
    refused("GRU", vals, {"hidden_size": 1}, UnsupportedOperatorError, "4097 time steps.*at most 4096")


def test_unknown_activation_is_refused():
    vals = operands("RNN", 2, 1, 2, 2, 1)
    refused("RNN", vals, {"hidden_size": 2, "activations": ["Gelu"]}, UnsupportedOperatorError,
            "activation 'Gelu'.*Softplus")


@pytest.mark.parametrize("attrs,match", [
    ({"activations": ["Sigmoid", "ScaledTanh", "Tanh"]}, "ScaledTanh needs values"),
    ({"activations": ["Sigmoid", "Tanh", "LeakyRelu"], "activation_alpha": [0.0, 0.0, 0.3]}, "left over"),
    ({"activations": ["Sigmoid", "Tanh"]}, r"must list 3 functions"),
    ({"direction": "sideways"}, "direction must be"),
    ({"clip": -1.0}, "clip=-1.0"),
])
def test_bad_attributes_are_model_format_errors(attrs, match):
    vals = operands("LSTM", 2, 1, 2, 2, 1)
    refused("LSTM", vals, {"hidden_size": 2, **attrs}, ModelFormatError, match)


def test_bad_operands_are_typed_errors():
    vals = operands("LSTM", 3, 2, 2, 2, 1, lens=[3, 4])
    refused("LSTM", vals, {"hidden_size": 2}, ModelFormatError, r"sequence_lens \[3, 4\] must lie in \[0, 3\]")
    vals = operands("GRU", 3, 2, 2, 2, 1)
    refused("GRU", vals, {"hidden_size": 3}, ShapeError, r"W has shape \(1, 6, 2\), expected \(1, 9, 2\)")
    vals = operands("RNN", 3, 2, 2, 2, 1, initial_h=True)
    vals["initial_h"] = vals["initial_h"][:, :1]
    refused("RNN", vals, {"hidden_size": 2}, ShapeError, "initial state 'initial_h' has shape")
