"""Index expressions, affine analysis, dtype inference and the reference evaluator, on hand-written
compute definitions checked against numpy."""
import re

import numpy as np
import pytest

from shardflow.compiler.ir import (BinOp, Cast, Const, IfThenElse, Reduce, Task, TensorElement, UnaryOp, Var,
                                   affine_form, as_expr, cast, compute, eq, evaluate_task, extern, if_then_else,
                                   infer_dtype, logical_and, maximum, minimum, ne, reduce, tensor_input, walk)
from shardflow.compiler.ir.expr import free_vars, simplify_index


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# building and printing ------------------------------------------------------------------


def test_operators_build_trees_and_print():
    i, k = Var("i", 4), Var("k", 8, "reduce")
    A = tensor_input("A", (4, 8), "float32")
    e = A[i, k] * 2.0 + 1.0
    assert isinstance(e, BinOp) and e.op == "add"
    assert isinstance(e.a, BinOp) and e.a.op == "mul"
    read = e.a.a
    assert isinstance(read, TensorElement) and read.tensor is A and read.indices == (i, k)
    assert isinstance(e.b, Const) and e.b.value == 1.0
    assert repr(e) == "((A[i, k] * 2.0) + 1.0)"
    # reflected operators keep operand order
    assert repr(1 - i) == "(1 - i)"
    assert repr(2 // (i + 1)) == "(2 // (i + 1))"
    assert repr(-i) == "neg(i)"
    assert repr(maximum(i, 3)) == "max(i, 3)"
    assert repr(minimum(i, k)) == "min(i, k)"
    assert repr(if_then_else(i < 2, A[i, k], 0.0)) == "select((i < 2), A[i, k], 0.0)"
    assert repr(cast(A[i, 0], "float16")) == "cast<float16>(A[i, 0])"
    assert repr(logical_and(eq(i, 1), ne(k, 2))) == "((i == 1) && (k != 2))"


def test_comparisons_build_expressions_and_equality_keeps_identity():
    i = Var("i", 4)
    assert isinstance(i < 3, BinOp) and (i < 3).op == "lt"
    assert eq(i, 3).op == "eq" and ne(i, 3).op == "ne"
    # `==` stays identity so expressions can be dict keys
    j = Var("i", 4)
    assert i == i and not (i == j)
    assert len({i: 1, j: 2}) == 2


def test_expression_has_no_truth_value():
    i = Var("i", 4)
    with pytest.raises(TypeError, match="truth value"):
        bool(i < 3)
    with pytest.raises(TypeError, match="truth value"):
        if i:  # noqa: SIM102 - the point of the test
            pass


def test_invalid_constructions_are_rejected():
    i = Var("i", 4)
    with pytest.raises(ValueError, match="unknown binary op 'bogus'"):
        BinOp("bogus", i, i)
    with pytest.raises(ValueError, match="unknown unary op 'bogus'"):
        UnaryOp("bogus", i)
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        Reduce((Var("k", 3, "reduce"),), i, "median")
    with pytest.raises(ValueError, match="exactly one variable"):
        Reduce((Var("k", 3, "reduce"), Var("m", 3, "reduce")), i, "argmax")
    with pytest.raises(TypeError, match="cannot use str"):
        as_expr("x")
    A = tensor_input("A", (4, 8), "float32")
    with pytest.raises(IndexError, match="A has rank 2, indexed with 1"):
        A[i]
    with pytest.raises(ValueError, match="takes 1 axes but the shape has rank 2"):
        compute("C", (4, 8), lambda a: A[a, 0])
    with pytest.raises(ValueError, match="takes 2 axes but the shape has rank 1"):
        reduce((8,), lambda a, b: A[a, b])


def test_compute_and_task_printing():
    A = tensor_input("A", (4, 8), "float32")
    B = tensor_input("B", (8, 3), "float32")
    C = compute("C", (4, 3), lambda i, j: reduce((8,), lambda k: A[i, k] * B[k, j], "sum"))
    assert C.shape == (4, 3) and C.ndim == 2
    assert [a.name for a in C.axes] == ["i0", "i1"] and all(a.kind == "spatial" for a in C.axes)
    (r,) = C.reduces()
    assert r.op == "sum" and [v.extent for v in r.vars] == [8] and r.vars[0].kind == "reduce"
    assert re.fullmatch(r"C\[i0, i1\] = sum\[(k\d+_0)<8\]\(\(A\[i0, \1\] \* B\[\1, i1\]\)\)", repr(C)), repr(C)
    task = Task("matmul", [A, B], [C])
    text = str(task)
    assert text.splitlines()[0] == "task matmul(A[4, 8]:float32, B[8, 3]:float32)"
    assert "C[i0, i1] = sum[" in text
    assert not task.is_extern
    ext = Task("topk", [A], [extern("V", (4, 2), "float32", [(0, 0), None], "sorting")],
               data_dependent=None)
    assert ext.is_extern
    assert "V[4, 2]: extern (sorting)" in str(ext)
    dd = Task("nonzero", [A], [C], data_dependent="count of non-zeros")
    assert "data-dependent: count of non-zeros" in str(dd)


def test_walk_visits_shared_subtrees_once():
    i = Var("i", 4)
    shared = i * 2
    e = shared + shared
    nodes = list(walk(e))
    assert nodes[0] is e
    assert sum(n is shared for n in nodes) == 1
    assert sum(n is i for n in nodes) == 1
    assert len(nodes) == 4  # add, mul, i, 2
    k = Var("k", 3, "reduce")
    assert free_vars(i + k * 2) == {i, k}


# affine analysis ---------------------------------------------------------------------------


def test_affine_form_of_affine_expressions():
    i, j, k = Var("i", 4), Var("j", 5), Var("k", 3, "reduce")
    assert affine_form(i) == ({i: 1}, 0)
    assert affine_form(as_expr(7)) == ({}, 7)
    assert affine_form(i * 2 + k - 1) == ({i: 2, k: 1}, -1)  # a strided, padded convolution window
    assert affine_form(3 * (i + 1)) == ({i: 3}, 3)
    assert affine_form((i + j) * 2 - j) == ({i: 2, j: 1}, 0)
    assert affine_form(2 - i) == ({i: -1}, 2)
    # coefficients that cancel disappear
    assert affine_form(i + j - i) == ({j: 1}, 0)
    assert affine_form(i * 0 + 5) == ({}, 5)


def test_affine_form_rejects_non_affine_expressions():
    i, j = Var("i", 4), Var("j", 5)
    A = tensor_input("A", (4,), "int64")
    for e in [i // 2, i % 3, i * j, A[i] + 1, if_then_else(i < 2, i, j), maximum(i, j), as_expr(1.5) + i,
              as_expr(True), Cast(i, "int32"), i / 2]:
        assert affine_form(e) is None, repr(e)


def test_simplify_index_folds_trivial_arithmetic():
    i = Var("i", 4)
    assert simplify_index(i * 1 + 0) is i
    assert simplify_index(1 * (0 + i)) is i
    assert simplify_index(i - 0) is i
    assert simplify_index(i // 1) is i
    folded = simplify_index(as_expr(2) * 3 + 1)
    assert isinstance(folded, Const) and folded.value == 7
    assert isinstance(simplify_index(i * 0), Const) and simplify_index(i * 0).value == 0
    e = i * 2 + 1
    assert simplify_index(e) is e  # nothing to fold: the same object comes back


# dtype inference ----------------------------------------------------------------------------


@pytest.mark.parametrize("build,dtype", [
    (lambda i, A, B: A[i] + 1.0, "float32"),          # weak Python float adopts the tensor's dtype
    (lambda i, A, B: A[i] * 2, "float32"),
    (lambda i, A, B: B[i] + 1, "int32"),              # weak int keeps the int dtype
    (lambda i, A, B: B[i] + 1.5, "float64"),          # weak float over an int tensor promotes
    (lambda i, A, B: A[i] + B[i], "float64"),          # numpy promotion of float32 and int32
    (lambda i, A, B: B[i] / 2, "float64"),            # true division of ints
    (lambda i, A, B: A[i] < 0.0, "bool"),
    (lambda i, A, B: logical_and(A[i] > 0.0, B[i] < 1), "bool"),
    (lambda i, A, B: UnaryOp("isnan", A[i]), "bool"),
    (lambda i, A, B: UnaryOp("exp", A[i]), "float32"),
    (lambda i, A, B: Cast(B[i], "float16"), "float16"),
    (lambda i, A, B: Cast(A[i], "bfloat16"), "bfloat16"),
    (lambda i, A, B: i * 2, "int64"),                  # axis variables are int64
    (lambda i, A, B: if_then_else(i < 2, A[i], 0.0), "float32"),
    (lambda i, A, B: Const(1, "int8") + Const(2, "int16"), "int16"),
    (lambda i, A, B: as_expr(1) + 2, "int64"),        # all-weak: Python int → int64
    (lambda i, A, B: as_expr(1) + 2.0, "float32"),    # all-weak with a float → float32
    (lambda i, A, B: reduce((3,), lambda k: A[k], "argmax"), "int64"),
    (lambda i, A, B: reduce((3,), lambda k: A[k], "max"), "float32"),
])
def test_infer_dtype(build, dtype):
    i = Var("i", 3)
    A = tensor_input("A", (3,), "float32")
    B = tensor_input("B", (3,), "int32")
    assert infer_dtype(build(i, A, B)) == dtype


def test_infer_dtype_of_lone_weak_constant_is_none():
    assert infer_dtype(Const(3)) is None
    assert infer_dtype(Const(3, "uint8")) == "uint8"


# the reference evaluator --------------------------------------------------------------------


def test_matmul_by_reduce_matches_numpy(rng):
    M, K, N = 5, 7, 3
    A = tensor_input("A", (M, K), "float32")
    B = tensor_input("B", (K, N), "float32")
    C = compute("C", (M, N), lambda i, j: reduce((K,), lambda k: A[i, k] * B[k, j], "sum"), dtype="float32")
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    (c,) = evaluate_task(Task("matmul", [A, B], [C]), [a, b])
    assert c.shape == (M, N) and c.dtype == np.float32
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)


def test_batched_matmul_with_broadcast_read(rng):
    A = tensor_input("A", (2, 3, 4), "float64")
    B = tensor_input("B", (1, 4, 5), "float64")
    C = compute("C", (2, 3, 5), lambda b, i, j: reduce((4,), lambda k: A[b, i, k] * B[0, k, j]))
    a, bb = rng.standard_normal((2, 3, 4)), rng.standard_normal((1, 4, 5))
    (c,) = evaluate_task(Task("bmm", [A, B], [C]), [a, bb])
    np.testing.assert_allclose(c, np.matmul(a, bb), rtol=1e-12)


def test_padding_reads_out_of_bounds_only_in_the_untaken_branch(rng):
    H, W, p = 3, 4, 2
    X = tensor_input("X", (H, W), "float32")

    def body(i, j):
        inside = logical_and(logical_and(i >= p, i < H + p), logical_and(j >= p, j < W + p))
        return if_then_else(inside, X[i - p, j - p], Const(-1.0, "float32"))

    P = compute("P", (H + 2 * p, W + 2 * p), body)
    x = rng.standard_normal((H, W)).astype(np.float32)
    (y,) = evaluate_task(Task("pad", [X], [P]), [x])
    np.testing.assert_array_equal(y, np.pad(x, p, constant_values=-1.0))


def test_strided_window_sum_matches_numpy(rng):
    # a 1-D convolution with stride 2 and kernel 3: the index i*2 + k is affine
    X = tensor_input("X", (11,), "float32")
    Wt = tensor_input("W", (3,), "float32")
    Y = compute("Y", (5,), lambda i: reduce((3,), lambda k: X[i * 2 + k] * Wt[k]))
    x, w = rng.standard_normal(11).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    (y,) = evaluate_task(Task("conv1d", [X, Wt], [Y]), [x, w])
    want = np.array([x[2 * o:2 * o + 3] @ w for o in range(5)], np.float32)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    (r,) = Y.reduces()
    read = next(n for n in walk(Y.value) if isinstance(n, TensorElement) and n.tensor is X)
    assert affine_form(read.indices[0]) == ({Y.axes[0]: 2, r.vars[0]: 1}, 0)


@pytest.mark.parametrize("op,fn", [("argmax", np.argmax), ("argmin", np.argmin)])
def test_arg_reduction_returns_first_extremum_index(op, fn):
    X = tensor_input("X", (3, 5), "float32")
    Y = compute("Y", (3,), lambda i: reduce((5,), lambda k: X[i, k], op))
    x = np.array([[1, 5, 5, 0, 2], [7, 7, 7, 7, 7], [-1, -3, 4, -3, 4]], np.float32)
    (y,) = evaluate_task(Task(op, [X], [Y]), [x])
    assert infer_dtype(Y.value) == "int64"
    np.testing.assert_array_equal(y, fn(x, axis=1))
    assert y.dtype == np.int64


@pytest.mark.parametrize("op,fn", [("sum", np.sum), ("prod", np.prod), ("max", np.max), ("min", np.min),
                                   ("mean", np.mean)])
def test_reductions_over_two_axes(rng, op, fn):
    X = tensor_input("X", (2, 3, 4), "float64")
    Y = compute("Y", (3,), lambda j: reduce((2, 4), lambda a, b: X[a, j, b], op))
    x = rng.uniform(0.5, 1.5, (2, 3, 4))
    (y,) = evaluate_task(Task(op, [X], [Y]), [x])
    np.testing.assert_allclose(y, fn(x, axis=(0, 2)), rtol=1e-12)


def test_nested_reductions_softmax(rng):
    R, C = 4, 6
    X = tensor_input("X", (R, C), "float32")

    def softmax(i, j):
        row_max = reduce((C,), lambda m: X[i, m], "max")
        denom = reduce((C,), lambda k: UnaryOp("exp", X[i, k] - reduce((C,), lambda m: X[i, m], "max")), "sum")
        return UnaryOp("exp", X[i, j] - row_max) / denom

    Y = compute("Y", (R, C), softmax)
    assert len(Y.reduces()) == 3  # the max inside the sum is a nested reduction
    x = (rng.standard_normal((R, C)) * 10).astype(np.float32)
    (y,) = evaluate_task(Task("softmax", [X], [Y]), [x])
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert infer_dtype(Y.value) == "float32"


def test_a_compute_can_read_an_earlier_output(rng):
    X = tensor_input("X", (3, 4), "float32")
    M = compute("M", (3,), lambda i: reduce((4,), lambda k: X[i, k], "max"))
    Y = compute("Y", (3, 4), lambda i, j: X[i, j] - M[i])
    x = rng.standard_normal((3, 4)).astype(np.float32)
    m, y = evaluate_task(Task("center", [X], [M, Y]), [x])
    np.testing.assert_allclose(m, x.max(axis=1))
    np.testing.assert_allclose(y, x - x.max(axis=1, keepdims=True))


def test_output_dtype_cast_and_broadcast_of_constant_body():
    X = tensor_input("X", (2, 3), "float32")
    Y = compute("Y", (2, 3), lambda i, j: 7, dtype="int8")      # constant body broadcast to the grid
    Z = compute("Z", (2, 3), lambda i, j: i * 10 + j, dtype="float32")
    y, z = evaluate_task(Task("c", [X], [Y, Z]), [np.zeros((2, 3), np.float32)])
    assert y.dtype == np.int8 and y.shape == (2, 3) and (y == 7).all()
    np.testing.assert_array_equal(z, np.array([[0, 1, 2], [10, 11, 12]], np.float32))


def test_evaluate_task_checks_its_arguments():
    X = tensor_input("X", (2, 3), "float32")
    Y = compute("Y", (2, 3), lambda i, j: X[i, j])
    task = Task("copy", [X], [Y])
    with pytest.raises(ValueError, match="takes 1 inputs, got 2"):
        evaluate_task(task, [np.zeros((2, 3)), np.zeros((2, 3))])
    with pytest.raises(ValueError, match=r"input X of copy: shape \(3, 2\), expected \(2, 3\)"):
        evaluate_task(task, [np.zeros((3, 2), np.float32)])
    ext = Task("sort", [X], [extern("S", (2, 3), "float32", [(0, 0), None], "sorting")])
    with pytest.raises(TypeError, match="extern output"):
        evaluate_task(ext, [np.zeros((2, 3), np.float32)])
