"""Hot reload: which parts of a new configuration a running daemon takes at once, and
which wait for the next restart.

A reload (SIGHUP, or the config file replaced: a Kubernetes ConfigMap update swaps a
symlink under the mounted file) validates the new file completely before anything
changes. A file that does not load, or does not validate, changes nothing: the daemon
keeps the running configuration, logs the error naming the field, and counts it.

What a running daemon can take (``LIVE``): the classes and their rates, shares, SLOs
and waits; pools and the models they serve (added or changed); tenants' ceilings;
cost and limits; the SLO loop's settings; ``fail_mode``; the Envoy RLS mapping; the
waiting room's poll interval; the log level; and the trace sample ratio (when tracing
runs with a ratio). What it cannot (``RESTART``): addresses it listens on and their
TLS files, the store it talks to, leases' TTL and tombstones, the authorization
rules, how tracing exports, the stale-waiter bound, and whether Envoy RLS is served.
A removed class or pool also waits for a restart: leases and waiters of it may be in
flight, and their settlement needs its policy. Such changes are reported, field by
field, and the running values stay until then; everything else in the same file is
applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr, ValidationError

from qosd.config import Config, ConfigError, FileSignature, file_signature

log = logging.getLogger(__name__)

# Dotted paths (or their prefixes) that take effect only at a restart.
RESTART = (
    "server",
    "redis",
    "lease",
    "auth",
    "tracing",
    "waiting.stale_after_ms",
    "envoy_rls.enabled",
    "logging.format",
    "limits.max_message_bytes",  # the gRPC servers' options, set when they are made
)
# Inside RESTART sections, what a running daemon takes all the same: the sampler's
# ratio, when tracing runs with one (it cannot switch to or from the OTEL_* sampler).
LIVE_INSIDE_RESTART = ("tracing.sample_ratio",)


@dataclass(frozen=True)
class ReloadPlan:
    """What a new configuration changes in a running daemon.

    ``config`` is what the daemon runs from now on: the new file, with the fields that
    need a restart kept at their running values. ``live`` and ``restart`` name the
    changed fields (dotted paths) of each kind; an added class or pool is in ``live``
    as ``classes.<name>`` or ``pools.<name>``, and a removed one in ``restart``.
    """

    config: Config
    live: tuple[str, ...]
    restart: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return bool(self.live or self.restart)


Path = tuple[str, ...]


def plan_reload(running: Config, new: Config, *, sample_ratio_live: bool) -> ReloadPlan:
    """Splits the difference between ``running`` and ``new``; raises ConfigError when
    the new file, with its restart-only parts left as they run, does not validate (for
    example, shares that add up to more than 1 with a removed class kept).

    Paths are tuples of keys inside (a key may hold a dot: a resource attribute such
    as ``deployment.environment``), and dotted only to be shown."""
    old_tree, tree = running.model_dump(), new.model_dump()
    changed = sorted(_differences(dict(_flatten(old_tree)), dict(_flatten(tree))))
    ratio_live = (
        sample_ratio_live
        and running.tracing.sample_ratio is not None
        and new.tracing.sample_ratio is not None
    )
    restart = [
        path
        for path in changed
        if _under(path, _RESTART) and not (ratio_live and _under(path, _LIVE_INSIDE_RESTART))
    ]
    removed: list[Path] = [("classes", name) for name in running.classes if name not in new.classes]
    removed += [("pools", name) for name in running.pools if name not in new.pools]
    added: list[Path] = [("classes", name) for name in new.classes if name not in running.classes]
    added += [("pools", name) for name in new.pools if name not in running.pools]
    live = added + [
        path
        for path in changed
        if path not in restart and not _under(path, removed) and not _under(path, added)
    ]
    for path in restart:
        _copy_path(old_tree, tree, path)
    for name in running.classes:
        tree["classes"].setdefault(name, old_tree["classes"][name])
    for name in running.pools:
        tree["pools"].setdefault(name, old_tree["pools"][name])
    held = [_shown(path) for path in restart + removed]
    try:
        applied = Config.model_validate(tree)
    except ValidationError as exc:
        details = "; ".join(
            f"{'.'.join(str(p) for p in item['loc']) or '(top level)'}: "
            f"{item['msg'].removeprefix('Value error, ')}"
            for item in exc.errors()
        )
        raise ConfigError(
            f"with the changes that need a restart ({', '.join(held)}) left as "
            f"they run, the new config does not validate: {details}"
        ) from exc
    return ReloadPlan(applied, tuple(_shown(path) for path in live), tuple(held))


_RESTART: list[Path] = [tuple(prefix.split(".")) for prefix in RESTART]
_LIVE_INSIDE_RESTART: list[Path] = [tuple(prefix.split(".")) for prefix in LIVE_INSIDE_RESTART]


def _shown(path: Path) -> str:
    return ".".join(path)


def _under(path: Path, prefixes: list[Path]) -> bool:
    return any(path[: len(prefix)] == prefix for prefix in prefixes)


def _flatten(tree: Mapping[str, Any], prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, leaf value) of a config dump; a mapping's keys become path parts, lists
    and secrets are leaves (a secret compared by value, never shown)."""
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, path)
        else:
            yield path, value.get_secret_value() if isinstance(value, SecretStr) else value


def _differences(before: dict[Path, Any], after: dict[Path, Any]) -> set[Path]:
    return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}


def _copy_path(source: dict[str, Any], target: dict[str, Any], path: Path) -> None:
    """Sets ``target``'s value at ``path`` to ``source``'s (removing it where
    ``source`` has none)."""
    src: Any = source
    dst: Any = target
    for part in path[:-1]:
        src = src.get(part, {}) if isinstance(src, dict) else {}
        if not isinstance(dst.get(part), dict):
            dst[part] = {}
        dst = dst[part]
    last = path[-1]
    if isinstance(src, dict) and last in src:
        dst[last] = src[last]
    else:
        dst.pop(last, None)


class ConfigReloader:
    """Reloads on request (SIGHUP) and when the config file is replaced.

    The file is watched by its signature (device, inode, size, mtime, through
    symlinks), polled every ``poll_s``: a ConfigMap update, an editor's rename and an
    in-place write all change it. A partly written file fails validation and changes
    nothing; the write that completes it changes the signature again.
    """

    def __init__(
        self,
        load: Callable[[], Config],
        current: Callable[[], Config],
        apply: Callable[[ReloadPlan], None],
        *,
        path: str | None,
        sample_ratio_live: bool,
        on_result: Callable[[bool, ReloadPlan | None], None],
        poll_s: float = 1.0,
    ) -> None:
        self._load = load
        self._current = current
        self._apply = apply
        self._path = path
        self._sample_ratio_live = sample_ratio_live
        self._on_result = on_result
        self._poll_s = poll_s
        self._signature = self._read_signature()
        self._task: asyncio.Task[None] | None = None
        self._pending: asyncio.Task[None] | None = None
        self._again: str | None = None  # asked for during a reload
        self._stopped = False

    def start(self) -> None:
        if self._path is not None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        """No reload from now on (a SIGHUP during the drain must not start, say, an
        SLO loop against a store about to close), and none left running."""
        self._stopped = True
        for task in (self._task, self._pending):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def request(self, trigger: str) -> None:
        """Reloads soon (from a signal handler); during a reload, once more after it."""
        if self._stopped:
            log.info("config reload (%s) ignored: the daemon is stopping", trigger)
            return
        if self._pending is not None and not self._pending.done():
            self._again = trigger
            return
        self._pending = asyncio.get_running_loop().create_task(self._reloads(trigger))

    async def _reloads(self, trigger: str | None) -> None:
        while trigger is not None:
            self._again = None
            await self.reload(trigger)
            trigger = self._again

    async def reload(self, trigger: str) -> ReloadPlan | None:
        """Loads, validates and applies the config; returns the plan applied, or None
        when the new file was refused (the running config stays)."""
        self._signature = self._read_signature()
        source = self._path or "the environment"
        try:
            # A file read and a validation: quick, but not on the event loop's time.
            new = await asyncio.to_thread(self._load)
            plan = plan_reload(self._current(), new, sample_ratio_live=self._sample_ratio_live)
        except ConfigError as exc:
            log.error("config reload (%s) refused, the running config stays: %s", trigger, exc)
            self._on_result(False, None)
            return None
        except Exception:  # a bug: refused too, and said so, rather than a dead task
            log.exception("config reload (%s) failed, the running config stays", trigger)
            self._on_result(False, None)
            return None
        try:
            self._apply(plan)
        except Exception:
            log.exception("config reload (%s) failed while it was applied", trigger)
            self._on_result(False, None)
            return None
        if plan.live:
            log.info("config reloaded (%s) from %s: applied %s", trigger, source,
                     ", ".join(plan.live))  # fmt: skip
        elif not plan.restart:
            log.info("config reloaded (%s) from %s: nothing changed", trigger, source)
        if plan.restart:
            log.warning(
                "config reload (%s): %s changed; that takes a restart, and the running "
                "values stay until then", trigger, ", ".join(plan.restart),
            )  # fmt: skip
        self._on_result(True, plan)
        return plan

    def _read_signature(self) -> FileSignature | None:
        if self._path is None:
            return None
        try:
            return file_signature(self._path)
        except OSError:
            return None  # mid-swap, or gone: the next poll sees what comes

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            signature = self._read_signature()
            if signature is not None and signature != self._signature:
                self._signature = signature
                self.request("file changed")
