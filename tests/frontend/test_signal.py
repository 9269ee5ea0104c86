"""DFT and STFT: imported models against onnxruntime (or the ONNX reference evaluator where
onnxruntime lacks the case or disagrees with the specification), the matrices against numpy.fft,
errors by type and message, a DFT model compiled for the cpu target and one sharded over two ranks."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from shardflow.compiler import ModelFormatError, ShapeError, UnsupportedOperatorError, compile, load_onnx
from shardflow.compiler.frontend.handlers_signal import dft_matrix, irfft_matrix
from shardflow.compiler.parallel import partition, search, simulate
from shardflow.runtime import load

ort = pytest.importorskip("onnxruntime")
from onnx_oracles import run_ort, run_reference  # noqa: E402

_TYPES = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.float64): onnx.TensorProto.DOUBLE,
          np.dtype(np.int64): onnx.TensorProto.INT64}


def make_model(op: str, opset: int, inputs: dict, consts: dict | None = None, order: list | None = None,
               **attrs) -> onnx.ModelProto:
    """A one-node model reading the graph inputs ``inputs`` and the initializers ``consts`` in ``order``
    (default: ``inputs`` then ``consts``; ``""`` leaves an optional input out); output ``y`` of rank 4
    (DFT inputs here have rank 4, as do STFT outputs) in the first input's type."""
    consts = consts or {}
    node = helper.make_node(op, order or [*inputs, *consts], ["y"], name="node0", **attrs)
    first = _TYPES[next(iter(inputs.values())).dtype]
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, _TYPES[v.dtype], v.shape) for n, v in inputs.items()],
        [helper.make_tensor_value_info("y", first, [None] * 4)],
        [numpy_helper.from_array(v, n) for n, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def check(model: onnx.ModelProto, feeds: dict, reference=run_ort, tol: float = 2e-5) -> np.ndarray:
    """Import ``model``, run it with numpy, compare ``y`` with ``reference``; return ours."""
    want = reference(model, feeds)
    got = load_onnx(model).run(feeds)["y"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return got


def signal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def as_complex(y: np.ndarray) -> np.ndarray:
    return y[..., 0] + 1j * y[..., 1] if y.shape[-1] == 2 else y[..., 0]


# the matrices ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,length,inverse", [(8, 8, False), (5, 8, True), (5, 5, True), (3, 8, False)])
def test_dft_matrix_is_numpy_fft(rows, length, inverse):
    # rows < length: the samples past the input are zeros (padding)
    x = np.random.default_rng(0).standard_normal((3, rows, 2))
    window = np.linspace(0.5, 1.5, rows)
    y = x.reshape(3, -1) @ dft_matrix(rows, 2, length, length, inverse, window)
    fft = np.fft.ifft if inverse else np.fft.fft
    np.testing.assert_allclose(as_complex(y.reshape(3, length, 2)), fft(as_complex(x) * window, n=length),
                               atol=1e-12)


@pytest.mark.parametrize("bins,length", [(5, 8), (4, 7), (3, 9)])
def test_irfft_matrix_is_numpy_irfft(bins, length):
    x = np.random.default_rng(1).standard_normal((2, bins, 2))
    y = x.reshape(2, -1) @ irfft_matrix(bins, length)
    np.testing.assert_allclose(y, np.fft.irfft(as_complex(x), n=length), atol=1e-12)


# DFT -------------------------------------------------------------------------------------------

def dft_model(x: np.ndarray, opset: int, axis: int | None = None, length: int | None = None, **attrs):
    consts, order = {}, ["x"]
    if length is not None:
        consts["n"] = np.array(length, np.int64)
    order.append("n" if length is not None else "")
    if opset >= 20 and axis is not None:
        consts["axis"] = np.array(axis, np.int64)
        order.append("axis")
    elif axis is not None:
        attrs["axis"] = axis
    return make_model("DFT", opset, {"x": x}, consts, order, **attrs)


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("comps", [1, 2])
@pytest.mark.parametrize("axis", [None, 1, -3, 2])
@pytest.mark.parametrize("inverse", [0, 1])
def test_dft(opset, comps, axis, inverse):
    x = signal(np.random.default_rng(2), 2, 6, 5, comps)
    y = check(dft_model(x, opset, axis, inverse=inverse), {"x": x})
    a = (1 if opset == 17 else 2) if axis is None else axis % 4
    fft = np.fft.ifft if inverse else np.fft.fft
    np.testing.assert_allclose(as_complex(y), fft(as_complex(x), axis=a), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("length", [4, 9])
@pytest.mark.parametrize("comps,inverse,onesided", [(1, 0, 1), (2, 0, 0), (1, 1, 0), (2, 1, 0)])
def test_dft_length_truncates_and_pads(opset, length, comps, inverse, onesided):
    x = signal(np.random.default_rng(3), 3, 6, 2, comps)
    y = check(dft_model(x, opset, 1, length, inverse=inverse, onesided=onesided), {"x": x})
    assert y.shape == (3, length // 2 + 1 if onesided else length, 2, 2)


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("axis", [1, 2])
@pytest.mark.parametrize("length", [None, 6, 7, 4])
def test_irfft(opset, axis, length):
    # onnxruntime keeps every input bin where numpy's irfft (the reference) keeps length // 2 + 1
    x = signal(np.random.default_rng(4), 2, 5, 5, 2)
    y = check(dft_model(x, opset, axis, length, inverse=1, onesided=1), {"x": x}, run_reference)
    n = length or 8
    np.testing.assert_allclose(y[..., 0], np.fft.irfft(as_complex(x), n=n, axis=axis), rtol=1e-4, atol=1e-5)


def test_rfft_round_trip_float64():
    x = signal(np.random.default_rng(5), 2, 3, 10, 1, dtype=np.float64)
    spectrum = check(dft_model(x, 20, -2, onesided=1), {"x": x}, tol=1e-12)
    back = check(dft_model(spectrum, 20, -2, 10, inverse=1, onesided=1), {"x": spectrum}, run_reference,
                 tol=1e-12)
    np.testing.assert_allclose(back, x, atol=1e-12)


@pytest.mark.parametrize("x_comps,attrs,axis,error,match", [
    (2, {"onesided": 1}, 1, ModelFormatError, r"node0 \(DFT\).*one-sided DFT \(RFFT\) needs a real input"),
    (1, {"onesided": 1, "inverse": 1}, 1, ModelFormatError, r"node0 \(DFT\).*\(IRFFT\) needs a complex input"),
    (2, {}, 3, ModelFormatError, r"node0 \(DFT\).*axis 3 is out of range"),
    (2, {}, -1, ModelFormatError, r"node0 \(DFT\).*axis -1 is out of range"),
    (2, {"inverse": 2}, 1, ModelFormatError, r"node0 \(DFT\).*attribute 'inverse' must be 0 or 1, got 2"),
    (3, {}, 1, ShapeError, r"node0 \(DFT\).*neither real \[\.\.\., 1\] nor complex"),
])
def test_dft_refuses(x_comps, attrs, axis, error, match):
    x = signal(np.random.default_rng(6), 2, 4, 3, x_comps)
    with pytest.raises(error, match=match):
        load_onnx(dft_model(x, 17, axis, **attrs))


def test_dft_refuses_bad_length():
    x = signal(np.random.default_rng(6), 2, 4, 3, 1)
    with pytest.raises(ModelFormatError, match=r"node0 \(DFT\).*dft_length must be positive, got 0"):
        load_onnx(dft_model(x, 20, 1, 0))


def test_dft_needs_length_at_import():
    x = signal(np.random.default_rng(7), 2, 4, 1)
    model = make_model("DFT", 20, {"x": x, "n": np.array(4, np.int64)})
    with pytest.raises(UnsupportedOperatorError, match=r"node0 \(DFT\): input 1 \('n'\) must be known"):
        load_onnx(model)
    got = load_onnx(model, input_values={"n": np.array(4, np.int64)}).run({"x": x})["y"]
    np.testing.assert_allclose(got, run_ort(model, {"x": x, "n": np.array(4, np.int64)}), atol=1e-5)


# STFT ------------------------------------------------------------------------------------------

def stft_model(x: np.ndarray, step: int, window: np.ndarray | None = None, frame_length: int | None = None,
               window_input: bool = False, **attrs):
    inputs, consts = {"x": x}, {"step": np.array(step, np.int64)}
    if window is not None:
        (inputs if window_input else consts)["w"] = window
    if frame_length is not None:
        consts["len"] = np.array(frame_length, np.int64)
    order = ["x", "step", "w" if window is not None else "", "len" if frame_length is not None else ""]
    return make_model("STFT", 17, inputs, consts, order, **attrs)


@pytest.mark.parametrize("comps,onesided", [(1, 1), (1, 0), (2, 0)])
@pytest.mark.parametrize("variant", ["window", "window_input", "frame_length", "both"])
def test_stft(comps, onesided, variant):
    rng = np.random.default_rng(8)
    x = signal(rng, 3, 23, comps)
    window = np.hanning(8).astype(np.float32) if variant != "frame_length" else None
    frame_length = 7 if variant == "frame_length" else 8 if variant == "both" else None
    model = stft_model(x, 3, window, frame_length, variant == "window_input", onesided=onesided)
    feeds = {"x": x, "w": window} if variant == "window_input" else {"x": x}
    y = check(model, feeds)
    frame = frame_length or 8
    frames = (23 - frame) // 3 + 1
    assert y.shape == (3, frames, frame // 2 + 1 if onesided else frame, 2)
    # frame 2 against numpy
    seg = as_complex(x[:, 6:6 + frame]) * (window if window is not None else 1)
    want = np.fft.fft(seg, axis=1)[:, :y.shape[2]]
    np.testing.assert_allclose(as_complex(y[:, 2]), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("comps,onesided", [(1, 1), (2, 0)])
def test_stft_whole_signal(comps, onesided):
    # neither window nor frame_length: one frame of the whole signal (onnxruntime refuses this)
    x = signal(np.random.default_rng(9), 2, 10, comps)
    y = check(stft_model(x, 4, onesided=onesided), {"x": x}, run_reference)
    assert y.shape == (2, 1, 6 if onesided else 10, 2)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"comps": 2}, ModelFormatError, r"node0 \(STFT\).*complex signal has no one-sided STFT"),
    ({"frame_length": 6}, ModelFormatError, r"node0 \(STFT\).*window has 8 entries but frame_length is 6"),
    ({"frame_length": 30, "window": None}, ShapeError, r"node0 \(STFT\).*frame_length 30 must be between"),
    ({"step": 0}, ModelFormatError, r"node0 \(STFT\).*frame_step must be positive"),
])
def test_stft_refuses(kwargs, error, match):
    kwargs = {"comps": 1, "step": 2, "window": np.ones(8, np.float32), **kwargs}
    x = signal(np.random.default_rng(10), 2, 20, kwargs.pop("comps"))
    with pytest.raises(error, match=match):
        load_onnx(stft_model(x, **kwargs))


# compiled and sharded ----------------------------------------------------------------------------

def test_dft_compiled_for_cpu(tmp_path):
    x = signal(np.random.default_rng(11), 2, 6, 5, 2)
    model = dft_model(x, 20, 1, 8, inverse=1)
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "dft")
    got = load(res.out_dir).run({"x": x})["y"]
    np.testing.assert_allclose(got, run_ort(model, {"x": x}), rtol=1e-5, atol=1e-5)


def test_stft_sharded_over_two_ranks():
    x = signal(np.random.default_rng(12), 8, 64, 1)
    model = stft_model(x, 8, np.hanning(16).astype(np.float32), onesided=0)
    want = run_ort(model, {"x": x})
    graph = load_onnx(model)
    # replicated, the frames and the spectrum need ~15 KB a rank: the budget makes the search split them
    plan = search(graph, {"mesh_shape": [2], "memory_budget_bytes": 10000})
    assert str(plan.tensor_specs[graph.outputs[0].name]).startswith("S(")
    got = simulate(partition(graph, plan), {"x": x})
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)


def _mel_model(n_mel, length, rate, lo, hi):
    consts = {"n": np.array(n_mel, np.int64), "len": np.array(length, np.int64), "rate": np.array(rate, np.int64),
              "lo": np.array(lo, np.float32), "hi": np.array(hi, np.float32)}
    node = helper.make_node("MelWeightMatrix", list(consts), ["y"], name="mel")
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, None])
    graph = helper.make_graph([node], "g", [], [y], [numpy_helper.from_array(v, k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("args", [(10, 64, 16000, 0.0, 8000.0), (40, 512, 22050, 125.0, 7600.0),
                                  (3, 8, 100, 1.0, 49.0)])
def test_mel_weight_matrix_matches_the_onnx_reference(args):
    """A constant of [dft_length // 2 + 1, num_mel_bins] triangular filters, exactly the reference's."""
    model = _mel_model(*args)
    want = run_reference(model, {})
    got = load_onnx(model).run({})["y"]
    assert got.shape == (args[1] // 2 + 1, args[0]) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_mel_weight_matrix_edges_past_the_bins_are_refused():
    with pytest.raises(ModelFormatError, match=r"node mel .*outside the 33 spectrogram bins"):
        load_onnx(_mel_model(10, 64, 16000, 0.0, 12000.0))
