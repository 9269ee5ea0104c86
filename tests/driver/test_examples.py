"""The examples in examples/ run as the README shows them (``-m slow``: each exports a model with
torch first). examples/genai_generate.py is run by tests/frontend/test_contrib_ops.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
def test_gpt2_pipeline_example(tmp_path):
    """The same on 4 ranks as 2 pipeline stages of 2 Megatron ranks, a run's batch in 2 parts."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "gpt2_tensor_parallel.py"), "--work", str(tmp_path),
                           "--nproc", "4", "--stages", "2", "--microbatches", "2"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 pipeline stages" in proc.stdout and "-> OK" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_gpt2_tensor_parallel_example(tmp_path):
    """export -> compile for 2 cpu ranks -> ``shardflow run --nproc 2`` -> onnxruntime: the script
    exits 0 only when the ranks' logits match onnxruntime's."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "gpt2_tensor_parallel.py"), "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "running on 2 ranks" in proc.stdout and "-> OK" in proc.stdout, proc.stdout[-2000:]
