"""Handlers for ONNX's random ops: RandomUniform, RandomNormal, RandomUniformLike, RandomNormalLike,
Bernoulli and Multinomial (and a training-mode Dropout's mask, handlers_elementwise.py), all on
:class:`~shardflow.compiler.ops.random.Random` (values a function of the seed, the run and the
element's position; rfcs/0006, "Random numbers").

The seed attribute (a float in ONNX) is taken as an integer (its value when it is one, else its
bits). A node without one gets a seed of its own from its output's name (a compile is
reproducible and its kernels cached; two such nodes draw different values). Each run of the
program draws new values: the step the op reads is state the program keeps (0 on the first run).
A node in a subgraph that the import unrolls (a Loop's iterations) mixes its scope into the seed,
so the iterations draw different values.
"""
from __future__ import annotations

import hashlib
import struct

from ..ir.expr import dtype_kind
from ..ops.elementwise import Binary, Unary
from ..ops.random import Random, splitmix64_key
from ..ops.reduce import CumSum, Reduce
from .registry import NodeContext, onnx_dtype, onnx_op

#: the element types ONNX allows for these ops' outputs (Bernoulli's: any numeric type or bool)
_RANDOM_FLOATS = ("float16", "bfloat16", "float32", "float64")


def random_key(ctx: NodeContext) -> int:
    """The key of the node's draws (:func:`~shardflow.compiler.ops.random.splitmix64_key`): of its
    ``seed`` attribute, else of its output's name; mixed with the subgraph scope it is in."""
    if ctx.has_attr("seed"):
        seed = float(ctx.attr("seed"))
        n = int(seed) if seed.is_integer() else struct.unpack("<Q", struct.pack("<d", seed))[0]
    else:
        n = int.from_bytes(hashlib.blake2b(ctx.node.output[0].encode(), digest_size=8).digest(), "little")
    if ctx.scope:
        n ^= int.from_bytes(hashlib.blake2b(ctx.scope.encode(), digest_size=8).digest(), "little")
    return splitmix64_key(n)


def _dtype(ctx: NodeContext, default: str, allowed=_RANDOM_FLOATS) -> str:
    dt = onnx_dtype(ctx.attr("dtype"), f"node {ctx.name} attribute 'dtype'") if ctx.has_attr("dtype") else default
    if allowed is not None and dt not in allowed:
        raise ctx.invalid(f"dtype {dt} is not one of {list(allowed)}")
    return dt


def _draw(ctx: NodeContext, kind: str, shape, dtype: str, a: float, b: float):
    if any(d < 0 for d in shape):
        raise ctx.invalid(f"shape {list(shape)} has a negative dim")
    return [ctx.add(Random([ctx.rng_step()], name=ctx.name, kind=kind, shape=tuple(shape), dtype=dtype,
                           key=random_key(ctx), a=float(a), b=float(b)))]


@onnx_op("RandomUniform", since=1)
def random_uniform(ctx):
    shape = [int(d) for d in ctx.attr("shape")]
    return _draw(ctx, "uniform", shape, _dtype(ctx, "float32"), ctx.attr("low", 0.0), ctx.attr("high", 1.0))


@onnx_op("RandomNormal", since=1)
def random_normal(ctx):
    shape = [int(d) for d in ctx.attr("shape")]
    return _draw(ctx, "normal", shape, _dtype(ctx, "float32"), ctx.attr("mean", 0.0), ctx.attr("scale", 1.0))


@onnx_op("RandomUniformLike", since=1)
def random_uniform_like(ctx):
    x = ctx.input(0)
    return _draw(ctx, "uniform", x.shape, _dtype(ctx, x.dtype), ctx.attr("low", 0.0), ctx.attr("high", 1.0))


@onnx_op("RandomNormalLike", since=1)
def random_normal_like(ctx):
    x = ctx.input(0)
    return _draw(ctx, "normal", x.shape, _dtype(ctx, x.dtype), ctx.attr("mean", 0.0), ctx.attr("scale", 1.0))


@onnx_op("Bernoulli", since=15)
def bernoulli(ctx):
    p = ctx.input(0)
    if p.dtype not in _RANDOM_FLOATS:
        raise ctx.invalid(f"input must be a float tensor of probabilities, got {p.dtype}")
    dt = _dtype(ctx, p.dtype, allowed=None)
    if dt not in _RANDOM_FLOATS + ("bool",) and dtype_kind(dt) not in "iu":
        raise ctx.invalid(f"dtype {dt} is not a numeric type or bool")
    return [ctx.add(Random([ctx.rng_step(), p], name=ctx.name, kind="bernoulli", shape=p.shape, dtype=dt,
                           key=random_key(ctx)))]


@onnx_op("Multinomial", since=7)
def multinomial(ctx):
    """``sample_size`` classes drawn per row of unnormalized log-probabilities ``x[B, C]``: the
    weights ``exp(x - max)`` (the row's maximum taken out: the same distribution, no overflow),
    their cumulative sums, and a categorical draw on them (ops/random.py)."""
    x = ctx.input(0)
    if x.ndim != 2 or x.dtype not in _RANDOM_FLOATS:
        raise ctx.invalid(f"input must be float [batch_size, class_size], got {x.dtype}{list(x.shape)}")
    dt = _dtype(ctx, "int32", allowed=("int32", "int64"))
    n = int(ctx.attr("sample_size", 1))
    if n < 1 or x.shape[1] < 1:
        raise ctx.invalid(f"sample_size {n} and class_size {x.shape[1]} must be positive")
    top = ctx.add(Reduce([x], name=f"{ctx.name}/max", axes=(1,), keepdims=True, kind="max"))
    w = ctx.add(Unary([ctx.add(Binary([x, top], name=f"{ctx.name}/shifted", fn="sub"))], name=f"{ctx.name}/exp",
                      fn="exp"))
    cdf = ctx.add(CumSum([w], name=f"{ctx.name}/cdf", axis=1, exclusive=0, reverse=0))
    return [ctx.add(Random([ctx.rng_step(), cdf], name=ctx.name, kind="categorical", shape=(x.shape[0], n), dtype=dt,
                           key=random_key(ctx)))]
