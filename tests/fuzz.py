"""Random and extreme protobuf messages, built from their descriptors, for the fuzz test
(tests/test_faults.py): every field of every depth gets values from a pool of edge
cases (zero, negatives, the type's extremes, NaN and infinities, empty, huge and
non-ASCII strings, names the daemon knows) or plain random ones."""

from __future__ import annotations

import math
import random
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_INT32 = (0, 1, -1, 2**31 - 1, -(2**31), 7, 1_000, 100_000)
_INT64 = (*_INT32, 2**63 - 1, -(2**63), 2**53 + 1)
_UINT32 = (0, 1, 2**32 - 1, 2**31, 64)
_UINT64 = (*_UINT32, 2**64 - 1, 2**63)
_FLOATS = (0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, 5e-324, 0.5, 250.0)
_STRINGS = (
    "", " ", "P0", "P1", "P2", "default", "llama-3-8b", "default:P1:0", "default:P1:open-1",
    "a" * 300, "x" * 70_000, "\x00", "é٥🙂", " 5", "1_000", "-1", "NaN", ":", "::", "{default}",
    "tokens", "qos_class", "tenant",
)  # fmt: skip
_INTEGER_TYPES = {
    FieldDescriptor.TYPE_INT32: _INT32,
    FieldDescriptor.TYPE_SINT32: _INT32,
    FieldDescriptor.TYPE_SFIXED32: _INT32,
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT32: _UINT32,
    FieldDescriptor.TYPE_FIXED32: _UINT32,
    FieldDescriptor.TYPE_UINT64: _UINT64,
    FieldDescriptor.TYPE_FIXED64: _UINT64,
}


def random_message(cls: type[Message], rng: random.Random, depth: int = 0) -> Message:
    message = cls()
    fill(message, rng, depth)
    return message


def fill(message: Message, rng: random.Random, depth: int) -> None:
    fields = _fields(message)
    for field in fields:
        if rng.random() < 0.3:
            continue  # left unset
        if field.is_repeated:
            count = rng.choice((0, 1, 2, 3, 40)) if depth < 3 else 0
            container = getattr(message, field.name)
            for _ in range(count):
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    if _is_map(field):
                        continue  # maps are rare in these messages; left empty
                    fill(container.add(), rng, depth + 1)
                else:
                    container.append(scalar(field, rng))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 3:
                fill(getattr(message, field.name), rng, depth + 1)
        else:
            setattr(message, field.name, scalar(field, rng))


def _fields(message: Message) -> list[FieldDescriptor]:
    """The message's fields (typed once: the stubs name two descriptor classes)."""
    descriptor: Any = message.DESCRIPTOR
    return list(descriptor.fields)


def _is_map(field: FieldDescriptor) -> bool:
    message_type = field.message_type
    return message_type is not None and bool(message_type.GetOptions().map_entry)


def scalar(field: FieldDescriptor, rng: random.Random) -> Any:
    kind = field.type
    if kind in _INTEGER_TYPES:
        edges = _INTEGER_TYPES[kind]
        if rng.random() < 0.7:
            return rng.choice(edges)
        low, high = min(edges), max(edges)
        return rng.randint(max(low, -(10**6)), min(high, 10**6))
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
    if kind == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: 99 is a valid wire value
        assert field.enum_type is not None
        return rng.choice([*(value.number for value in field.enum_type.values), 99])
    if kind == FieldDescriptor.TYPE_STRING:
        return rng.choice(_STRINGS)
    if kind == FieldDescriptor.TYPE_BYTES:
        return rng.choice((b"", b"\x00\xff", bytes(rng.randrange(256) for _ in range(16))))
    raise AssertionError(f"unhandled field type {kind} of {field.full_name}")


def mutated(template: Message, rng: random.Random) -> Message:
    """A copy of a valid message with one to three fields (at any depth) set to edge
    or random values: most of it passes validation, so the calls reach the store."""
    message = type(template)()
    message.CopyFrom(template)
    for _ in range(rng.randint(1, 3)):
        target = message
        for _depth in range(3):  # walk into a set sub-message now and then
            fields = _fields(target)
            nested = [
                f for f in fields
                if f.type == FieldDescriptor.TYPE_MESSAGE and not f.is_repeated
                and target.HasField(f.name)
            ]  # fmt: skip
            if not nested or rng.random() < 0.5:
                break
            target = getattr(target, rng.choice(nested).name)
        field = rng.choice(_fields(target))
        target.ClearField(field.name)
        if field.is_repeated:
            continue  # emptied
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            fill(getattr(target, field.name), rng, 2)
        else:
            setattr(target, field.name, scalar(field, rng))
    return message
