"""Every op's compute definition, evaluated directly, agrees with its numpy implementation.

Each module of ``shardflow.compiler.ops`` provides ``examples(rng)``: small instances
``(op class, input arrays, attrs)``. Every op class in the library must appear there.
"""
import numpy as np
import pytest
from op_examples import op_examples

from shardflow.compiler.ir import const_tensor, evaluate_task
from shardflow.compiler.ops import all_ops


def _examples():
    res = []
    for _, k, cls, arrays, attrs in op_examples():
        desc = ",".join(f"{a}={v}" for a, v in sorted(attrs.items()) if not isinstance(v, np.ndarray))
        res.append(pytest.param(cls, arrays, attrs, id=f"{cls.op_type}-{k}-{desc[:40]}"))
    return res


EXAMPLES = _examples()


@pytest.mark.parametrize("cls,arrays,attrs", EXAMPLES)
def test_compute_definition_matches_numpy(cls, arrays, attrs):
    op = cls([const_tensor(a) for a in arrays], **attrs)
    want = op.run(*arrays)
    if op.task.is_extern:
        pytest.skip("extern output: no index-expression definition to compare")
    with np.errstate(all="ignore"):
        got = evaluate_task(op.task, arrays)
    assert len(got) == len(want)
    for g, w, t in zip(got, want, op.outputs):
        assert g.shape == t.shape == w.shape
        assert g.dtype == np.dtype(t.dtype)
        if w.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-5 if w.dtype != np.float16 else 2e-3, atol=1e-6, equal_nan=True)
        else:
            np.testing.assert_array_equal(g, w)


def test_every_op_has_an_example():
    covered = {p.values[0] for p in EXAMPLES}
    missing = sorted(name for name, cls in all_ops().items() if cls not in covered)
    assert not missing, f"ops without examples(): {missing}"
