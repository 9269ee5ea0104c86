"""Handlers for the recurrent ONNX ops RNN, GRU and LSTM, unrolled over the sequence at import.

The sequence length is static, so a recurrent node becomes plain flow-graph ops:

* one ``Gemm`` projects every time step's input through ``W`` (both directions at once) and adds
  the biases that do not sit inside the recurrence;
* per direction and time step, a ``Gemm`` adds ``H_{t-1} @ R^T`` to that step's projection,
  ``Slice`` splits the gates, ``Clip`` applies ``clip`` and element-wise ops apply the
  activations and the state update;
* ``Concat``/``Reshape``/``Transpose`` assemble ``Y``, ``Y_h`` and ``Y_c`` in the requested
  ``layout``.

``sequence_lens`` is honoured with ``Where`` masks: batch entry ``b`` updates its state only at
time steps ``t < sequence_lens[b]`` (the reverse direction therefore starts at its last valid
step), its ``Y`` rows are zero from ``sequence_lens[b]`` on, and its ``Y_h``/``Y_c`` are the state
after its last valid step, or zero for an empty sequence (as onnxruntime does). When the lengths
are constants the masks are constants too and steps nobody needs are left out; when they are a
graph input the masks are computed at run time (a length above the sequence length then acts as
the sequence length, a negative one as zero).

``activation_alpha``/``activation_beta`` are consumed in the order of the activations, one value
by each activation that takes that parameter (onnxruntime's reading of the spec); activations
left without a value use the defaults of the corresponding ONNX operators.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..ir.graph import Tensor
from ..ops.elementwise import Activation, Binary, Clip, Unary, Where
from ..ops.linalg import Gemm
from ..ops.transform import Concat, Reshape, Slice, Transpose
from .registry import FLOATS, NodeContext, onnx_op

__all__ = ["MAX_TIME_STEPS"]

log = logging.getLogger(__name__)

#: Longest sequence a recurrent node is unrolled over; longer ones are refused.
MAX_TIME_STEPS = 4096
#: Most inputs of one ``Concat`` when stacking the time steps (deeper sequences concatenate in a tree).
_CONCAT_FANOUT = 16

_DIRECTIONS = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}


@dataclass(frozen=True)
class _ActivationKind:
    """How a recurrent activation maps onto ops, and which parameters it takes."""

    kind: str | None             #: the :class:`Activation` kind, or None for those built here
    alpha: bool = False          #: consumes a value of ``activation_alpha``
    beta: bool = False           #: consumes a value of ``activation_beta``
    default_alpha: float | None = None
    default_beta: float | None = None


# Keys are lower case: onnxruntime matches activation names case-insensitively, and so do we.
_ACTIVATION_KINDS = {
    "relu": _ActivationKind("relu"),
    "tanh": _ActivationKind(None),
    "sigmoid": _ActivationKind("sigmoid"),
    "affine": _ActivationKind(None, True, True, 1.0, 0.0),
    "leakyrelu": _ActivationKind("leaky_relu", True, False, 0.01),
    "thresholdedrelu": _ActivationKind("thresholded_relu", True, False, 1.0),
    "scaledtanh": _ActivationKind(None, True, True),          # the spec gives no defaults
    "hardsigmoid": _ActivationKind("hard_sigmoid", True, True, 0.2, 0.5),
    "elu": _ActivationKind("elu", True, False, 1.0),
    "softsign": _ActivationKind("softsign"),
    "softplus": _ActivationKind("softplus"),
}
_ACTIVATION_NAMES = ("Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh",
                     "HardSigmoid", "Elu", "Softsign", "Softplus")


def _int_attr(ctx: NodeContext, name: str, default: int) -> int:
    v = ctx.attr(name, default)
    if not isinstance(v, (int, np.integer)):
        raise ctx.invalid(f"attribute {name!r} must be an int, got {v!r}")
    return int(v)


def _floats_attr(ctx: NodeContext, name: str) -> list[float]:
    v = ctx.attr(name, [])
    if not isinstance(v, (list, tuple)) or not all(isinstance(e, (int, float)) for e in v):
        raise ctx.invalid(f"attribute {name!r} must be a list of floats, got {v!r}")
    return [float(e) for e in v]


@dataclass(frozen=True)
class _Act:
    """One resolved activation: its lower-case name and parameters."""

    name: str
    alpha: float | None
    beta: float | None


#: ``make_step(rec, d)`` returns the step function of direction ``d``:
#: ``step(tag, xw, state) -> state`` where ``xw`` is the step's input projection ``[B, G*H]``.
StepFactory = Callable[["_Recurrence", int], Callable[[str, Tensor, tuple], tuple]]


class _Recurrence:
    """What RNN, GRU and LSTM share: reading and checking the operands, the activations, the
    input projection, the per-step masks of ``sequence_lens``, the unrolled loop and the outputs.

    Parameters
    ----------
    ctx
        The node's context.
    gates
        Number of gate blocks stacked in ``W``/``R`` (1 for RNN, 3 for GRU, 4 for LSTM).
    default_activations
        The activations of one direction when the node gives none.
    state_inputs
        Input index of each state's initial value (``initial_h``, then ``initial_c`` for LSTM).
    recurrent_bias_block
        The gate block whose ``R`` bias must stay inside the recurrence instead of being folded
        into the input projection (GRU's hidden gate with ``linear_before_reset``), if any.
    """

    def __init__(self, ctx: NodeContext, gates: int, default_activations: tuple[str, ...],
                 state_inputs: tuple[int, ...], recurrent_bias_block: int | None = None):
        self.ctx = ctx
        self.gates = gates
        x, w, r = ctx.input(0), ctx.input(1), ctx.input(2)
        if x.dtype not in FLOATS:
            raise ctx.unsupported(f"dtype {x.dtype} (float16, float32 or float64 expected)")
        direction = ctx.attr("direction", "forward")
        if not isinstance(direction, str) or direction not in _DIRECTIONS:
            raise ctx.invalid(f"direction must be forward, reverse or bidirectional, got {direction!r}")
        self.reverse = _DIRECTIONS[direction]
        nd = len(self.reverse)
        self.layout = _int_attr(ctx, "layout", 0)
        if self.layout not in (0, 1) or (self.layout and ctx.opset < 14):
            raise ctx.invalid(f"layout={self.layout} is not valid at opset {ctx.opset}")
        if x.ndim != 3:
            raise ctx.shape_error(f"X must be 3-D, got shape {x.shape}")
        if self.layout:
            x = self.op(Transpose, [x], "X_time_major", perm=(1, 0, 2))
        seq, batch, inp = x.shape
        if r.ndim != 3:
            raise ctx.shape_error(f"R must be 3-D, got shape {r.shape}")
        hidden = _int_attr(ctx, "hidden_size", r.shape[2])
        if hidden <= 0:
            raise ctx.invalid(f"hidden_size={hidden} must be positive")
        want = {"W": ((nd, gates * hidden, inp), w), "R": ((nd, gates * hidden, hidden), r)}
        for what, (shape, t) in want.items():
            if t.shape != shape:
                raise ctx.shape_error(f"{what} has shape {t.shape}, expected {shape} (direction={direction}, "
                                      f"hidden_size={hidden}, input_size={inp})")
        if min(seq, batch, inp) == 0:
            raise ctx.unsupported(f"an empty input X of shape {ctx.input(0).shape}")
        if seq > MAX_TIME_STEPS:
            raise ctx.unsupported(f"a sequence of {seq} time steps (unrolled at import; at most "
                                  f"{MAX_TIME_STEPS} are accepted)")
        self.x, self.seq, self.batch, self.hidden, self.nd = x, seq, batch, hidden, nd
        self.dtype = x.dtype
        self.same_dtype(1, 2, 3, *state_inputs)
        self.bias = self.optional_input(3, (nd, 2 * gates * hidden), "B")
        self.initial = [self._initial_state(i) for i in state_inputs]
        self.clip = ctx.attr("clip", None)
        if self.clip is not None:
            if not isinstance(self.clip, (int, float)) or not self.clip >= 0:
                raise ctx.invalid(f"clip={self.clip!r} must be a non-negative threshold")
            self.clip = float(self.clip)
        self.acts = self._activations(default_activations)
        self._zero = ctx.constant(np.zeros((), self.dtype))
        self._lens, self._lens_value = self._sequence_lens()
        self._masks: dict[int, Tensor | bool] = {}
        self._xw_all, self._recurrent_bias = self._project(recurrent_bias_block)

    # operands -------------------------------------------------------------------------------
    def same_dtype(self, *indices: int) -> None:
        """Check that inputs ``indices`` (those present) have X's dtype."""
        for i in indices:
            if self.ctx.has_input(i) and self.ctx.input(i).dtype != self.dtype:
                raise self.ctx.invalid(f"input {i} ({self.ctx.node.input[i]!r}) has dtype "
                                       f"{self.ctx.input(i).dtype}, X has {self.dtype}")

    def optional_input(self, i: int, shape: tuple[int, ...], what: str) -> Tensor | None:
        """Optional input ``i`` after checking that it has ``shape``."""
        if not self.ctx.has_input(i):
            return None
        t = self.ctx.input(i)
        if t.shape != shape:
            raise self.ctx.shape_error(f"{what} has shape {t.shape}, expected {shape}")
        return t

    def _initial_state(self, i: int) -> Tensor | None:
        """Optional initial state input ``i`` as ``[num_directions, batch, hidden]``."""
        what = self.ctx.node.input[i] if i < len(self.ctx.node.input) else f"input {i}"
        nd, b, h = self.nd, self.batch, self.hidden
        t = self.optional_input(i, (b, nd, h) if self.layout else (nd, b, h), f"initial state {what!r}")
        if t is not None and self.layout:
            t = self.op(Transpose, [t], f"initial{i}_direction_major", perm=(1, 0, 2))
        return t

    def _sequence_lens(self) -> tuple[Tensor | None, np.ndarray | None]:
        """The lengths as a ``[batch, 1]`` column (None when every sequence is full) and, when
        known at import, their values."""
        ctx = self.ctx
        if not ctx.has_input(4):
            return None, None
        lens = self.optional_input(4, (self.batch,), "sequence_lens")
        if lens.dtype not in ("int32", "int64"):
            raise ctx.invalid(f"sequence_lens must be int32, got {lens.dtype}")
        if lens.value is not None:
            value = np.asarray(lens.value).astype(np.int64)
            if value.size and (value.min() < 0 or value.max() > self.seq):
                raise ctx.invalid(f"sequence_lens {value.tolist()[:8]} must lie in [0, {self.seq}]")
            return (None, None) if np.all(value == self.seq) else (None, value)
        return self.op(Reshape, [lens], "lens_column", shape=(self.batch, 1)), None

    def _activations(self, defaults: tuple[str, ...]) -> list[list[_Act]]:
        """The activations of each direction, with their alpha/beta resolved."""
        ctx, n = self.ctx, len(defaults)
        names = list(ctx.attr("activations", []) or [])
        if not names:
            names = list(defaults) * self.nd
        elif len(names) == 2 * n and self.nd == 1:
            # onnxruntime's RNN takes the first direction's when given two directions' worth
            log.debug("%s: %d activations for one direction; using the first %d", ctx.name, len(names), n)
            names = names[:n]
        if len(names) != n * self.nd:
            raise ctx.invalid(f"activations {names} must list {n * self.nd} functions ({n} per direction)")
        alphas, betas = _floats_attr(ctx, "activation_alpha"), _floats_attr(ctx, "activation_beta")
        acts = []
        for name in names:
            kind = _ACTIVATION_KINDS.get(str(name).lower())
            if kind is None:
                raise ctx.unsupported(f"activation {name!r} (supported: {', '.join(_ACTIVATION_NAMES)})")
            alpha = alphas.pop(0) if kind.alpha and alphas else kind.default_alpha
            beta = betas.pop(0) if kind.beta and betas else kind.default_beta
            if (kind.alpha and alpha is None) or (kind.beta and beta is None):
                raise ctx.invalid(f"activation {name} needs values in activation_alpha and activation_beta")
            acts.append(_Act(str(name).lower(), alpha, beta))
        if alphas or betas:
            # a list meant position by position (one value per activation) would be misread: refuse
            raise ctx.invalid(f"activation_alpha/activation_beta have {len(alphas)}/{len(betas)} values left over; "
                              "they are consumed in order, one by each activation that takes the parameter")
        return [acts[d * n:(d + 1) * n] for d in range(self.nd)]

    def _project(self, recurrent_bias_block: int | None) -> tuple[Tensor, list[Tensor | None]]:
        """``X @ W^T`` plus the folded biases for every step and direction, ``[seq*batch, nd*G*H]``,
        and per direction the ``R`` bias kept inside the recurrence (or None)."""
        nd, gh, h = self.nd, self.gates * self.hidden, self.hidden
        x2 = self.op(Reshape, [self.x], "X_rows", shape=(self.seq * self.batch, self.x.shape[2]))
        w2 = self.op(Reshape, [self.ctx.input(1)], "W_rows", shape=(nd * gh, self.x.shape[2]))
        ins = [x2, w2]
        kept: list[Tensor | None] = [None] * nd
        if self.bias is not None:
            wb = self.op(Slice, [self.bias], "Wb", starts=(0, 0), steps=(1, 1), sizes=(nd, gh))
            rb = self.op(Slice, [self.bias], "Rb", starts=(0, gh), steps=(1, 1), sizes=(nd, gh))
            blk = recurrent_bias_block
            if blk is not None:
                kept = [self.vector(self.bias, d, self.gates + blk, f"d{d}/Rb{blk}") for d in range(nd)]
                fold = np.ones(gh, self.dtype)
                fold[blk * h:(blk + 1) * h] = 0
                rb = self.op(Binary, [rb, self.ctx.constant(fold)], "Rb_folded", fn="mul")
            both = self.op(Binary, [wb, rb], "bias", fn="add")
            ins.append(self.op(Reshape, [both], "bias_row", shape=(nd * gh,)))
        return self.op(Gemm, ins, "input_projection", trans_b=True), kept

    # building blocks for the step functions ------------------------------------------------------
    def op(self, cls, inputs: list[Tensor], tag: str, **attrs) -> Tensor:
        """Add ``cls(inputs, **attrs)`` named ``<node>/<tag>`` and return its output."""
        return self.ctx.add(cls(inputs, name=f"{self.ctx.name}/{tag}", **attrs))

    def binary(self, fn: str, a: Tensor, b: Tensor, tag: str) -> Tensor:
        """``fn(a, b)`` with broadcasting (``fn`` as in :class:`Binary`)."""
        return self.op(Binary, [a, b], tag, fn=fn)

    def scalar(self, v: float) -> Tensor:
        """A scalar constant of the node's dtype."""
        return self.ctx.constant(np.asarray(v, self.dtype))

    def columns(self, x: Tensor, block: int, count: int, tag: str) -> Tensor:
        """Gate blocks ``block .. block+count-1`` (each ``hidden`` wide) of a ``[batch, k*hidden]`` tensor."""
        h = self.hidden
        if block == 0 and x.shape[1] == count * h:
            return x
        return self.op(Slice, [x], tag, starts=(0, block * h), steps=(1, 1), sizes=(x.shape[0], count * h))

    def recurrent_weight(self, d: int, block: int = 0, count: int | None = None) -> Tensor:
        """Rows of ``R[d]`` for gate blocks ``block ..`` (all by default), as ``[count*hidden, hidden]``."""
        h = self.hidden
        count = self.gates - block if count is None else count
        rows = self.op(Slice, [self.ctx.input(2)], f"d{d}/R{block}_{count}_slice", starts=(d, block * h, 0),
                       steps=(1, 1, 1), sizes=(1, count * h, h))
        return self.op(Reshape, [rows], f"d{d}/R{block}_{count}", shape=(count * h, h))

    def recurrent_bias(self, d: int) -> Tensor | None:
        """The ``R`` bias of direction ``d`` kept inside the recurrence (``[hidden]``), or None."""
        return self._recurrent_bias[d]

    def vector(self, t: Tensor, d: int, block: int, tag: str) -> Tensor:
        """Block ``block`` (``hidden`` wide) of row ``d`` of a ``[num_directions, k*hidden]`` tensor,
        as ``[hidden]``."""
        h = self.hidden
        row = self.op(Slice, [t], f"{tag}_slice", starts=(d, block * h), steps=(1, 1), sizes=(1, h))
        return self.op(Reshape, [row], tag, shape=(h,))

    def matmul_add(self, a: Tensor, weight: Tensor, c: Tensor | None, tag: str) -> Tensor:
        """``a @ weight^T + c``."""
        return self.op(Gemm, [a, weight] + ([c] if c is not None else []), tag, trans_b=True)

    def gate(self, d: int, k: int, pre: Tensor, tag: str, clip: bool = True) -> Tensor:
        """Activation ``k`` of direction ``d`` applied to ``pre`` (after ``clip`` unless told not to)."""
        if clip and self.clip is not None:
            pre = self.op(Clip, [pre], f"{tag}_clip", lo=-self.clip, hi=self.clip)
        act = self.acts[d][k]
        if act.name == "tanh":
            return self.op(Unary, [pre], tag, fn="tanh")
        if act.name == "affine":
            scaled = self.binary("mul", pre, self.scalar(act.alpha), f"{tag}_scale")
            return self.binary("add", scaled, self.scalar(act.beta), tag)
        if act.name == "scaledtanh":
            inner = self.binary("mul", pre, self.scalar(act.beta), f"{tag}_inner")
            return self.binary("mul", self.op(Unary, [inner], f"{tag}_tanh", fn="tanh"), self.scalar(act.alpha), tag)
        kind = _ACTIVATION_KINDS[act.name]
        params = {p: v for p, v in (("alpha", act.alpha), ("beta", act.beta)) if v is not None}
        return self.op(Activation, [pre], tag, kind=kind.kind, **params)

    # masks --------------------------------------------------------------------------------------
    def _mask(self, t: int) -> Tensor | bool:
        """Which batch entries update at step ``t``: True (all), False (none) or a ``[batch, 1]`` bool tensor."""
        if t not in self._masks:
            if self._lens is not None:
                lens = self._lens
                self._masks[t] = self.binary("lt", self.ctx.constant(np.asarray(t, lens.dtype)), lens,
                                             f"valid_t{t}")
            elif self._lens_value is None:
                self._masks[t] = True
            else:
                self._masks[t] = self._constant_mask(t < self._lens_value)
        return self._masks[t]

    def _constant_mask(self, m: np.ndarray) -> Tensor | bool:
        """A per-batch-entry mask known at import: True, False or a ``[batch, 1]`` constant."""
        return bool(m.all()) if m.all() or not m.any() else self.ctx.constant(m.reshape(self.batch, 1))

    def _final_mask(self) -> Tensor | bool:
        """Which batch entries have a non-empty sequence (their final states are kept)."""
        if self._lens is not None:
            return self.binary("lt", self.ctx.constant(np.asarray(0, self._lens.dtype)), self._lens, "nonempty")
        return True if self._lens_value is None else self._constant_mask(self._lens_value > 0)

    def _select(self, mask: Tensor | bool, a: Tensor, b: Tensor, tag: str) -> Tensor:
        if mask is True:
            return a
        if mask is False:
            return b
        return self.op(Where, [mask, a, b], tag)

    # the loop and the outputs --------------------------------------------------------------------
    def run(self, make_step: StepFactory) -> list[Tensor | None]:
        """Unroll every direction with the step functions of ``make_step``; return ``[Y, Y_h(, Y_c)]``
        (None for the outputs the node does not ask for)."""
        nd, seq, b, h, gh = self.nd, self.seq, self.batch, self.hidden, self.gates * self.hidden
        zeros = self.ctx.constant(np.zeros((b, h), self.dtype))
        ys: list[list[Tensor]] = []
        finals: list[tuple] = []
        for d, rev in enumerate(self.reverse):
            step = make_step(self, d)
            state = tuple(zeros if t is None else self._direction_slice(t, d, f"d{d}/init{k}")
                          for k, t in enumerate(self.initial))
            y: list[Tensor] = [zeros] * seq
            for t in (range(seq - 1, -1, -1) if rev else range(seq)):
                mask = self._mask(t)
                if mask is False:
                    continue
                tag = f"d{d}/t{t}"
                xw = self.op(Slice, [self._xw_all], f"{tag}/xw", starts=(t * b, d * gh), steps=(1, 1),
                             sizes=(b, gh))
                new = step(tag, xw, state)
                state = tuple(self._select(mask, n, o, f"{tag}/keep{k}") for k, (n, o) in enumerate(zip(new, state)))
                y[t] = self._select(mask, new[0], self._zero, f"{tag}/y")
            ys.append(y)
            finals.append(state)
        log.debug("%s: unrolled %d step(s) x %d direction(s) into %d ops", self.ctx.name, seq, nd,
                  len(self.ctx.created))
        outputs: list[Tensor | None] = [self._sequence_output(ys) if self._wants(0) else None]
        keep = self._final_mask() if any(self._wants(k + 1) for k in range(len(self.initial))) else True
        for k in range(len(self.initial)):
            outputs.append(self._final_output(finals, k, keep) if self._wants(k + 1) else None)
        return outputs

    def _direction_slice(self, t: Tensor, d: int, tag: str) -> Tensor:
        """Direction ``d`` of a ``[num_directions, batch, hidden]`` tensor, as ``[batch, hidden]``."""
        b, h = self.batch, self.hidden
        part = self.op(Slice, [t], f"{tag}_slice", starts=(d, 0, 0), steps=(1, 1, 1), sizes=(1, b, h))
        return self.op(Reshape, [part], tag, shape=(b, h))

    def _wants(self, k: int) -> bool:
        return k < len(self.ctx.node.output) and bool(self.ctx.node.output[k])

    def _concat(self, parts: list[Tensor], axis: int, tag: str) -> Tensor:
        """Concatenate ``parts`` along ``axis``, as a tree of at most :data:`_CONCAT_FANOUT`-way Concats."""
        level = 0
        while len(parts) > 1:
            groups = [parts[i:i + _CONCAT_FANOUT] for i in range(0, len(parts), _CONCAT_FANOUT)]
            parts = [g[0] if len(g) == 1 else self.op(Concat, g, f"{tag}_{level}_{i}", axis=axis)
                     for i, g in enumerate(groups)]
            level += 1
        return parts[0]

    def _sequence_output(self, ys: list[list[Tensor]]) -> Tensor:
        """``Y``: ``[seq, num_directions, batch, hidden]`` (``[batch, seq, num_directions, hidden]`` for layout 1)."""
        seq, b, h = self.seq, self.batch, self.hidden
        per_dir = [self.op(Reshape, [self._concat(y, 0, f"d{d}/Y_steps")], f"d{d}/Y", shape=(seq, 1, b, h))
                   for d, y in enumerate(ys)]
        y = self._concat(per_dir, 1, "Y_directions")
        return self.op(Transpose, [y], "Y_batch_major", perm=(2, 0, 1, 3)) if self.layout else y

    def _final_output(self, finals: list[tuple], k: int, keep: Tensor | bool) -> Tensor:
        """``Y_h`` (k=0) or ``Y_c`` (k=1): ``[num_directions, batch, hidden]`` (batch first for layout 1)."""
        b, h = self.batch, self.hidden
        parts = []
        for d, state in enumerate(finals):
            s = self._select(keep, state[k], self._zero, f"d{d}/final{k}_masked")
            parts.append(self.op(Reshape, [s], f"d{d}/final{k}", shape=(1, b, h)))
        out = self._concat(parts, 0, f"final{k}")
        return self.op(Transpose, [out], f"final{k}_batch_major", perm=(1, 0, 2)) if self.layout else out


# the three cells -------------------------------------------------------------------------------------

@onnx_op("RNN")
def rnn(ctx):
    """Simple RNN: ``H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb)``."""
    rec = _Recurrence(ctx, 1, ("Tanh",), state_inputs=(5,))

    def make_step(rec: _Recurrence, d: int):
        r = rec.recurrent_weight(d)

        def step(tag, xw, state):
            return (rec.gate(d, 0, rec.matmul_add(state[0], r, xw, f"{tag}/pre"), f"{tag}/h"),)
        return step

    return rec.run(make_step)


@onnx_op("GRU")
def gru(ctx):
    """GRU with gates ``z, r, h`` (``linear_before_reset`` from opset 3)."""
    lbr = ctx.flag("linear_before_reset", 0) if ctx.opset >= 3 else False
    rec = _Recurrence(ctx, 3, ("Sigmoid", "Tanh"), state_inputs=(5,), recurrent_bias_block=2 if lbr else None)

    def make_step(rec: _Recurrence, d: int):
        r_zr, r_h = rec.recurrent_weight(d, 0, 2), rec.recurrent_weight(d, 2, 1)
        rb_h = rec.recurrent_bias(d)

        def step(tag, xw, state):
            (h_prev,) = state
            zr = rec.matmul_add(h_prev, r_zr, rec.columns(xw, 0, 2, f"{tag}/xw_zr"), f"{tag}/zr_pre")
            z = rec.gate(d, 0, rec.columns(zr, 0, 1, f"{tag}/z_pre"), f"{tag}/z")
            r = rec.gate(d, 0, rec.columns(zr, 1, 1, f"{tag}/r_pre"), f"{tag}/r")
            xw_h = rec.columns(xw, 2, 1, f"{tag}/xw_h")
            if lbr:
                hr = rec.matmul_add(h_prev, r_h, rb_h, f"{tag}/hr")
                pre = rec.binary("add", xw_h, rec.binary("mul", r, hr, f"{tag}/r_hr"), f"{tag}/h_pre")
            else:
                pre = rec.matmul_add(rec.binary("mul", r, h_prev, f"{tag}/r_h"), r_h, xw_h, f"{tag}/h_pre")
            cand = rec.gate(d, 1, pre, f"{tag}/h_cand")
            # (1 - z) * cand + z * h_prev
            delta = rec.binary("mul", z, rec.binary("sub", h_prev, cand, f"{tag}/h_diff"), f"{tag}/h_delta")
            return (rec.binary("add", cand, delta, f"{tag}/h"),)
        return step

    return rec.run(make_step)


@onnx_op("LSTM")
def lstm(ctx):
    """LSTM with gates ``i, o, f, c``, optional peepholes ``P`` and ``input_forget``."""
    input_forget = ctx.flag("input_forget", 0)
    rec = _Recurrence(ctx, 4, ("Sigmoid", "Tanh", "Tanh"), state_inputs=(5, 6))
    rec.same_dtype(7)
    peep = rec.optional_input(7, (rec.nd, 3 * rec.hidden), "P")

    def make_step(rec: _Recurrence, d: int):
        r = rec.recurrent_weight(d)
        p_i, p_o, p_f = ([rec.vector(peep, d, k, f"d{d}/P{g}") for k, g in enumerate("iof")]
                         if peep is not None else (None, None, None))

        def peephole(pre, p, c, tag):
            return pre if p is None else rec.binary("add", pre, rec.binary("mul", p, c, f"{tag}_peep"), tag)

        def step(tag, xw, state):
            h_prev, c_prev = state
            gates = rec.matmul_add(h_prev, r, xw, f"{tag}/gates")
            i = rec.gate(d, 0, peephole(rec.columns(gates, 0, 1, f"{tag}/i_lin"), p_i, c_prev, f"{tag}/i_pre"),
                         f"{tag}/i")
            if input_forget:
                f = rec.binary("sub", rec.scalar(1.0), i, f"{tag}/f")
            else:
                f = rec.gate(d, 0, peephole(rec.columns(gates, 2, 1, f"{tag}/f_lin"), p_f, c_prev, f"{tag}/f_pre"),
                             f"{tag}/f")
            cand = rec.gate(d, 1, rec.columns(gates, 3, 1, f"{tag}/c_pre"), f"{tag}/c_cand")
            c = rec.binary("add", rec.binary("mul", f, c_prev, f"{tag}/c_keep"),
                           rec.binary("mul", i, cand, f"{tag}/c_new"), f"{tag}/c")
            o = rec.gate(d, 0, peephole(rec.columns(gates, 1, 1, f"{tag}/o_lin"), p_o, c, f"{tag}/o_pre"),
                         f"{tag}/o")
            h = rec.binary("mul", o, rec.gate(d, 2, c, f"{tag}/c_act", clip=False), f"{tag}/h")
            return h, c
        return step

    return rec.run(make_step)
