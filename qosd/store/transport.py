"""The seam under the script store: where a command runs.

``qosd.store.redis.RedisStore`` keeps every rule in the Lua scripts and sends them,
with a few plain commands, through a transport: to the Redis node that owns a key
(``qosd.store.redis_client``: standalone, Cluster or Sentinel, over redis-py), or
into this process (``InProcessTransport``: a ``LuaHost``, the embedded store). The
store cannot tell them apart: replies come as a Redis client reads them (str, int,
None, lists), errors as the same exceptions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import redis.exceptions as redis_errors

from qosd.store.lua_host import LuaError, LuaHost, NoScript


def monotonic_us() -> int:
    """The embedded store's TIME: one process, so its monotonic clock."""
    return time.monotonic_ns() // 1000


class Transport(Protocol):
    async def execute(self, route_key: str, *args: Any, script_source: str | None = None) -> Any:
        """Runs one command on the node that owns ``route_key``. With
        ``script_source``, an EVALSHA that finds the script missing loads it and runs
        again."""
        ...

    async def execute_on_primaries(self, *args: Any) -> list[Any]:
        """Runs one command on every primary (SCRIPT LOAD, PING); their replies."""
        ...

    async def close(self) -> None: ...


class InProcessTransport:
    """Redis in this process: what the embedded store runs its scripts on.

    Calls run to their end when awaited, without yielding, so each is atomic on the
    event loop. ``clock_us`` is Redis's TIME (the monotonic clock by default); tests
    pass their own to move time by hand."""

    def __init__(self, clock_us: Callable[[], int]) -> None:
        self.host = LuaHost(clock_us)

    async def execute(self, route_key: str, *args: Any, script_source: str | None = None) -> Any:
        return self.run(*args, script_source=script_source)

    async def execute_on_primaries(self, *args: Any) -> list[Any]:
        return [self.run(*args)]

    async def close(self) -> None:
        return None

    def run(self, *args: Any, script_source: str | None = None) -> Any:
        """One command, synchronously; errors as redis-py raises them."""
        name = str(args[0]).upper()
        try:
            if name == "EVALSHA":
                count = int(args[2])
                keys, argv = args[3 : 3 + count], args[3 + count :]
                try:
                    return self.host.evalsha(str(args[1]), keys, argv)
                except NoScript:
                    if script_source is None:
                        raise
                    self.host.load(script_source)
                    return self.host.evalsha(str(args[1]), keys, argv)
            if name == "SCRIPT" and str(args[1]).upper() == "LOAD":
                return self.host.load(str(args[2]))
            return self.host.call(name, *args[1:])
        except NoScript as exc:
            raise redis_errors.NoScriptError(str(exc)) from None
        except LuaError as exc:
            raise redis_errors.ResponseError(str(exc)) from None
