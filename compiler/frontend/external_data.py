"""Weights stored outside the .onnx file (ONNX external data), mapped rather than read.

A model above protobuf's 2 GB limit keeps its initializers in side files: each such initializer
names a ``location`` (relative to the model's folder), an ``offset`` and a ``length``. onnx's own
loader reads every byte into the protobuf, and decoding the initializers then copies them again:
twice the model in memory before the compiler has done anything. :func:`resolve_external_data`
instead checks each entry (inside the model's folder, within its file, as long as its type and
shape say) and records the file's absolute path, and :func:`initializer_array` maps the bytes
read-only (``numpy.memmap``): pages are read when a pass or a rank's slice touches them, and a
rank that keeps a quarter of a table reads a quarter of it. Small tensors (below
:data:`MAP_BYTES`) are read into ordinary arrays; types without a fixed byte size per element
(4-bit, strings) are loaded into the protobuf as onnx does.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor

from ..errors import ModelFormatError
from ..ir.expr import numpy_type
from .registry import _DTYPES

__all__ = ["resolve_external_data", "initializer_array", "MAP_BYTES"]

#: initializers of at least this many bytes are memory-mapped; smaller ones are read
MAP_BYTES = 1 << 16


def _entries(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def resolve_external_data(proto: onnx.ModelProto, model_dir: str, where: str) -> None:
    """Check every external initializer of ``proto``'s main graph against its file in
    ``model_dir`` and record the file's absolute path as its ``location`` (in place).

    Raises
    ------
    ModelFormatError
        naming the initializer and the file, when the location leaves the model's folder, the file
        is missing, or the byte range does not fit the file or the tensor's type and shape.
    """
    root = os.path.realpath(model_dir)
    for t in _nested_tensors(proto.graph):  # (subgraphs' and attributes' tensors: read, as onnx does)
        if t.data_location == onnx.TensorProto.EXTERNAL:
            _check_location(t, root, where)
            _load(t, root, where)
    files: dict[str, tuple[str, int]] = {}  # location -> (checked path, size): most tensors share one file
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        loc = _entries(t).get("location", "")
        if loc not in files:
            path = _check_location(t, root, where)
            files[loc] = path, os.path.getsize(path)
        path, size = files[loc]
        if t.data_type not in _DTYPES:  # (no fixed bytes per element: onnx's loader reads it)
            _load(t, root, where)
            continue
        info = _entries(t)
        want = int(np.prod(t.dims, dtype=np.int64)) * numpy_type(_DTYPES[t.data_type]).itemsize
        try:
            offset = int(info.get("offset", 0))
            length = int(info.get("length", want))
        except ValueError:
            raise ModelFormatError(f"{where}: initializer {t.name!r}: offset {info.get('offset')!r} or length "
                                   f"{info.get('length')!r} is not an integer") from None
        if length != want or offset < 0 or offset + length > size:
            raise ModelFormatError(f"{where}: initializer {t.name!r} ({onnx.TensorProto.DataType.Name(t.data_type)} "
                                   f"{list(t.dims)}, {want} bytes) reads bytes [{offset}, {offset + length}) of "
                                   f"{path} ({size} bytes); the model and its data file do not match")
        for e in t.external_data:
            if e.key == "location":
                e.value = path


def _check_location(t: onnx.TensorProto, root: str, where: str) -> str:
    """The absolute path of ``t``'s external data file, which must lie inside ``root``."""
    loc = _entries(t).get("location", "")
    path = os.path.realpath(os.path.join(root, loc))
    if not loc or os.path.isabs(loc) or os.path.commonpath([root, path]) != root:
        link = " (a symbolic link to a file outside it, which onnx refuses too: copy the file beside the model)" \
            if loc and os.path.islink(os.path.join(root, loc)) else ""
        raise ModelFormatError(f"{where}: tensor {t.name!r} stores its data at {loc!r}, which is not a "
                               f"file inside the model's folder {root}{link}")
    if not os.path.isfile(path):
        raise ModelFormatError(f"{where}: tensor {t.name!r}: its external data file {path} is missing; "
                               "copy it beside the model")
    return path


def _load(t: onnx.TensorProto, root: str, where: str) -> None:
    """Read ``t``'s external bytes into the protobuf (onnx's loader)."""
    try:
        load_external_data_for_tensor(t, root)
    except Exception as exc:
        raise ModelFormatError(f"{where}: tensor {t.name!r}: external data cannot be loaded ({exc})") from None
    t.data_location = onnx.TensorProto.DEFAULT
    del t.external_data[:]


def _nested_tensors(g: onnx.GraphProto, top: bool = True):
    """The tensors of ``g`` other than its own initializers (when ``top``): attribute tensors
    and everything in subgraphs."""
    if not top:
        yield from g.initializer
    for node in g.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("g"):
                yield from _nested_tensors(a.g, False)
            for sub in a.graphs:
                yield from _nested_tensors(sub, False)


def initializer_array(t: onnx.TensorProto) -> np.ndarray:
    """The value of initializer ``t``: mapped from its file (read-only) when it is external data
    that :func:`resolve_external_data` checked, else decoded by onnx."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    info = _entries(t)
    path = info["location"]
    if not os.path.isabs(path):
        raise ModelFormatError(f"initializer {t.name!r} has external data at {path!r} whose folder is unknown; "
                               "load the model from its file path")
    dtype = numpy_type(_DTYPES[t.data_type])
    shape = tuple(int(d) for d in t.dims)
    offset = int(info.get("offset", 0))
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize < MAP_BYTES:
        with open(path, "rb") as f:
            f.seek(offset)
            return np.frombuffer(f.read(count * dtype.itemsize), dtype=dtype).reshape(shape).copy()
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
