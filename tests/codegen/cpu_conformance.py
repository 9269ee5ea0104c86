"""The ONNX backend node tests end to end on the cpu target: each case the evaluator passes
(``tests/frontend/conformance.py``) compiled with ``shardflow.compiler.compile`` (one rank, the
default optimization config: fusion, templates, prepacked weights) and run with
``shardflow.runtime.load(...).run``, its outputs checked against the case's expected outputs under
the conformance tolerance. Classes: passed, wrong (an output differs), refused (compile raises a
ShardflowError), error (an untyped exception: a defect), skipped (not run by the evaluator's
conformance).

Usage: ``python tests/codegen/cpu_conformance.py [substring ...] [-v] [-j N]`` prints the counts
and, with ``-v``, every case that is not passed or skipped, with its reason. About a second a case
(the kernel cache makes a second run faster); ``-j`` runs that many processes.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "frontend")]

from conformance import (RANDOM_PASS, _arrays, _import_binding, input_shapes, is_random_case,  # noqa: E402
                         is_tensor_only, node_cases, outputs_mismatch, print_counts)

from shardflow.compiler import ShardflowError  # noqa: E402


def run_case(case) -> tuple[str, str]:
    """``(status, detail)`` of one node case compiled for the cpu target and run."""
    from shardflow.compiler import compile
    from shardflow.runtime import load

    if not is_tensor_only(case, sequences=True):
        return "skipped", "not tensor-only"
    names = [vi.name for vi in case.model.graph.input if vi.name not in {i.name for i in case.model.graph.initializer}]
    inputs, expected = (_arrays(x) for x in case.data_sets[0])
    if len(inputs) != len(names):
        return "skipped", "optional inputs left out of the data set"
    given = dict(zip(names, inputs))
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            _, feeds, bound = _import_binding(case, given)
        except ShardflowError as exc:
            return "skipped", f"not imported: {type(exc).__name__}"
        try:
            with tempfile.TemporaryDirectory() as d:
                compile(case.model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                        out_dir=os.path.join(d, "out"),
                        input_shapes=input_shapes({k: v for k, v in given.items() if k not in bound}),
                        input_values={k: given[k] for k in bound})
                got = load(os.path.join(d, "out")).run(feeds)
        except ShardflowError as exc:
            return "refused", f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - untyped: a defect
            return "error", f"{type(exc).__name__}: {exc}"
    why = outputs_mismatch(got, [vi.name for vi in case.model.graph.output], expected, case)
    if why:
        return "wrong", why
    return RANDOM_PASS if is_random_case(case) else ("passed", "")


def _one(name: str) -> tuple[str, tuple[str, str]]:
    case = next(c for c in node_cases() if c.name == name)
    return name, run_case(case)


def run_all(patterns=(), jobs: int = 1, every: int = 1) -> dict:
    """``{case name: (status, detail)}`` for the node cases matching ``patterns`` (all by default;
    ``every``: one case in that many, in the order of their names), ``jobs`` processes at a time."""
    names = sorted(c.name for c in node_cases() if not patterns or any(p in c.name for p in patterns))[::every]
    if jobs <= 1:
        return dict(_one(n) for n in names)
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return dict(pool.imap_unordered(_one, names, chunksize=8))


def main(argv):
    jobs = int(argv[argv.index("-j") + 1]) if "-j" in argv else 1
    skip = {argv.index("-j"), argv.index("-j") + 1} if "-j" in argv else set()
    patterns = [a for k, a in enumerate(argv) if a != "-v" and k not in skip]
    print_counts(run_all(patterns, jobs), "-v" in argv, ("passed", "random", "wrong", "error", "refused", "skipped"),
                 ("passed", "skipped"))


if __name__ == "__main__":
    main(sys.argv[1:])
