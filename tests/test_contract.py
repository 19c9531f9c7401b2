"""The Python<->Lua contract (qosd/store/contract.py) holds on both sides.

Positions and codes are declared once; these tests fail when a side drifts from the
declaration: a Lua name nobody declared, a hand-counted ARGV offset or a bare status
code, a stale generated file, or an ARGV list redis.py sends that the declaration
does not describe. (That the Reason enum matches the wire's is
tests/test_daemon.py::test_domain_enums_match_the_wire; here, that the scripts' codes
are the domain enums'.)
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from qosd.config import Config, RedisConfig
from qosd.model import (
    LeaseSpec,
    Outcome,
    PrefillLearned,
    Reason,
    Sample,
    ServerLoad,
    UsageReport,
    Waiter,
    WaiterState,
    new_lease_token,
)
from qosd.policy import resolve_pools
from qosd.store import contract
from qosd.store.redis import POOL_PRELUDE, POOL_SCRIPTS, SCRIPTS, RedisStore
from qosd_harness import RedisServer
from tests.conftest import BASE_CONFIG, merge

ROOT = Path(__file__).resolve().parent.parent
LUA = resources.files("qosd.store").joinpath("lua")
DECLARED = {name: literal for name, literal, _ in contract.lua_constants()}
# Names Redis gives every script.
REDIS_GLOBALS = {"ARGV", "KEYS"}


def prelude() -> str:
    """The pool prelude's files, in the order the loader prepends them."""
    pool = LUA.joinpath("pool")
    return "".join(pool.joinpath(f"{part}.lua").read_text("utf-8") for part in POOL_PRELUDE)


def own_sources(script: str) -> str:
    """A script as written (the prelude first for a pool script), without the
    constants the loader prepends."""
    source = LUA.joinpath(f"{script}.lua").read_text("utf-8")
    if script in POOL_SCRIPTS:
        source = prelude() + source
    return source


def code_only(source: str) -> str:
    """Lua without its comments and string literals (which name commands, formats and
    fields, not constants)."""
    source = re.sub(r"'[^'\n]*'", "''", source)
    return re.sub(r"--[^\n]*", "", source)


def upper_names(source: str) -> set[str]:
    return set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", code_only(source)))


def local_names(source: str) -> set[str]:
    names: set[str] = set()
    for declared in re.findall(r"\blocal\s+([A-Za-z_][\w\s,]*?)\s*=", code_only(source)):
        names.update(name.strip() for name in declared.split(","))
    return names


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_constant_a_script_names_is_declared(script: str) -> None:
    source = own_sources(script)
    own = local_names(source)
    undeclared = upper_names(source) - own - REDIS_GLOBALS - DECLARED.keys()
    assert not undeclared, f"{script}.lua names undeclared constants: {sorted(undeclared)}"
    assert not own & DECLARED.keys(), f"{script}.lua shadows contract constants"


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_hand_counted_positions_or_bare_codes(script: str) -> None:
    """ARGV and replies are indexed by declared positions, and statuses, reasons and
    settlement states are named."""
    code = code_only(LUA.joinpath(f"{script}.lua").read_text("utf-8"))
    if script in POOL_SCRIPTS:
        code += code_only(prelude())
    counted = re.findall(r"\b(?:ARGV|reply|late)\[(?:[^\]]*[+-]\s*)?\d+\s*\]", code)
    assert not counted, f"{script}.lua counts positions by hand: {counted}"
    bare = re.findall(r"\banswer\(\s*(?:\d|'')|\bstatus = \d", code)
    assert not bare, f"{script}.lua answers with bare codes: {bare}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_read_the_layouts_declared_for_them(script: str) -> None:
    """A script reads positions only of its own ARGV layouts, and steps over each
    repeated one by that layout's declared size: what redis.py packs per class, per
    request or per waiter is what the script consumes."""
    declared = contract.SCRIPT_ARGS[script]
    layouts = {entry.rstrip("*") for entry in declared} - {"CALLS"}
    names = upper_names(own_sources(script))
    positions = {
        contract.LAYOUT_BY_NAME[name].position_name(field): name
        for name in contract.LAYOUT_BY_NAME
        if contract.LAYOUT_BY_NAME[name].kind == "ARG"
        for field in contract.LAYOUT_BY_NAME[name].fields
    }
    read = {positions[name] for name in names if name in positions}
    assert read <= layouts, f"{script}.lua reads layouts not declared for it"
    for entry in declared:
        if entry.endswith("*"):
            size_name = contract.LAYOUT_BY_NAME[entry[:-1]].size_name
            assert size_name in names, f"{script}.lua does not step by {size_name}"
    assert ("ARG_CALLS" in names) == ("CALLS" in declared) or script in {"status", "adjust"}


def test_generated_lua_and_docs_are_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_lua_contract.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_codes_are_the_domain_enums() -> None:
    """Reply statuses and reasons are the values the Python side reads them as."""
    for member in Reason:
        assert DECLARED[f"REASON_{member.name}"] == str(member.value)
    for state in WaiterState:
        assert int(contract.Status[state.name]) == int(state)  # a pump reports waiter states
    assert len(set(contract.Status)) == len(contract.Status.__members__)  # no aliases


def test_the_control_hash_is_read_in_reply_order() -> None:
    """ControlReply's fields from ``pinned`` on are CONTROL_HASH's, in that order, and
    adjust.lua writes exactly those fields."""
    adjust = LUA.joinpath("adjust.lua").read_text("utf-8")
    hset = re.search(r"redis\.call\('HSET', control_key, (.*?)\)\n", adjust, re.S)
    assert hset is not None
    written = re.findall(r"'(\w)', ", hset.group(1))
    assert written == [field.key for field in contract.CONTROL_HASH]


def test_the_state_fields_read_are_declared() -> None:
    """The fields the prelude reads from the state hash are the ones the docs show."""
    state = LUA.joinpath("pool").joinpath("state.lua").read_text("utf-8")
    read = re.search(r"local fields = \{('u'.*?)\}", state, re.S)
    assert read is not None
    fixed = re.findall(r"'([^']+)'", read.group(1))
    names = re.search(r"local names = \{(.*?)\}", state)
    assert names is not None
    per_class = re.findall(r"'(\w):' \.\. name", names.group(1))
    # Read when needed rather than with the state: a fair class's virtual time.
    tenants = LUA.joinpath("pool").joinpath("tenants.lua").read_text("utf-8")
    per_class += re.findall(r"HGET', STATE, '(\w):' \.\. c\.name", tenants)
    declared = [field.key for field in contract.STATE_HASH]
    assert [("x:<second>" if key == "x:" else key) for key in fixed] == [
        key for key in declared if ":<class>" not in key
    ]
    assert sorted(f"{key}:<class>" for key in set(per_class)) == sorted(
        key for key in declared if key.endswith(":<class>")
    )


# -- what redis.py sends ---------------------------------------------------------------


def split_argv(script: str, args: Sequence[Any]) -> list[tuple[str, tuple[Any, ...]]]:
    """An ARGV list cut into the records contract.SCRIPT_ARGS says it holds; fails
    unless they cover it exactly."""
    records: list[tuple[str, tuple[Any, ...]]] = []
    at = 0
    calls: int | None = None
    classes = 0
    for entry in contract.SCRIPT_ARGS[script]:
        if entry == "CALLS":
            calls, at = int(args[contract.ARG_CALLS - 1]), contract.ARG_CALLS
            continue
        name = entry.rstrip("*")
        layout = contract.LAYOUT_BY_NAME[name]
        width = 1 if name in contract.PACKED else len(layout.fields)
        count = 1
        if entry.endswith("*"):
            count = classes if name == "CLASS" else calls if calls is not None else -1
            if count < 0:  # the rest of ARGV
                assert (len(args) - at) % width == 0, f"{script}: a partial {name}"
                count = (len(args) - at) // width
        for _ in range(count):
            if name in contract.PACKED:  # one argument: the record's fields, joined
                record = contract.unpack(layout.shape, args[at])
                assert len(record) == len(layout.fields), f"{script}: a short {name}"
                records.append((name, record))
                at += 1
                continue
            records.append((name, contract.record(layout.shape, args, at)))
            at += width
        if name == "POOL":
            classes = int(records[-1][1].class_count)  # type: ignore[attr-defined]
    assert at == len(args), f"{script}: sent {len(args)} arguments, declared {at}"
    return records


@pytest.fixture
async def recording_store(
    redis_standalone: RedisServer,
) -> AsyncIterator[tuple[RedisStore, list[tuple[str, list[Any]]]]]:
    config = RedisConfig(url=redis_standalone.url, key_prefix=f"c{uuid.uuid4().hex[:12]}")
    store = RedisStore(config, tombstone_ms=60_000, daemon_id="d1")
    by_sha = {script.sha: name for name, script in store._scripts.items()}
    calls: list[tuple[str, list[Any]]] = []
    run = store._run

    async def recorded(script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        calls.append((by_sha[script.sha], list(args)))
        return await run(script, keys, args)

    store._run = recorded  # type: ignore[method-assign]
    await store.start()
    yield store, calls
    await store.close()


async def test_every_argv_redis_py_sends_is_the_declared_one(
    recording_store: tuple[RedisStore, list[tuple[str, list[Any]]]],
) -> None:
    """Every script call, as sent, cut by the declaration: sizes add up exactly, and
    the class names land where CLASS and the per-call layouts say."""
    store, calls = recording_store
    pool = resolve_pools(Config.model_validate(BASE_CONFIG))["default"]
    cls = pool.classes[0]

    def spec() -> LeaseSpec:
        return LeaseSpec(f"default:{cls.name}:{new_lease_token()}", "", "", 100, 20, 1.0, 60_000)

    first = await store.acquire(pool, cls, spec(), 0)
    # A batch: three at once, while the first of them is in flight.
    await asyncio.gather(*(store.acquire(pool, cls, spec(), 0) for _ in range(3)))
    await store.release(pool, cls, first.lease_id, UsageReport(100, 20, Outcome.OK))
    undone = spec()
    assert (await store.acquire(pool, cls, undone, 0)).admitted
    await store.undo(pool, cls, undone)
    stranger = Waiter(cls.name, 100.0, spec())
    await store.pump(pool, [stranger])
    await store.cancel(pool, [stranger])
    await store.status(pool)
    record = await store.control(pool)
    await store.adjust(pool, record, cooldown_ms=0, force=True)
    await store.lead(1_000)
    await store.set_prefill(pool, PrefillLearned((5.0, 0.01, 1e-6), 300.0, 1_000.0))
    await store.report_load(pool, [ServerLoad("s1", 3, 0.5), ServerLoad("s2", None, None)])
    sample = Sample("default", cls.name, "", 10.0, 2.0, 50.0, 100, 20, Outcome.OK)
    await store.report([sample, sample], window_size=10)
    fair = {"classes": {"P1": {"fairness": "vtc"}}}
    fair_pool = resolve_pools(Config.model_validate(merge(BASE_CONFIG, fair)))["default"]
    await store.tenants(fair_pool, ["a", "b"])

    assert {name for name, _ in calls} == set(SCRIPTS)
    names = {c.name for c in pool.classes}
    for script, args in calls:
        records = split_argv(script, args)
        for layout, values in records:
            if layout == "CLASS":
                assert values.name in names  # type: ignore[attr-defined]
            if "qos_class" in contract.LAYOUT_BY_NAME[layout].fields:
                assert values.qos_class in names  # type: ignore[attr-defined]
