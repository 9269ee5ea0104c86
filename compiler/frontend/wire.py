"""An .onnx file's weights left in the file: its initializers' bytes located in the protobuf wire
format and mapped like external data.

Parsing a 650 MB model copies every weight into protobuf's memory, which it frees only with the
whole message; decoding them into arrays copies them again, so an import held the weights twice.
:func:`split_weights` walks the file's wire format instead (``ModelProto.graph`` = field 7,
``GraphProto.initializer`` = field 5, ``TensorProto.raw_data`` = field 9) and returns the model's
bytes without the large ``raw_data`` fields, plus where each one lies in the file. The importer
parses that small message and marks those initializers as external data in the .onnx file itself,
so :func:`~.external_data.initializer_array` maps them read-only as it maps side files.

Anything unexpected in the wire format (a group, a truncated field, an initializer without a
name) makes :func:`split_weights` return ``None``: the caller then parses the file whole, as
before. The checks that matter for correctness are the external-data ones (type, shape, bounds).
"""
from __future__ import annotations

__all__ = ["split_weights", "SPLIT_BYTES"]

#: raw_data fields of at least this many bytes are left in the file
SPLIT_BYTES = 1 << 16

_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_NAME, _TENSOR_RAW_DATA = 7, 5, 8, 9


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fields(buf, start: int, end: int):
    """``(field number, wire type, field start, value start, value end)`` of each field of the
    message in ``buf[start:end]``."""
    pos = start
    while pos < end:
        first = pos
        key, pos = _varint(buf, pos, end)
        number, kind = key >> 3, key & 7
        if kind == 0:
            _, pos = _varint(buf, pos, end)
            yield number, kind, first, pos, pos
            continue
        if kind == 1:
            size = 8
        elif kind == 5:
            size = 4
        elif kind == 2:
            size, pos = _varint(buf, pos, end)
        else:  # (groups)
            raise ValueError(f"wire type {kind}")
        if pos + size > end:
            raise ValueError("truncated field")
        yield number, kind, first, pos, pos + size
        pos += size


def _tensor_without_data(buf, start: int, end: int) -> tuple[bytes, str, int, int] | None:
    """A TensorProto's bytes without its large ``raw_data``, its name and where the data lies;
    None when it keeps its data (small, or none in ``raw_data``)."""
    kept, name, data = [], None, None
    for number, kind, first, lo, hi in _fields(buf, start, end):
        if number == _TENSOR_RAW_DATA and kind == 2 and hi - lo >= SPLIT_BYTES:
            data = (lo, hi - lo)
            continue
        if number == _TENSOR_NAME and kind == 2:
            name = bytes(buf[lo:hi]).decode("utf-8")
        kept.append(bytes(buf[first:hi]))
    if data is None or not name:
        return None
    return b"".join(kept), name, data[0], data[1]


def split_weights(buf) -> tuple[bytes, dict[str, tuple[int, int]]] | None:
    """``(the model without its large raw_data fields, {initializer name: (offset, length)})`` of
    the serialized ModelProto ``buf`` (bytes or a memoryview of the mapped file), or None when
    nothing is worth leaving out or the wire format is not what this reads."""
    try:
        end = len(buf)
        out, where = [], {}
        for number, kind, first, lo, hi in _fields(buf, 0, end):
            if number != _MODEL_GRAPH or kind != 2:
                out.append(bytes(buf[first:hi]))
                continue
            graph = []
            for g_number, g_kind, g_first, g_lo, g_hi in _fields(buf, lo, hi):
                stripped = _tensor_without_data(buf, g_lo, g_hi) \
                    if g_number == _GRAPH_INITIALIZER and g_kind == 2 else None
                if stripped is None:
                    graph.append(bytes(buf[g_first:g_hi]))
                    continue
                body, name, offset, length = stripped
                if name in where:
                    return None  # (two initializers of one name: left to the checker)
                where[name] = (offset, length)
                graph.append(_encode_varint(_GRAPH_INITIALIZER << 3 | 2) + _encode_varint(len(body)) + body)
            body = b"".join(graph)
            out.append(_encode_varint(_MODEL_GRAPH << 3 | 2) + _encode_varint(len(body)) + body)
        return (b"".join(out), where) if where else None
    except (ValueError, UnicodeDecodeError):
        return None
