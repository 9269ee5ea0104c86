"""tests/fuzz_node_cases.py: a few iterations of every mode and mutation find no failure, and a run
whose outputs are wrong is reported as wrong (so that the fuzzer can fail)."""
import shutil

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
fuzz = pytest.importorskip("fuzz_node_cases")


@pytest.mark.parametrize("mutate", fuzz.MUTATIONS)
@pytest.mark.parametrize("mode", ["eval", "plan"])
def test_a_few_iterations_find_nothing(tmp_path, mode, mutate, capsys):
    assert fuzz.main([mode, "--mutate", mutate, "--iters", "15", "--seed", "3", "--save", str(tmp_path)]) == 0
    counts = dict(kv.split("=") for kv in capsys.readouterr().out.strip().splitlines()[-1].split(", "))
    assert int(counts["ok"]) > 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
@pytest.mark.parametrize("mode", ["cpu", "cuda-host", "cpu-plan"])
def test_the_compiled_modes_run(tmp_path, mode, capsys):
    assert fuzz.main([mode, "--iters", "6", "--seed", "4", "--save", str(tmp_path)]) == 0
    counts = dict(kv.split("=") for kv in capsys.readouterr().out.strip().splitlines()[-1].split(", "))
    assert int(counts["ok"]) > 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
@pytest.mark.parametrize("mode", ["eval", "cpu"])
def test_sequence_cases_are_fuzzed_too(tmp_path, mode, capsys):
    """Cases with sequence inputs or outputs (SequenceInsert, SplitToSequence, ...): an item of a sequence
    input changed, the outputs compared item by item."""
    assert fuzz.main([mode, "--only", "sequence_", "--iters", "8", "--seed", "6", "--save", str(tmp_path)]) == 0
    counts = dict(kv.split("=") for kv in capsys.readouterr().out.strip().splitlines()[-1].split(", "))
    assert int(counts["ok"]) > 0
    items = [np.zeros((2, 3), np.float32), np.ones((1, 3), np.float32)]
    assert fuzz.mismatch([items], [[items[0], items[1] + 1]]).startswith("max difference 1.0")
    assert fuzz.mismatch([items[:1]], [items]) == "1 outputs (or sequence items), expected 2"
    assert fuzz.mismatch([items[0]], [items]) == "a sequence and a tensor"
    assert fuzz._flat({"s": items, "x": items[0]}).keys() == {"s[0]", "s[1]", "x"}


def test_a_wrong_run_is_reported_with_its_case(tmp_path, monkeypatch, capsys):
    real = fuzz.Fuzzer._run_plan

    def off_by_a_little(self, model, feeds, rest, bound):
        outs = real(self, model, feeds, rest, bound)
        return [{k: (v + np.ones_like(v) if v.dtype.kind in "fiu" and v.size else v) for k, v in out.items()}
                for out in outs]

    monkeypatch.setattr(fuzz.Fuzzer, "_run_plan", off_by_a_little)
    assert fuzz.main(["plan", "--iters", "15", "--seed", "3", "--save", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "WRONG" in out and "rank 0 of" in out
    assert {p.suffix for p in tmp_path.iterdir()} == {".npz", ".onnx"}


def test_mismatch_tolerances():
    a = np.array([1.0, 2.0, 3.0])
    assert fuzz.mismatch([a], [a * (1 + 1e-10)]) is None
    assert "max difference" in fuzz.mismatch([a], [a * (1 + 1e-8)])  # float64: 1e-9
    assert fuzz.mismatch([a.astype(np.float32)], [(a * (1 + 1e-4)).astype(np.float32)]) is None
    assert "type" in fuzz.mismatch([a.astype(np.float32)], [a])
    assert "values differ" in fuzz.mismatch([np.array([1, 2])], [np.array([1, 3])])
