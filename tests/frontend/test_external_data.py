"""Weights in ONNX external data files: mapped read-only (not read into the protobuf), checked
against their files, and compiled and run like inline ones."""
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from shardflow.compiler import ModelFormatError, compile, load_onnx
from shardflow.compiler.frontend import external_data

MODELS = os.path.join(os.path.dirname(__file__), "..", "models")


def _save_external(tmp_path, name="gpt2_ts17", location="weights.bin"):
    model = onnx.load(os.path.join(MODELS, f"{name}.onnx"))
    path = tmp_path / f"{name}.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return path


def _mapped(a: np.ndarray) -> bool:
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = a.base if isinstance(a, np.ndarray) else None
    return False


def test_external_weights_are_mapped_and_match_onnxruntime(tmp_path, monkeypatch):
    monkeypatch.setattr(external_data, "MAP_BYTES", 1024)  # (the test model's tables are 32 KB)
    path = _save_external(tmp_path)
    feeds = dict(np.load(os.path.join(MODELS, "gpt2_inputs.npz")))
    graph = load_onnx(path)
    consts = [t for op in graph.nodes for t in op.inputs if t.is_constant]
    table = next(t for t in consts if t.name == "model.transformer.wte.weight")
    assert _mapped(table.value) and not table.value.flags.writeable
    assert any(not _mapped(t.value) for t in consts)  # (the small ones are read)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(graph.run(feeds)["logits"], want, rtol=1e-4, atol=1e-4)


def test_external_weights_compile_and_run_on_two_ranks(tmp_path, monkeypatch):
    """No pass writes into a mapped weight: a Megatron build on two cpu ranks (the table split by
    rows, the products' weights packed) runs and matches onnxruntime; the cuda target's float16
    weights are converted from the mapping too (compiled only: no GPU needed)."""
    from shardflow.compiler.codegen import cuda

    monkeypatch.setattr(external_data, "MAP_BYTES", 1024)
    path = _save_external(tmp_path)
    feeds = dict(np.load(os.path.join(MODELS, "gpt2_inputs.npz")))
    np.savez(tmp_path / "in.npz", **feeds)
    compile(path, distributed_config={"mesh_shape": [2], "algo": "megatron"}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "o")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_", "HYDRA_"))}
    proc = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "run", str(tmp_path / "o"), "--nproc", "2",
                           "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["logits"], want, rtol=1e-3, atol=1e-3)
    if cuda._find_nvcc() is not None:
        compile(path, distributed_config={"mesh_shape": [1]},
                optimization_config={"target": "cuda", "precision": "float16"}, out_dir=tmp_path / "c")


def test_a_missing_data_file_is_named(tmp_path):
    path = _save_external(tmp_path)
    os.remove(tmp_path / "weights.bin")
    with pytest.raises(ModelFormatError, match=r"external data file .*weights.bin is missing"):
        load_onnx(path)


def test_a_data_file_too_short_for_its_tensors_is_refused(tmp_path):
    path = _save_external(tmp_path)
    data = tmp_path / "weights.bin"
    data.write_bytes(data.read_bytes()[:-4])
    with pytest.raises(ModelFormatError, match=r"reads bytes .* of .*weights.bin .*do not match"):
        load_onnx(path)


def test_a_location_outside_the_model_folder_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    path = _save_external(tmp_path / "m")
    shutil.move(str(tmp_path / "m" / "weights.bin"), str(tmp_path / "weights.bin"))
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../weights.bin"
    onnx.save_model(model, str(path))
    with pytest.raises(ModelFormatError, match=r"'\.\./weights\.bin', which is not a file inside the model's folder"):
        load_onnx(path)


def test_a_data_file_linked_from_elsewhere_is_refused_with_the_fix(tmp_path):
    """A data file that is a symbolic link out of the model's folder (a hub cache's blobs) is
    refused, as onnx refuses it, and the message says to copy the file."""
    (tmp_path / "m").mkdir()
    path = _save_external(tmp_path / "m")
    shutil.move(str(tmp_path / "m" / "weights.bin"), str(tmp_path / "blob"))
    os.symlink(tmp_path / "blob", tmp_path / "m" / "weights.bin")
    with pytest.raises(ModelFormatError, match="a symbolic link to a file outside it.*copy the file beside the model"):
        load_onnx(path)


def test_an_inline_models_large_weights_are_mapped_from_the_onnx_file(tmp_path, monkeypatch):
    """Weights stored inside the .onnx file (protobuf ``raw_data``) are left there too: the importer
    parses the model without their bytes (frontend/wire.py) and maps them from the file, with the
    values onnx reads; small ones are read. Not a valid protobuf: the whole-file parse reports it."""
    from shardflow.compiler.frontend import wire

    monkeypatch.setattr(wire, "SPLIT_BYTES", 1024)  # (the test model's tables are 32 KB)
    monkeypatch.setattr(external_data, "MAP_BYTES", 1024)
    path = os.path.join(MODELS, "gpt2_ts17.onnx")
    data = open(path, "rb").read()
    small, where = wire.split_weights(data)
    assert where and len(small) < len(data) - sum(n for _, n in where.values()) + 1024
    model = onnx.load(path)
    for t in model.graph.initializer:
        if t.name in where:
            off, n = where[t.name]
            assert data[off:off + n] == t.raw_data
    graph = load_onnx(path)
    consts = {t.name: t for op in graph.nodes for t in op.inputs if t.is_constant}
    assert _mapped(consts["model.transformer.wte.weight"].value)
    assert not all(_mapped(t.value) for t in consts.values())  # (the small ones)
    feeds = dict(np.load(os.path.join(MODELS, "gpt2_inputs.npz")))
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(graph.run(feeds)["logits"], want, rtol=1e-4, atol=1e-4)
    assert wire.split_weights(data[:len(data) // 2]) is None and wire.split_weights(b"\x0b\x00") is None


def test_a_large_inline_four_bit_weight_is_read_from_the_onnx_file(tmp_path):
    """An int4 initializer (no whole bytes per element: not mapped) left out of the parse is read
    back from the .onnx file as onnx reads external data; the dequantized product matches numpy's
    (onnxruntime fuses DequantizeLinear + MatMul into a 4-bit product that quantizes the
    activation: 0.1 apart here)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (512, 512)).astype(np.int8)  # 128 KB of 4-bit codes, two to a byte
    packed = ((q.reshape(-1, 2)[:, 0] & 0xF) | ((q.reshape(-1, 2)[:, 1] & 0xF) << 4)).astype(np.uint8)
    w = helper.make_tensor("w", TensorProto.INT4, q.shape, packed.tobytes(), raw=True)
    s = helper.make_tensor("s", TensorProto.FLOAT, [], [0.05])
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"]), helper.make_node("MatMul", ["x", "wf"], ["y"])]
    g = helper.make_graph(nodes, "q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 512])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 512])], [w, s])
    path = tmp_path / "q4.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)
    from shardflow.compiler.frontend import wire

    assert "w" in wire.split_weights(path.read_bytes())[1]
    x = rng.standard_normal((2, 512)).astype(np.float32)
    np.testing.assert_allclose(load_onnx(path).run({"x": x})["y"], x @ (q.astype(np.float32) * np.float32(0.05)),
                               rtol=1e-4, atol=1e-4)
