"""Naming the field of a protobuf message that does not parse.

When a gRPC request's bytes are not a valid message (a field sent with the wrong wire
type, a string that is not UTF-8), the protobuf runtime only says "error parsing". The
gRPC server then walks the raw wire format against the message descriptor to tell the
client which field is wrong, so a malformed request gets INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

_F = FieldDescriptor
_EXPECTED = {
    **dict.fromkeys((_F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64,
                     _F.TYPE_SINT32, _F.TYPE_SINT64, _F.TYPE_BOOL, _F.TYPE_ENUM), _VARINT),
    **dict.fromkeys((_F.TYPE_DOUBLE, _F.TYPE_FIXED64, _F.TYPE_SFIXED64), _I64),
    **dict.fromkeys((_F.TYPE_FLOAT, _F.TYPE_FIXED32, _F.TYPE_SFIXED32), _I32),
    **dict.fromkeys((_F.TYPE_STRING, _F.TYPE_BYTES, _F.TYPE_MESSAGE), _LEN),
}
_TYPE_NAMES = {v: k.lower().removeprefix("type_") for k, v in vars(_F).items()
               if k.startswith("TYPE_") and isinstance(v, int)}


class _Truncated(Exception):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Truncated
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _skip(buf: bytes, pos: int, wire: int) -> tuple[int, bytes | None]:
    """New position after a value of `wire` type, and the payload for length-delimited."""
    if wire == _VARINT:
        return _varint(buf, pos)[1], None
    if wire == _I64:
        end = pos + 8
    elif wire == _I32:
        end = pos + 4
    elif wire == _LEN:
        n, pos = _varint(buf, pos)
        end = pos + n
    else:
        raise _Truncated
    if end > len(buf):
        raise _Truncated
    return end, (buf[pos:end] if wire == _LEN else None)


def find_malformed(raw: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """A message naming the first bad field of `raw`, or None when none is found."""
    pos = 0
    try:
        while pos < len(raw):
            tag, pos = _varint(raw, pos)
            number, wire = tag >> 3, tag & 7
            field = descriptor.fields_by_number.get(number)
            new_pos, payload = _skip(raw, pos, wire)
            pos = new_pos
            if field is None:
                continue  # unknown fields are allowed (newer clients)
            name = prefix + field.name
            expected = _EXPECTED.get(field.type)
            packed = wire == _LEN and field.is_repeated and expected != _LEN
            if wire != expected and not packed:
                return (f"{name} has the wrong type: expected {_TYPE_NAMES[field.type]} "
                        f"(field {number})")
            if field.type == _F.TYPE_STRING and payload is not None:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"{name} is not valid UTF-8 (byte {e.start})"
            if field.type == _F.TYPE_MESSAGE and payload is not None:
                inner = find_malformed(payload, field.message_type, name + ".")
                if inner is not None:
                    return inner
    except _Truncated:
        return f"{prefix.rstrip('.') or 'request'}: truncated or corrupt protobuf data"
    return None
