"""Runs qosd's Lua scripts in process, as Redis runs them: the embedded store's engine.

The budget rules are written once, in the Lua scripts of ``lua/``. This host runs
those scripts on LuaJIT (Lua 5.1's language, the version Redis embeds; through lupa),
with ``KEYS``, ``ARGV`` and ``redis.call`` as Redis gives them. ``redis.call`` reaches a
keyspace written in Lua too (``embedded.lua``: the commands the scripts use, with
Redis 7's replies and errors), so a script never leaves Lua until it returns: a call
from Lua into Python costs as much as a few dozen lines of the script
(docs/design.md has the measurements behind both choices).

Values convert both ways by Redis's rules:

- a reply to ``redis.call``: integer → number, bulk string → string, nil → false,
  array → table, status → ``{ok = ...}``; an error reply raises a Lua error, which
  ends the script and comes back to the caller as the error;
- what a script returns: number → integer (truncated toward zero), string → bulk
  string, table → array up to its first nil, false or nil → nil, true → 1,
  ``{ok = s}`` → status, ``{err = s}`` → error.

Scripts are cached by their SHA-1, as ``SCRIPT LOAD`` and ``EVALSHA`` do; an unknown
SHA answers NOSCRIPT. One call runs to its end before the next starts: on one event
loop, with no await inside, a script is as atomic here as in Redis. Time is the
caller's clock (``clock_us``), read once before every call, so tests can move it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from lupa import luajit21 as lua

#: The most values that cross between Python and Lua as a call's arguments or a
#: reply's values. Past it they cross as one table: Lua's C stack holds about 8,000
#: values, and a Report of 4,000 samples, or a status read of a 20,000-sample window,
#: overflowed it (the call failed: a 500, and /metrics with it).
MAX_FLAT_VALUES = 1_000
#: Sets the time, drops what expired, runs a compiled script with its keys and
#: arguments (``args``, a table), and returns its reply flat: its kind ('value', 'ok',
#: 'err', 'array'; 'table' past MAX_FLAT_VALUES, then the table and its length), then
#: the values. One crossing each way.
_RUN = """
function(now_us, script, count, args)
  NOW_US = now_us
  expire_due()
  local keys, argv = {}, {}
  for i = 1, count do
    keys[i] = args[i]
  end
  for i = count + 1, #args do
    argv[i - count] = args[i]
  end
  KEYS, ARGV = keys, argv
  return __reply(script())
end
"""
#: _RUN with the arguments flat (up to MAX_FLAT_VALUES): no table made in Python.
_RUNNER = """
function(now_us, script, count, ...)
  return __run(now_us, script, count, {...})
end
"""
_REPLY = f"""
function(reply)
  if type(reply) ~= 'table' then
    return 'value', reply
  end
  if reply.err ~= nil then
    return 'err', reply.err
  end
  if reply.ok ~= nil then
    return 'ok', reply.ok
  end
  local n = 0
  while reply[n + 1] ~= nil do
    n = n + 1
  end
  if n > {MAX_FLAT_VALUES} then
    return 'table', reply, n
  end
  return 'array', unpack(reply, 1, n)
end
"""
_COMMAND = """
function(now_us, name, ...)
  NOW_US = now_us
  expire_due()
  return __reply(redis.call(name, ...))
end
"""


class LuaError(Exception):
    """An error reply, worded as Redis words it (``ERR ...``, ``WRONGTYPE ...``)."""


class NoScript(LuaError):
    """EVALSHA of a script this host has not loaded."""


def encode(value: Any) -> str:
    """An argument as Redis receives it: text (an int as its digits, a float as its
    shortest exact form)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float | bytes):
        raise LuaError("ERR arguments must be strings or numbers")
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return str(value) if isinstance(value, int) else repr(value)


class LuaHost:
    """One Lua state: the keyspace, and the scripts run on it."""

    def __init__(self, clock_us: Callable[[], int]) -> None:
        self._clock_us = clock_us
        self._lua = lua.LuaRuntime(unpack_returned_tuples=True, encoding="utf-8")
        source = resources.files("qosd.store").joinpath("embedded.lua").read_text("utf-8")
        self._lua.execute(source)
        self._globals = self._lua.globals()
        self._globals["__reply"] = self._lua.eval(_REPLY)
        self._run = self._globals["__run"] = self._lua.eval(_RUN)
        self._runner = self._lua.eval(_RUNNER)
        self._command = self._lua.eval(_COMMAND)
        self._scripts: dict[str, Any] = {}

    def load(self, source: str) -> str:
        """Compiles a script and caches it; returns its SHA-1, as SCRIPT LOAD does."""
        sha = hashlib.sha1(source.encode("utf-8")).hexdigest()
        if sha not in self._scripts:
            try:
                self._scripts[sha] = self._lua.eval(f"function()\n{source}\nend")
            except lua.LuaSyntaxError as exc:
                raise LuaError(f"ERR Error compiling script: {exc}") from None
        return sha

    def evalsha(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Runs a loaded script; its reply as a Redis client reads it (str, int, None,
        lists of them)."""
        script = self._scripts.get(sha.lower())
        if script is None:
            raise NoScript("NOSCRIPT No matching script. Please use EVAL.")
        # str and int first: most arguments are, and encoding them is their text.
        values = [
            a if type(a) is str else str(a) if type(a) is int else encode(a) for a in (*keys, *args)
        ]
        try:
            if len(values) > MAX_FLAT_VALUES:
                args = self._lua.table_from(values)
                return _reply(self._run(self._clock_us(), script, len(keys), args))
            return _reply(self._runner(self._clock_us(), script, len(keys), *values))
        except lua.LuaError as exc:
            raise LuaError(_message(exc)) from None

    def call(self, name: str, *args: Any) -> Any:
        """One command outside a script (HSET, LRANGE, PING ...), as a client sends it."""
        try:
            return _reply(self._command(self._clock_us(), name, *(encode(a) for a in args)))
        except lua.LuaError as exc:
            raise LuaError(_message(exc)) from None

    def keys(self) -> list[str]:
        """Every live key (tests; Redis's KEYS *)."""
        self._globals["NOW_US"] = self._clock_us()
        return [str(k) for k in self._globals["keys"]().values()]


def _message(exc: Exception) -> str:
    text = str(exc)
    # lupa prefixes a Lua runtime error with where it was raised.
    for prefix in ("ERR", "WRONGTYPE", "NOSCRIPT"):
        at = text.find(prefix)
        if at >= 0:
            return text[at:]
    return f"ERR Error running script: {text}"


def _value(value: Any) -> Any:
    """One Lua value as a Redis client reads it."""
    if value is None or value is False:
        return None
    if value is True:
        return 1
    if isinstance(value, float):
        return int(value)
    if isinstance(value, int | str):
        return value
    raise LuaError("ERR a script may return flat arrays only here")


def _reply(result: Any) -> Any:
    kind, *values = result if isinstance(result, tuple) else (result,)
    if kind == "err":
        raise LuaError(str(values[0]))
    if kind == "ok":
        return str(values[0])
    if kind == "array":
        # str and int as they are (most of a reply), the rest as _value reads them.
        return [v if type(v) is str or type(v) is int else _value(v) for v in values]
    if kind == "table":  # a long reply, as one table: read by index
        table, length = values
        return [_value(table[i]) for i in range(1, int(length) + 1)]
    return _value(values[0])
