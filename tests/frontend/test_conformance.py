"""The ONNX backend node tests (every case the onnx package ships) through load_onnx + run.

A case may be refused with a typed error (unsupported feature) or skipped (not tensor-only), but
never answer wrongly or fail with an untyped exception. ``FLOOR`` guards against regressions: raise
it when more cases pass (``python tests/frontend/conformance.py`` prints the counts).
"""
from collections import Counter

import pytest

from conformance import run_all

#: Passed cases, rounded down to a multiple of 10, when this was last raised.
FLOOR = 1400
#: Cases that pass once the graph inputs a handler needs at import are bound (``input_values``).
FLOOR_BOUND = 343
#: Random ops' cases (Bernoulli's, training Dropout's), whose type, shape and support are checked
#: (conformance.random_mismatch).
FLOOR_RANDOM = 10


@pytest.fixture(scope="module")
def results():
    return run_all()


def _names(results, status):
    return sorted(name for name, (s, _) in results.items() if s == status)


def test_runs_every_node_case(results):
    assert len(results) >= 1800, f"only {len(results)} node cases found; is the onnx package complete?"


def test_no_wrong_answers(results):
    wrong = _names(results, "wrong")
    details = "\n".join(f"{n}: {results[n][1][:200]}" for n in wrong)
    assert not wrong, f"{len(wrong)} cases give wrong results:\n{details}"


def test_no_untyped_errors(results):
    errors = _names(results, "error")
    details = "\n".join(f"{n}: {results[n][1][:200]}" for n in errors)
    assert not errors, f"{len(errors)} cases raise untyped exceptions:\n{details}"


def test_passed_count_does_not_regress(results):
    counts = Counter(s for s, _ in results.values())
    assert counts["passed"] >= FLOOR, f"{counts['passed']} cases pass, fewer than the floor {FLOOR}: {dict(counts)}"


def test_binding_inputs_at_import_does_not_regress(results):
    counts = Counter(s for s, _ in results.values())
    assert counts["passed_bound"] >= FLOOR_BOUND, (f"{counts['passed_bound']} cases pass with inputs bound at import, "
                                                   f"fewer than the floor {FLOOR_BOUND}: {dict(counts)}")


def test_random_cases_are_checked_where_a_generator_cannot_be_matched(results):
    counts = Counter(s for s, _ in results.values())
    assert counts["random"] >= FLOOR_RANDOM, f"{counts['random']} random cases checked, fewer than {FLOOR_RANDOM}"
