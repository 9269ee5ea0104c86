"""Runs the ONNX backend node test cases (built in memory by the onnx package) through
``load_onnx(...).run(...)`` and classifies each: passed, passed_bound (passed once the graph
inputs a handler needs at import, such as axes or sizes, were bound with ``input_values``),
random (a random op's output: values no other generator reproduces, so type, shape and support
checked), wrong, refused, error or skipped.

Usage: ``python tests/frontend/conformance.py [substring ...] [-v]`` prints the counts and,
with ``-v``, every non-passing case with its reason.
"""
from __future__ import annotations

import functools
import re
import sys
import warnings
from collections import Counter

import numpy as np

from shardflow.compiler import ShardflowError, UnsupportedOperatorError, load_onnx
from shardflow.compiler.frontend.registry import sequence_item
from shardflow.compiler.ir.expr import ML_FLOATS
from shardflow.compiler.ir.graph import RNG_STEP

#: Tolerance multiplier over each case's own rtol/atol.
TOLERANCE_FACTOR = 10.0


@functools.lru_cache(maxsize=1)
def node_cases():
    """The onnx package's node test cases (built once per process: several suites read them)."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model_tests(kind="node")


def _arrays(values) -> list:
    """The data set's values, numpy scalars (0-d tensors in the .pb files) as 0-d arrays and
    ``TensorProto``s (the loader's form of a data set holding bfloat16, float8 or 4-bit types) as
    arrays (ml_dtypes' for those types)."""
    from onnx import TensorProto, numpy_helper

    def one(v):
        if isinstance(v, list):  # (a sequence's items)
            return [one(x) for x in v]
        if isinstance(v, np.generic):
            return np.asarray(v)
        if isinstance(v, TensorProto):
            return numpy_helper.to_array(v)
        return v
    return [one(v) for v in values]


def is_tensor_only(case, sequences: bool = False) -> bool:
    """Whether the case's inputs and outputs are tensors of supported types; ``sequences``: they may
    also be lists of such tensors (sequences, taken and returned item by item) and its inputs ``None``
    (empty optionals, bound at import)."""
    for inputs, outputs in case.data_sets:
        values = [v for v in _arrays(inputs) if not (sequences and v is None)] + _arrays(outputs)
        if sequences:
            values = [a for v in values for a in (_arrays(v) if isinstance(v, list) else [v])]
        for a in values:
            if not isinstance(a, np.ndarray) or a.dtype.names:
                return False
            if a.dtype.name in ML_FLOATS:
                continue
            if a.dtype.kind in "OUSV" or a.dtype.type.__module__.startswith("ml_dtypes"):
                return False  # objects, strings, ml_dtypes' float8 and 4-bit types
    return bool(case.data_sets)


#: The message of a handler that needs an input's value at import (registry.NodeContext.const),
#: naming the graph inputs that value depends on.
_NEEDS_VALUE = re.compile(r"must be known at compile time .* depends on graph inputs \[([^\]]*)\]")


def _import_binding(case, feeds: dict) -> tuple:
    """``load_onnx`` the case with every input shape given; where a handler needs a value computed
    from graph inputs (axes, sizes, a shape), bind those inputs at import (``input_values``) and
    retry. Returns the graph, the feeds it still takes (with a random op's step, 0: the first run)
    and the names bound (an empty optional input, ``None``, is bound from the start)."""
    bound: dict = {k: None for k, v in feeds.items() if v is None}
    while True:
        try:
            rest = {k: v for k, v in feeds.items() if k not in bound}
            # (a sequence input, a list: its items' shapes, and its items fed as name[0], name[1], ...)
            g = load_onnx(case.model, input_shapes=input_shapes(rest), input_values=bound)
            rest = {key: a for k, v in rest.items()
                    for key, a in ([(sequence_item(k, i), a) for i, a in enumerate(v)] if isinstance(v, list)
                                   else [(k, v)])}
            if RNG_STEP in {t.name for t in g.inputs}:
                rest[RNG_STEP] = np.array(0, np.int64)
            return g, rest, sorted(bound)
        except UnsupportedOperatorError as exc:
            m = _NEEDS_VALUE.search(str(exc))
            names = re.findall(r"'([^']*)'", m.group(1)) if m else []
            if not names or any(n not in feeds or n in bound for n in names):
                raise
            bound.update({n: feeds[n] for n in names})


def outputs_mismatch(got: dict, names: list[str], expected: list, case) -> str | None:
    """Why the outputs ``got`` (by name) are not the case's ``expected`` (in the order of ``names``), or
    None. An expected list is a sequence output, whose items are the outputs ``name[0]``, ``name[1]``, ..."""
    for name, want in zip(names, expected):
        if isinstance(want, list):
            items = [k for k in got if k.startswith(f"{name}[")]
            if len(items) != len(want):
                return f"output {name}: a sequence of {len(items)} tensors, expected {len(want)}"
            pairs = [(sequence_item(name, k), w) for k, w in enumerate(_arrays(want))]
        else:
            pairs = [(name, want)]
        for key, w in pairs:
            why = mismatch(np.asarray(got[key]), w, case)
            if why:
                return f"output {key}: {why}"
    return None


def input_shapes(given: dict) -> dict:
    """The shapes of the inputs ``given`` (a sequence's, a list: its items' shapes), for ``input_shapes``."""
    return {k: [a.shape for a in v] if isinstance(v, list) else v.shape for k, v in given.items()}


def mismatch(have: np.ndarray, want: np.ndarray, case) -> str | None:
    """Why ``have`` is not the case's expected ``want`` under the conformance tolerance, or None (a
    random op's case: :func:`random_mismatch`)."""
    if is_random_case(case):
        return random_mismatch(have, want, case)
    if have.shape != want.shape:
        return f"shape {have.shape}, expected {want.shape}"
    if have.dtype != want.dtype:
        return f"dtype {have.dtype}, expected {want.dtype}"
    rtol, atol = TOLERANCE_FACTOR * case.rtol, TOLERANCE_FACTOR * case.atol
    if want.dtype.name == "bfloat16":  # ml_dtypes' (kind "V"): compared in float32, to
        # one bfloat16 rounding (2**-8 relative; the references round after every op)
        have, want = have.astype(np.float32), want.astype(np.float32)
        rtol, atol = max(rtol, 2.0 ** -8), max(atol, 2.0 ** -8)
    elif want.dtype.name in ML_FLOATS:  # float8: the casts' results, exactly
        have, want = have.astype(np.float32), want.astype(np.float32)
        rtol = atol = 0.0
    if want.dtype.kind in "fc":
        ok = np.allclose(have, want, rtol=rtol, atol=atol, equal_nan=True)
    else:
        ok = np.array_equal(have, want)
    if ok:
        return None
    with np.errstate(all="ignore"):
        err = np.max(np.abs(have.astype(np.float64) - want.astype(np.float64)))
    return f"max abs error {err:.3g}"


#: ONNX's random ops (frontend/handlers_random.py)
RANDOM_OPS = {"Bernoulli", "RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial"}
#: the status of a random op's case whose outputs :func:`random_mismatch` accepts
RANDOM_PASS = ("random", "values drawn by Shardflow's generator: type, shape and support checked")


def is_random_case(case) -> bool:
    """Whether the case's model has a random op (its expected values are another generator's): one
    of :data:`RANDOM_OPS`, or a Dropout in training mode with a ratio above 0 (the backend's
    ``test_training_dropout*`` cases but the ``zero_ratio`` ones, whose ratio is an input's value)."""
    ops = {n.op_type for n in case.model.graph.node}
    return bool(ops & RANDOM_OPS) or ("Dropout" in ops and "training_dropout" in case.name
                                      and "zero_ratio" not in case.name)


def random_mismatch(have, want, case) -> str | None:
    """A random op's output (``Bernoulli``: the expected values come from numpy's generator, which
    no other generator reproduces) checked for what does not depend on the generator: the type, the
    shape, and the support (every value one the expected output could hold: 0 or 1 for a
    Bernoulli; a training Dropout's kept values those the expected output kept too); ``None`` when
    those agree."""
    have, want = np.asarray(have), np.asarray(want)
    if have.shape != want.shape or have.dtype != want.dtype:
        return f"{have.dtype}{list(have.shape)} where {want.dtype}{list(want.shape)} was expected"
    if "bernoulli" in case.name:
        outside = ~np.isin(have, [0, 1])
        if outside.any():
            return f"values {np.unique(have[outside])[:5]} outside a Bernoulli's support {{0, 1}}"
    if "dropout" in case.name and have.dtype != bool:  # (kept values: x / (1 - ratio) in both)
        both = (have != 0) & (want != 0)
        if not both.any() or not np.allclose(have[both], want[both], rtol=1e-6, atol=0):
            return "the values both kept differ"
    return None


def print_counts(results: dict, verbose: bool, statuses: tuple, shown: tuple) -> None:
    """Print, with ``verbose``, each case whose status is not in ``shown`` and its reason, then the
    counts of ``statuses``."""
    counts = Counter(s for s, _ in results.values())
    if verbose:
        for name, (s, d) in sorted(results.items()):
            if s not in shown:
                print(f"{s:8s} {name}: {d[:300]}")
    print(", ".join(f"{k}={counts.get(k, 0)}" for k in statuses))


def run_case(case) -> tuple[str, str]:
    """Return ``(status, detail)`` with status in passed / passed_bound / wrong / refused / error /
    skipped; ``passed_bound``: passed with some inputs bound at import (``input_values``)."""
    if not is_tensor_only(case, sequences=True):
        return "skipped", "not tensor-only"
    graph_inputs = [vi.name for vi in case.model.graph.input
                    if vi.name not in {i.name for i in case.model.graph.initializer}]
    out_names = [vi.name for vi in case.model.graph.output]
    bound = []
    try:
        for inputs, expected in case.data_sets:
            inputs, expected = _arrays(inputs), _arrays(expected)
            if len(inputs) != len(graph_inputs):
                return "skipped", "optional inputs left out of the data set"
            g, feeds, bound = _import_binding(case, dict(zip(graph_inputs, inputs)))
            got = g.run(feeds)
            why = outputs_mismatch(got, out_names, expected, case)
            if why:
                return "wrong", why
            if is_random_case(case):
                if RNG_STEP not in {t.name for t in g.inputs}:
                    return "wrong", "a random op's graph without the step input"
                return RANDOM_PASS
        return ("passed_bound", f"bound at import: {', '.join(bound)}") if bound else ("passed", "")
    except ShardflowError as exc:
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, ShardflowError):
            # the importer wraps raw exceptions of handlers; on a valid model that is a defect
            return "error", f"{type(cause).__name__} inside a handler: {exc}"
        return "refused", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # untyped: a defect
        return "error", f"{type(exc).__name__}: {exc}"


def run_all(patterns=()):
    results = {}
    for case in node_cases():
        if patterns and not any(p in case.name for p in patterns):
            continue
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            results[case.name] = run_case(case)
    return results


def main(argv):
    verbose = "-v" in argv
    patterns = [a for a in argv if a != "-v"]
    print_counts(run_all(patterns), verbose,
                 ("passed", "passed_bound", "random", "wrong", "error", "refused", "skipped"),
                 ("passed", "passed_bound", "skipped"))


if __name__ == "__main__":
    main(sys.argv[1:])
