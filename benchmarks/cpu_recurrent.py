"""CPU time of the ONNX recurrent ops (LSTM, GRU, RNN) against onnxruntime (rfcs/0002 "Recurrent ops on the
cpu"). Each case is one node with constant weights (``W``, ``R``, ``B``; no initial state, no sequence
lengths), compiled for one cpu rank: the importer unrolls it into one input projection for the whole
sequence and, per step, the recurrent product and the gates' element-wise kernels. Prints our whole ``run()``
and onnxruntime's whole call (same thread count; alternating blocks of calls, the minimum of the blocks), the
ratio, the largest difference of ``Y``, the compile time and the program's kernels.

    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_recurrent.py [CASE ...]    # default: every case

A case is ``OP:SEQ:BATCH:INPUT:HIDDEN[:DIRECTION]``, e.g. ``LSTM:128:8:256:256`` or
``GRU:64:1:512:512:bidirectional``.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from cpu_op_survey import _calls
from onnx import TensorProto, numpy_helper
from onnx import helper as oh
from shardflow.compiler import compile
from shardflow.runtime import load

CASES = ["LSTM:32:1:128:128", "LSTM:128:8:256:256", "LSTM:64:1:512:512:bidirectional", "GRU:128:8:256:256",
         "GRU:64:1:512:512", "RNN:128:8:256:256"]
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def recurrent_model(op: str, seq: int, batch: int, inputs: int, hidden: int, direction: str = "forward",
                    seed: int = 0) -> onnx.ModelProto:
    """One ``op`` node over ``x`` ``[seq, batch, inputs]`` with random weights; outputs ``Y`` and ``Y_h``."""
    rng = np.random.default_rng(seed)
    g, d = GATES[op], 2 if direction == "bidirectional" else 1
    weights = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n)
               for n, s in (("W", [d, g * hidden, inputs]), ("R", [d, g * hidden, hidden]), ("B", [d, 2 * g * hidden]))]
    node = oh.make_node(op, ["x", "W", "R", "B"], ["y", "y_h"], hidden_size=hidden, direction=direction)
    graph = oh.make_graph([node], op, [oh.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, inputs])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [seq, d, batch, hidden]),
                           oh.make_tensor_value_info("y_h", TensorProto.FLOAT, [d, batch, hidden])], weights)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    return model


def main(specs: list[str]) -> None:
    """Each case in a process of its own (onnxruntime's threads spin on after a session's runs and
    slow what runs next in the process)."""
    specs = specs or CASES
    if len(specs) > 1:
        for spec in specs:
            subprocess.run([sys.executable, __file__, spec], check=True)
        return
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    work = tempfile.mkdtemp(prefix="sf-recurrent-")
    rng = np.random.default_rng(1)
    for spec in specs:
        op, seq, batch, inputs, hidden, *direction = spec.split(":")
        seq, batch, inputs, hidden = int(seq), int(batch), int(inputs), int(hidden)
        model = recurrent_model(op, seq, batch, inputs, hidden, *direction)
        out = f"{work}/{spec.replace(':', '_')}"
        t0 = time.perf_counter()
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
        seconds = time.perf_counter() - t0
        prog = load(out)
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        feeds = {"x": rng.standard_normal((seq, batch, inputs)).astype(np.float32)}
        diff = float(np.abs(prog.run(feeds)["y"] - sess.run(["y"], feeds)[0]).max())
        ours = theirs = float("inf")
        for _ in range(2):  # alternate the engines, each after the other's threads have stopped spinning
            time.sleep(0.2)
            ours = min(ours, _calls(lambda: prog.run(feeds), blocks=3, per=5))
            time.sleep(0.2)
            theirs = min(theirs, _calls(lambda: sess.run(None, feeds), blocks=3, per=5))
        kernels = len(prog.profile(feeds, repeat=1, warmup=0))
        print(f"{spec:32s} shardflow {ours:8.3f} ms   onnxruntime {theirs:8.3f} ms   ratio {ours / theirs:5.2f}   "
              f"max |diff| {diff:.1e}   compile {seconds:4.1f} s   kernels {kernels}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
