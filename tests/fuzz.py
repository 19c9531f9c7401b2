"""Hypothesis strategies for protobuf messages, built from their descriptors, for the
fuzz test (tests/test_faults.py).

Two kinds of message: ``messages(cls)`` fills any subset of the fields, at any depth,
with edge cases (zero, negatives, the type's extremes, NaN and infinities, empty, huge
and non-ASCII strings, names the daemon knows) or arbitrary values; ``mutations(valid)``
takes a valid request and replaces one to three of its fields, so that most of it
passes validation and the call reaches the store.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_INT32 = (0, 1, -1, 2**31 - 1, -(2**31), 7, 1_000, 100_000)
_INT64 = (*_INT32, 2**63 - 1, -(2**63), 2**53 + 1)
_UINT32 = (0, 1, 2**32 - 1, 2**31, 64)
_UINT64 = (*_UINT32, 2**64 - 1, 2**63)
_STRINGS = (
    "", " ", "P0", "P1", "P2", "default", "llama-3-8b", "default:P1:0", "default:P1:open-1",
    "a" * 300, "x" * 70_000, "\x00", "é٥🙂", " 5", "1_000", "-1", "NaN", ":", "::", "{default}",
    "tokens", "qos_class", "tenant",
)  # fmt: skip
_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1, _INT32),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1, _INT32),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1, _INT32),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1, _INT64),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1, _INT64),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1, _INT64),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1, _UINT32),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1, _UINT32),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1, _UINT64),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1, _UINT64),
}
MAX_DEPTH = 3


def messages(cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``cls`` with any subset of their fields set."""
    fields = {
        field.name: st.none() | _values(field, depth)
        for field in _fields(cls)
        if not _is_map(field)
    }
    return st.fixed_dictionaries(fields).map(lambda chosen: _build(cls, chosen))


def mutations(valid: Message) -> st.SearchStrategy[Message]:
    """``valid`` with one to three of its fields cleared or set to other values."""
    cls = type(valid)
    names = [field.name for field in _fields(cls) if not _is_map(field)]
    by_name = {field.name: field for field in _fields(cls)}

    def mutate(chosen: list[str]) -> st.SearchStrategy[Message]:
        replacements = {name: st.none() | _values(by_name[name], 1) for name in chosen}
        return st.fixed_dictionaries(replacements).map(lambda values: _replaced(valid, values))

    return st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True).flatmap(mutate)


def _replaced(valid: Message, values: dict[str, Any]) -> Message:
    message = type(valid)()
    message.CopyFrom(valid)
    for name in values:
        message.ClearField(name)
    _assign(message, values)
    return message


def _build(cls: type[Message], values: dict[str, Any]) -> Message:
    message = cls()
    _assign(message, values)
    return message


def _assign(message: Message, values: dict[str, Any]) -> None:
    by_name = {field.name: field for field in _fields(type(message))}
    for name, value in values.items():
        if value is None:
            continue  # left unset
        field = by_name[name]
        if field.is_repeated:
            container = getattr(message, name)
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    container.add().CopyFrom(item)
            else:
                container.extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)


def _values(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if depth >= MAX_DEPTH:
            return st.none()
        assert field.message_type is not None
        single: st.SearchStrategy[Any] = messages(
            message_factory.GetMessageClass(field.message_type), depth + 1
        )
    else:
        single = _scalars(field)
    if field.is_repeated:
        return st.lists(single, max_size=3 if depth < MAX_DEPTH else 0)
    return single


def _scalars(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _RANGES:
        low, high, edges = _RANGES[kind]
        return st.sampled_from(edges) | st.integers(low, high)
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: 99 is a valid wire value
        assert field.enum_type is not None
        return st.sampled_from([*(value.number for value in field.enum_type.values), 99])
    if kind == FieldDescriptor.TYPE_STRING:
        return st.sampled_from(_STRINGS) | st.text(max_size=40)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    raise AssertionError(f"unhandled field type {kind} of {field.full_name}")


def _fields(cls: type[Message]) -> list[FieldDescriptor]:
    """The message's fields (typed once: the stubs name two descriptor classes)."""
    descriptor: Any = cls.DESCRIPTOR
    return list(descriptor.fields)


def _is_map(field: FieldDescriptor) -> bool:
    message_type = field.message_type
    return message_type is not None and bool(message_type.GetOptions().map_entry)
