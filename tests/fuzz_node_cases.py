"""Differential fuzzing of the ONNX backend node cases: each iteration takes a random node case,
changes it (``--mutate``) and runs it where ``MODE`` says, against a reference.

Usage::

    python tests/fuzz_node_cases.py MODE [--mutate KIND] [--seed S] [--iters N] [--only SUBSTR]
                                         [--save DIR] [-v]

MODE (what runs the changed case, and against what):

* ``eval``: ``load_onnx(...).run()`` against onnxruntime;
* ``cpu``: compiled for one cpu rank and run by the runtime;
* ``cuda-host``: the cuda kernels (sm_90) on the host emulation (``tests/cuda_host.py``; the cases
  are compiled together at the end, as ``tests/codegen/cuda_conformance.py`` does);
* ``plan``: every op a random strategy on a mesh of ``[2]``, ``[3]``, ``[2, 2]`` or ``[4]``, the rank
  graphs partitioned and simulated (every rank's outputs);
* ``cpu-plan``: such a plan saved, compiled for cpu ranks with ``preload_plan`` and run on in-process
  ranks with their collectives.

In ``eval``, a difference from onnxruntime that onnx's reference evaluator shares is counted apart
(``onnxruntime-alone``). Outside ``eval`` the reference is the evaluator, and a case counts only where
the evaluator agrees with onnxruntime (``eval`` fuzzes that), so that an ambiguous case (NaN ties,
undefined casts) is not read as a defect. Where onnxruntime makes a session of the changed model but its
run refuses the values or shapes (a range it checks) and the evaluator computes them, the case is
counted as ``ort-rejects-run-reference-agrees`` when onnx's reference computes the same (onnxruntime
stricter than the spec), else as ``ort-rejects-run-we-run``, printed with onnxruntime's message under
``-v`` (``ORT-REJECTS-RUN``): a check the importer may lack.

Cases with sequence inputs or outputs take part (session 102): ``shapes`` changes one item of a sequence
input, a sequence output is compared item by item, ``types`` leaves such cases alone; cases with an
empty optional input are left out.

KIND: ``shapes`` (one input's dim changed, with the inputs of that dim alike, or its values
redrawn), ``types`` (the inputs of one element type retyped: float32 to float64 or float16, the integer
widths; the outputs' types from onnx's shape inference), ``attrs`` (one attribute changed).

Prints the counts by class and a line for each case that differs (``WRONG``), raises an exception
that is not a ``ShardflowError`` (``UNTYPED``) or runs past the time limit (``TIMEOUT``), its model and
inputs saved in ``--save`` as ``MODE-KIND-SEED-N.onnx`` and ``.npz`` (the line names them); ``-v``
also prints refusals. The classes other than ``ok`` are not all defects: read each case. What
sessions 79-80 found this way is listed in rfcs/0006, "Differential fuzzing of the node cases";
``tests/test_fuzz_node_cases.py`` runs a few iterations of every mode.
"""
from __future__ import annotations

import argparse
import collections
import copy
import logging
import os
import pickle
import random
import signal
import sys
import tempfile
import types
import warnings

import numpy as np
import onnx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "frontend"), os.path.join(HERE, "codegen")]

from conformance import _arrays, _import_binding, input_shapes, is_random_case, is_tensor_only, node_cases  # noqa: E402

from shardflow.compiler import ShardflowError  # noqa: E402
from shardflow.compiler.frontend.registry import sequence_item  # noqa: E402

MODES = ("eval", "cpu", "cuda-host", "plan", "cpu-plan")
MUTATIONS = ("shapes", "types", "attrs")
#: a reference above this magnitude (an exploding recurrence) is left out: its rounding decides
OVERFLOW = 1e30
#: element types a case's inputs may take in ``types``
RETYPE = {"float32": ["float64", "float16"], "float16": ["float32", "float64"], "float64": ["float32", "float16"],
          "int64": ["int32", "int8", "uint8", "int16", "uint16", "uint32", "uint64"],
          "int32": ["int64", "int8", "uint8", "int16", "uint16", "uint32", "uint64"],
          "uint8": ["int8", "int16", "uint16"], "int8": ["uint8", "int16", "int32"]}
_ONNX_TYPES = {np.dtype(k): v for k, v in [
    ("float32", 1), ("uint8", 2), ("int8", 3), ("uint16", 4), ("int16", 5), ("int32", 6), ("int64", 7),
    ("bool", 9), ("float16", 10), ("float64", 11), ("uint32", 12), ("uint64", 13)]}


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout()


class Fuzzer:
    """One run of ``iters`` iterations: the random sources, the counts and the failures' files."""

    def __init__(self, mode: str, mutate: str, seed: int, only: str | None, save: str, verbose: bool):
        self.mode, self.mutate, self.save, self.verbose = mode, mutate, save, verbose
        self.rng, self.nrng = random.Random(seed), np.random.default_rng(seed)
        self.seed = seed
        # (not the random ops' cases: no two generators draw alike; conformance.py checks those)
        self.cases = [c for c in node_cases() if is_tensor_only(c, sequences=True) and "expanded" not in c.name
                      and not is_random_case(c)
                      and (only is None or only in c.name)]
        self.stats: collections.Counter = collections.Counter()
        self.failures: list[str] = []
        self.host_cases: list = []  # (cuda-host: run together at the end)
        self.host_saved: dict = {}

    # mutations --------------------------------------------------------------------------------
    def _value(self, x: np.ndarray, shape) -> np.ndarray | None:
        v = self._draw(x, shape)
        return None if v is None else np.asarray(v)  # (a 0-d draw is a numpy scalar)

    def _draw(self, x: np.ndarray, shape):
        rng, nrng = self.rng, self.nrng
        if x.dtype.kind == "f":
            return (nrng.standard_normal(shape) * rng.choice([1, 1, 10, 0.01])).astype(x.dtype)
        if x.dtype.kind in "iu":
            if x.size and x.min() >= 0 and x.max() <= 3:  # indices, small counts: stay in their range
                return nrng.integers(x.min(), x.max() + 1, shape).astype(x.dtype)
            lo, hi = (int(x.min()), int(x.max()) + 1) if x.size else (0, 5)
            return nrng.integers(lo, max(hi, lo + 1), shape).astype(x.dtype)
        if x.dtype == bool:
            return nrng.random(shape) < 0.5
        return None

    def _shapes(self, model, feeds):
        rng = self.rng
        name = rng.choice(list(feeds))
        x = feeds[name]
        if isinstance(x, list):  # a sequence input: one item's values or one of its dims
            if not x:
                return None
            k = rng.randrange(len(x))
            item = {name: x[k]}
            what = self._shapes(model, item)
            if what is None:
                return None
            feeds[name] = x[:k] + [item[name]] + x[k + 1:]
            return f"item {k} of {what}"
        if rng.random() < 0.3 or not x.ndim:
            v = self._value(x, x.shape)
            if v is None:
                return None
            feeds[name] = v
            return f"values of {name}"
        d = rng.randrange(x.ndim)
        n = rng.choice([1, x.shape[d] + 1, max(x.shape[d] - 1, 1), x.shape[d] * 2, x.shape[d] * 3 + 1, 17])
        for other, y in list(feeds.items()):  # the inputs with that dim alike change with it (mostly)
            if isinstance(y, list):
                continue
            if y.ndim == x.ndim and y.shape[d] == x.shape[d] and (other == name or rng.random() < 0.8):
                v = self._value(y, y.shape[:d] + (n,) + y.shape[d + 1:])
                if v is not None:
                    feeds[other] = v
        return f"{name} dim {d} -> {n}"

    def _types(self, model, feeds):
        if any(isinstance(x, list) for x in feeds.values()) or any(
                not vo.type.HasField("tensor_type") for vo in model.graph.output):
            return None  # (sequences keep their types: their type protos are not retyped here)
        kinds = sorted({str(x.dtype) for x in feeds.values()} & set(RETYPE))
        if not kinds:
            return None
        src = self.rng.choice(kinds)
        dst = self.rng.choice(RETYPE[src])
        for name, x in list(feeds.items()):
            if str(x.dtype) != src:
                continue
            if dst.startswith("float"):
                v = x.astype(np.float64)
                if dst == "float64" and v.size:  # values float32 cannot hold, where they were not integers
                    v = v + self.nrng.standard_normal(v.shape) * 1e-3 * (np.abs(v) + 1) * (np.round(v) != v)
                feeds[name] = v.astype(dst)
            else:
                info = np.iinfo(dst)
                if x.size and (x.min() < info.min or x.max() > info.max):
                    return None
                feeds[name] = x.astype(dst)
        if any(x.dtype not in _ONNX_TYPES for x in feeds.values()):
            return None
        for vi in model.graph.input:
            if vi.name in feeds:
                vi.type.tensor_type.elem_type = _ONNX_TYPES[feeds[vi.name].dtype]
        for vo in model.graph.output:
            vo.type.tensor_type.elem_type = 0
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        except Exception:  # noqa: BLE001 - the op takes no such type
            return None
        for vo, vi in zip(model.graph.output, inferred.graph.output):
            if not vi.type.tensor_type.elem_type:
                return None
            vo.type.tensor_type.elem_type = vi.type.tensor_type.elem_type
        return f"{src} -> {dst}"

    def _attrs(self, model, feeds):
        rng = self.rng
        nodes = [n for n in model.graph.node if n.attribute]
        if not nodes:
            return None
        node = rng.choice(nodes)
        a = rng.choice(node.attribute)
        if a.type == onnx.AttributeProto.INT:
            a.i = rng.choice([0, 1, -1, 2, 3, -2, a.i + 1, a.i - 1, 7])
        elif a.type == onnx.AttributeProto.INTS and a.ints:
            v = list(a.ints)
            if rng.random() < 0.7:
                k = rng.randrange(len(v))
                v[k] = rng.choice([0, 1, -1, 2, 3, v[k] + 1, v[k] - 1])
            else:
                v = v[:-1] if rng.random() < 0.5 else v + [rng.choice([0, 1, 2])]
            del a.ints[:]
            a.ints.extend(v)
        elif a.type == onnx.AttributeProto.FLOAT:
            a.f = rng.choice([0.0, -1.0, 1e-30, 2.5, float("inf"), a.f * 2])
        elif a.type == onnx.AttributeProto.STRING:
            a.s = rng.choice([b"", b"bogus", a.s.upper()])
        else:
            return None
        return f"{node.op_type}.{a.name} = {onnx.helper.get_attribute_value(a)}"

    # running ----------------------------------------------------------------------------------
    def _guarded(self, seconds: int, fn, *args):
        signal.alarm(seconds)
        try:
            return fn(*args)
        finally:
            signal.alarm(0)

    def _attempt(self, seconds: int, stage: str, refused: str, tag: str, model, feeds, fn, *args):
        """``(True, fn(*args))``, else ``(False, None)`` with the outcome counted or reported: past
        ``seconds`` a TIMEOUT, a ShardflowError counted as ``refused``, another exception UNTYPED."""
        try:
            return True, self._guarded(seconds, fn, *args)
        except _Timeout:
            self._report("TIMEOUT", tag, stage, model, feeds)
        except ShardflowError as exc:
            self.stats[refused] += 1
            if self.verbose:
                print(f"REFUSED {tag}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        except Exception as exc:  # noqa: BLE001 - untyped: a defect
            self._report("UNTYPED", tag, f"{stage}: {type(exc).__name__}: {str(exc)[:200]}", model, feeds)
        return False, None

    def _report(self, kind: str, tag: str, detail: str, model, feeds) -> None:
        key = f"{self.mode}-{self.mutate}-{self.seed}-{len(self.failures)}"
        os.makedirs(self.save, exist_ok=True)
        onnx.save(model, os.path.join(self.save, key + ".onnx"))
        np.savez(os.path.join(self.save, key + ".npz"), **_flat(feeds))
        line = f"{kind} {tag}: {detail} (saved {key})"
        self.failures.append(line)
        print(line, flush=True)

    def one(self) -> None:
        """One iteration: a case changed, onnxruntime's result, then the mode's run and check."""
        case = self.rng.choice(self.cases)
        model = copy.deepcopy(case.model)
        init = {i.name for i in model.graph.initializer}
        graph_inputs = [vi for vi in model.graph.input if vi.name not in init]
        arrays = _arrays(case.data_sets[0][0])
        if len(arrays) != len(graph_inputs) or not arrays or any(a is None for a in arrays):
            return  # (an empty optional input: nothing to change)
        feeds = {vi.name: x for vi, x in zip(graph_inputs, arrays)}
        what = getattr(self, "_" + self.mutate)(model, feeds)
        if what is None:
            return
        for vi in graph_inputs:  # the inputs' shapes as fed; the outputs' as onnxruntime computes them
            if not vi.type.HasField("tensor_type"):  # (a sequence's items may differ in shape: none declared)
                _elem(vi.type).ClearField("shape")
                continue
            tt = vi.type.tensor_type
            tt.ClearField("shape")
            tt.shape.SetInParent()  # (a scalar's shape is present and empty)
            tt.shape.dim.extend(onnx.TensorShapeProto.Dimension(dim_value=d) for d in feeds[vi.name].shape)
        for k, vo in enumerate(model.graph.output):  # (symbolic dims until onnxruntime gives them)
            if not vo.type.HasField("tensor_type"):
                _elem(vo.type).ClearField("shape")
                continue
            rank = len(vo.type.tensor_type.shape.dim)
            vo.type.tensor_type.ClearField("shape")
            vo.type.tensor_type.shape.dim.extend(onnx.TensorShapeProto.Dimension(dim_param=f"out{k}_{d}")
                                                 for d in range(rank))
            vo.type.tensor_type.shape.SetInParent()
        del model.graph.value_info[:]
        tag = f"{case.name} ({what})"
        try:
            status, want = self._guarded(20, _run_onnxruntime, model, feeds)
        except _Timeout:
            self.stats["ort-timeout"] += 1
            return
        if status == "crashed":  # (then as a model it refuses: ours must still fail cleanly or run)
            self.stats["ort-crashed"] += 1
            if self.verbose:
                print(f"ORT-CRASHED {tag}", flush=True)
        rejected = want if status == "rejected" else None
        if rejected is not None:
            want = None
        if want is not None and sum(np.asarray(w).size for w in _items(want)) > 4_000_000:
            self.stats["too-large"] += 1
            return
        if want is not None:
            for vo, w in zip(model.graph.output, want):
                if isinstance(w, list):
                    continue
                vo.type.tensor_type.ClearField("shape")
                vo.type.tensor_type.shape.SetInParent()
                vo.type.tensor_type.shape.dim.extend(onnx.TensorShapeProto.Dimension(dim_value=d)
                                                     for d in np.asarray(w).shape)
        def evaluate():
            graph, rest, bound = _import_binding(types.SimpleNamespace(model=model), feeds)
            out = graph.run(rest)
            return _outputs(out, model), rest, bound

        done, res = self._attempt(120, "the evaluator", "refused" if want is not None else "both-refuse",
                                  tag, model, feeds, evaluate)
        if not done:
            return
        ref, rest, bound = res
        if want is None:
            if rejected is not None:  # (its run refused what the evaluator computed: a check we may lack)
                if _reference_agrees(model, feeds, ref):  # (onnxruntime stricter than the spec's executable form)
                    self.stats["ort-rejects-run-reference-agrees"] += 1
                else:
                    self.stats["ort-rejects-run-we-run"] += 1
                    if self.verbose:
                        print(f"ORT-REJECTS-RUN {tag}: {rejected}", flush=True)
                return
            self.stats["ort-refuses-we-run"] += 1
            if self.verbose:
                print(f"ORT-REFUSES {tag}", flush=True)
            return
        floor = _precision_floor(model)
        why = mismatch(ref, want, floor)
        if self.mode == "eval":
            if why and _reference_agrees(model, feeds, ref):
                self.stats["onnxruntime-alone"] += 1  # (the spec's executable form computes what we do)
            else:
                self.stats["wrong" if why else "ok"] += 1
                if why:
                    self._report("WRONG", tag, f"evaluator against onnxruntime: {why}", model, feeds)
            return
        if why:
            self.stats["reference-ambiguous"] += 1
            return
        if any(np.asarray(r).dtype.kind == "f" and np.asarray(r).size
               and not np.all(np.abs(np.asarray(r, np.float64)) < OVERFLOW) for r in _items(ref)):
            self.stats["overflow"] += 1
            return
        if self.mode == "cuda-host":
            name = f"{len(self.host_cases)} {tag}"
            # (float16 outputs: a unit in the last place, 2**-10 relative, which a float32 sum in another
            # order gives; the check multiplies these by conformance's TOLERANCE_FACTOR, 10)
            half = 2e-4 if any(np.asarray(r).dtype == np.float16 for r in _items(ref)) else 0.0
            self.host_cases.append(types.SimpleNamespace(name=name, model=model, rtol=max(case.rtol, half),
                                                         atol=max(case.atol, half),
                                                         data_sets=[(list(feeds.values()), ref)]))
            self.host_saved[name] = (model, feeds)
            return
        done, outs = self._attempt(300, self.mode, "refused", tag, model, feeds,
                                   getattr(self, "_run_" + self.mode.replace("-", "_")), model, feeds, rest, bound)
        if not done:
            return
        for r, out in enumerate(outs):
            why = mismatch(_outputs(out, model), ref, floor)
            if why:
                self.stats["wrong"] += 1
                self._report("WRONG", tag, f"rank {r} of {len(outs)}: {why}", model, feeds)
                return
        self.stats["ok"] += 1

    def _run_cpu(self, model, feeds, rest, bound) -> list:
        from shardflow.compiler import compile
        from shardflow.runtime import load

        with tempfile.TemporaryDirectory() as d:
            compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                    out_dir=os.path.join(d, "out"), input_shapes=_given_shapes(feeds, bound),
                    input_values={k: feeds[k] for k in bound})
            return [load(os.path.join(d, "out")).run(rest)]

    def _random_plan(self, model, feeds, rest, bound):
        from shardflow.compiler.driver import planned_graph
        from shardflow.compiler.parallel.config import DistributedConfig
        from shardflow.compiler.parallel.plan import ShardingPlan
        from shardflow.compiler.parallel.search import Problem

        mesh = self.rng.choice([[2], [3], [2, 2], [4]])
        g = planned_graph(model, distributed_config={"mesh_shape": mesh}, optimization_config={"target": "cpu"},
                          input_shapes=_given_shapes(feeds, bound), input_values={k: feeds[k] for k in bound})
        problem = Problem(g, DistributedConfig.from_dict({"mesh_shape": mesh}))
        assign = {id(op): problem.strategies[id(op)][int(self.nrng.integers(len(problem.strategies[id(op)])))]
                  for op in g.nodes}
        return g, ShardingPlan.from_assignment(problem, assign, algo="random")

    def _run_plan(self, model, feeds, rest, bound) -> list:
        from shardflow.compiler.parallel import partition
        from shardflow.compiler.parallel.simulate import simulate_ranks

        g, plan = self._random_plan(model, feeds, rest, bound)
        with np.errstate(all="ignore"):
            return simulate_ranks(list(partition(g, plan)), rest, plan.mesh)

    def _run_cpu_plan(self, model, feeds, rest, bound) -> list:
        from threads import run_threads

        from shardflow.compiler import compile
        from shardflow.runtime import load
        from shardflow.runtime.comm import InProcessWorld

        _, plan = self._random_plan(model, feeds, rest, bound)
        with tempfile.TemporaryDirectory() as d:
            plan.save(os.path.join(d, "plan"))
            compile(model, distributed_config={"mesh_shape": list(plan.mesh.shape),
                                               "preload_plan": os.path.join(d, "plan")},
                    optimization_config={"target": "cpu"}, out_dir=os.path.join(d, "out"),
                    input_shapes=_given_shapes(feeds, bound), input_values={k: feeds[k] for k in bound})
            world = InProcessWorld(plan.mesh.world_size).communicators()
            programs = [load(os.path.join(d, "out"), c.rank, c) for c in world]
            return run_threads(world, lambda c: programs[c.rank].run(dict(rest)), timeout=120)

    def finish(self) -> None:
        """Run the cuda-host cases gathered (one translation unit), then print the counts."""
        if self.host_cases:
            import cuda_conformance

            for name, (status, detail) in sorted(cuda_conformance.run_all(cases=self.host_cases).items()):
                self.stats[{"passed": "ok"}.get(status, status)] += 1
                if status in ("wrong", "error"):
                    model, feeds = self.host_saved[name]
                    self._report(status.upper() if status == "wrong" else "UNTYPED", name.split(" ", 1)[1],
                                 detail[:300], model, feeds)
        print(", ".join(f"{k}={v}" for k, v in sorted(self.stats.items())), flush=True)


def _run_onnxruntime(model, feeds) -> tuple[str, list | str | None]:
    """``("ran", outputs)``, ``("refused", None)`` (the session refused the model: no kernel for a type,
    an inference error), ``("rejected", message)`` (the session was made, but its run refused these
    values or shapes: a check onnxruntime makes that we may lack) or ``("crashed", None)``: onnxruntime
    runs the model in a child process (it aborts on some changed models, "terminate called without an
    active exception", which would end the fuzzer)."""
    import onnxruntime as ort

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the outputs, leave without cleanup
        os.close(read)
        signal.alarm(0)
        try:
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - onnxruntime refuses the changed model
            result = ("refused", None)
        else:
            try:
                result = ("ran", session.run(None, feeds))
            except Exception as exc:  # noqa: BLE001 - onnxruntime refuses these values or shapes
                result = ("rejected", str(exc).splitlines()[0][-300:] if str(exc) else type(exc).__name__)
        with os.fdopen(write, "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as f:
            data = f.read()
    except BaseException:  # (a timeout): the child goes too
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    os.waitpid(pid, 0)
    return pickle.loads(data) if data else ("crashed", None)


def _elem(type_proto):
    """The tensor type inside a sequence or optional type proto."""
    while not type_proto.HasField("tensor_type"):
        type_proto = (type_proto.sequence_type if type_proto.HasField("sequence_type")
                      else type_proto.optional_type).elem_type
    return type_proto.tensor_type


def _items(values) -> list:
    """``values`` with each sequence (a list) replaced by its items."""
    return [a for v in values for a in (v if isinstance(v, list) else [v])]


def _flat(feeds: dict) -> dict:
    """Inputs by name, a sequence's items as ``name[0]``, ``name[1]``, ... (as a program takes them)."""
    return {key: a for k, v in feeds.items()
            for key, a in ([(sequence_item(k, i), a) for i, a in enumerate(v)] if isinstance(v, list) else [(k, v)])}


def _outputs(out: dict, model) -> list:
    """The graph's outputs in order from a run's dict, a sequence output's items (``name[k]``) as a list."""
    res = []
    for vo in model.graph.output:
        if vo.name in out or vo.type.HasField("tensor_type"):
            res.append(out[vo.name])
        else:
            n = sum(1 for k in out if k.startswith(vo.name + "["))
            res.append([out[sequence_item(vo.name, i)] for i in range(n)])
    return res


def _given_shapes(feeds: dict, bound) -> dict:
    """``input_shapes`` for the inputs not bound (a sequence's: its items' shapes)."""
    return input_shapes({k: v for k, v in feeds.items() if k not in bound})


def _reference_agrees(model, feeds, ours) -> bool:
    """Whether onnx's reference evaluator computes ``ours`` too (where onnxruntime does not: its
    float64 Attention and DFT in float32 steps, NaN ties, fully masked rows; rfcs/0006)."""
    from onnx.reference import ReferenceEvaluator

    try:
        return mismatch(ReferenceEvaluator(model).run(None, feeds), ours) is None
    except Exception:  # noqa: BLE001 - the reference lacks the op or this form of it
        return False


#: the relative tolerance of values computed in a type a node's ``softmax_precision`` names (onnx's
#: TensorProto codes: FLOAT, FLOAT16, BFLOAT16)
_NODE_PRECISION_RTOL = {1: 1e-6, 10: 4e-3, 16: 4e-3}


def _precision_floor(model) -> float:
    """The least relative tolerance the model's own arithmetic asks for: an Attention whose
    ``softmax_precision`` is narrower than its inputs computes its probabilities in that type (a
    float16 case retyped to float64 keeps its float32 softmax, whose ``exp`` implementations differ
    by a unit in float32's last place)."""
    return max((_NODE_PRECISION_RTOL.get(a.i, 0.0) for node in model.graph.node for a in node.attribute
                if a.name == "softmax_precision"), default=0.0)


def mismatch(have: list, want: list, floor: float = 0.0) -> str | None:
    """Why outputs ``have`` are not ``want`` (shapes, types, then values: float64 within 1e-9
    relative, float16 and bfloat16 4e-3, other floats 1e-3, none below ``floor``, each with an
    absolute floor of that times the largest finite value; other types exactly), or None."""
    if len(have) != len(want):
        return f"{len(have)} outputs (or sequence items), expected {len(want)}"
    for h, w in zip(have, want):
        if isinstance(w, list) or isinstance(h, list):  # a sequence output: item by item
            why = mismatch(h, w, floor) if isinstance(w, list) and isinstance(h, list) else "a sequence and a tensor"
            if why:
                return why
            continue
        h, w = np.asarray(h), np.asarray(w)
        if h.shape != w.shape:
            return f"shape {h.shape}, expected {w.shape}"
        if h.dtype != w.dtype:
            return f"type {h.dtype}, expected {w.dtype}"
        if w.dtype.kind in "iub" or not w.size:
            if not np.array_equal(h, w):
                return f"{int(np.sum(h != w))} of {w.size} values differ"
            continue
        rtol = max({"float64": 1e-9, "float16": 4e-3, "bfloat16": 4e-3}.get(w.dtype.name, 1e-3), floor)
        a, b = h.astype(np.float64), w.astype(np.float64)
        scale = max(float(np.max(np.abs(b[np.isfinite(b)]), initial=0.0)), 1.0)
        if not np.allclose(a, b, rtol=rtol, atol=rtol * scale, equal_nan=True):
            return f"max difference {np.nanmax(np.abs(a - b))}, largest value {scale}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=MODES)
    p.add_argument("--mutate", choices=MUTATIONS, default="shapes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--only", help="node cases whose name contains this")
    p.add_argument("--save", default=os.path.join(tempfile.gettempdir(), "shardflow-fuzz"),
                   help="folder for the failing cases' models and inputs")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    import onnxruntime as ort

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    ort.set_default_logger_severity(4)
    signal.signal(signal.SIGALRM, _alarm)
    fuzzer = Fuzzer(args.mode, args.mutate, args.seed, args.only, args.save, args.verbose)
    with np.errstate(all="ignore"):
        for _ in range(args.iters):
            fuzzer.one()
        fuzzer.finish()
    return 1 if fuzzer.failures else 0


if __name__ == "__main__":
    sys.exit(main())
