"""Which trailing kernels of a cuda program may write its outputs straight into fresh arrays
(runtime/cuda_exec.py, ``fresh_output_writers``); the GPU side is checked by
tests/runtime/test_gpu_runtime.py."""
from __future__ import annotations

from shardflow.runtime.cuda_exec import fresh_output_writers


def _program(steps, outputs, inputs=(("x", 0),), weights=()):
    n = 1 + max(i for s in steps for i in list(s.get("inputs", ())) + list(s.get("outputs", ())))
    buffers = [{"storage": "weights" if i in weights else "arena"} for i in range(n)]
    return {"steps": steps, "outputs": [list(o) for o in outputs], "inputs": [list(i) for i in inputs],
            "buffers": buffers}


def _kernel(ins, outs):
    return {"kind": "kernel", "inputs": list(ins), "outputs": list(outs)}


def test_the_kernel_that_writes_the_logits_last():
    p = _program([_kernel([0], [1]), _kernel([1, 2], [3])], [("logits", 3)], weights=(2,))
    assert fresh_output_writers(p) == (1, frozenset({3}))


def test_several_trailing_outputs():
    p = _program([_kernel([0], [1]), _kernel([1], [2]), _kernel([1], [3])], [("a", 2), ("b", 3)])
    assert fresh_output_writers(p) == (2, frozenset({2, 3}))


def test_outputs_that_must_stay_in_the_arena():
    # an output that a later kernel reads is copied out; the later kernel's own may be fresh
    p = _program([_kernel([0], [1]), _kernel([1], [2])], [("h", 1), ("y", 2)])
    assert fresh_output_writers(p) == (1, frozenset({2}))
    cases = {  # an input passed through has no writer; the others' writers must leave them in the arena
        "an input": _program([_kernel([0], [1]), _kernel([1], [2])], [("x", 0), ("h", 1)]),
        "two names": _program([_kernel([0], [1])], [("y", 1), ("z", 1)]),
        "also writes a temporary": _program([_kernel([0], [1, 2])], [("y", 1)]),
        "two writers": _program([_kernel([0], [1]), _kernel([0], [1])], [("y", 1)]),
        "weights": _program([_kernel([0], [1])], [("y", 1)], weights=(1,)),
    }
    for name, p in cases.items():
        assert fresh_output_writers(p) == (0, frozenset()), name
    # a collective last: nothing after it; before it, the kernel writes what the collective reads
    p = _program([_kernel([0], [1]), {"kind": "collective", "inputs": [1], "outputs": [2]}], [("y", 2)])
    assert fresh_output_writers(p) == (0, frozenset())
    # y's writer comes before a kernel that does not qualify (t is read): only the run of kernels
    # that ends the program writes fresh arrays, so y stays in the arena
    p = _program([_kernel([0], [1]), _kernel([0], [2]), _kernel([2], [3])], [("y", 1), ("z", 3), ("t", 2)])
    assert fresh_output_writers(p) == (1, frozenset({3}))


def test_a_kernel_reading_a_state_input_stays_in_the_graph():
    """The state is copied into its input at the end of the captured graph: a trailing kernel that
    reads the input (its old value) must run before that, inside the graph."""
    steps = [_kernel([0, 1], [2]), _kernel([0, 2], [3])]  # h = f(x, s); y = g(x, h), s the state input
    p = _program(steps, [("y", 3)], inputs=(("x", 0), ("s", 1)))
    assert fresh_output_writers(p) == (1, frozenset({3}))
    p["state"] = [{"input": "s", "input_buffer": 1, "output": "h", "output_buffer": 2}]
    assert fresh_output_writers(p) == (1, frozenset({3}))  # (the last kernel reads x and h, not s)
    p["steps"][1] = _kernel([1, 2], [3])
    assert fresh_output_writers(p) == (0, frozenset())
