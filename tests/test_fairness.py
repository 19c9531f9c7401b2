"""Fair shares by tokens within a class (``fairness: vtc``, qosd/store/lua/pool/tenants.lua).

Each tenant of a class that shares by tokens has a counter: the tokens it has been
charged per unit of weight. A request starts at the larger of its tenant's counter and
the class's virtual time (where the backlogged tenants stand), and the class's
waiters go by that start, so the backlogged tenant served least goes first, a tenant
back from idle banks no credit, and counters of idle tenants expire.

The rules run on the embedded store with a clock the test moves; the paper's bound and
what status shows also run on a standalone Redis and a 3-node cluster, and the order
across tenants through daemons on all three.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from qosd.config import Config
from qosd.model import (
    LeaseSpec,
    Outcome,
    TenantStatus,
    UsageReport,
    Waiter,
    WaiterState,
    new_lease_token,
)
from qosd.policy import PoolPolicy, class_in, lease_token, resolve_pools
from qosd.store.base import BucketStore
from qosd.store.embedded import EmbeddedStore
from qosd.store.redis import RedisStore
from qosd_client import QosdClient
from tests.clock import Clock
from tests.conftest import BASE_CONFIG, Backend, DaemonFactory, merge
from tests.test_fleet_control import run_cli
from tests.test_reload import started, write_config
from tests.waiting import eventually

DAEMON = "daemon-a"


def one_slot(fairness: str = "vtc", **fair: Any) -> dict[str, Any]:
    """A pool that runs one request at a time; P1's tenants share it by ``fairness``."""
    return {
        "pools": {"default": {"max_in_flight": 1, "top_reserve": 0}},
        "classes": {"P1": {"fairness": fairness, "max_wait_ms": 600_000, "max_queue": 10_000}},
        "fairness": fair,
        "control": {"enabled": False},
    }


@pytest.fixture
async def redis_store(backend: Backend) -> AsyncIterator[BucketStore | None]:
    """The backend's Redis as a store, for a Room; None for the embedded backend."""
    if backend.redis is None:
        yield None
        return
    config = Config.model_validate(merge(BASE_CONFIG, {"redis": backend.redis}))
    store = RedisStore(config.redis, tombstone_ms=1_000, stale_after_ms=600_000, daemon_id=DAEMON)
    await store.start()
    yield store
    await store.close()


class Room:
    """One pool on the embedded store and one daemon's waiters in it."""

    def __init__(self, extra: dict[str, Any], store: BucketStore | None = None) -> None:
        """``store``: a Redis store to run on; by default the embedded store, on a clock
        the test moves (``clock``)."""
        self.clock = Clock()
        self.config = Config.model_validate(merge(BASE_CONFIG, extra))
        self.store: BucketStore = store or EmbeddedStore(
            clock=self.clock, tombstone_ms=1_000, stale_after_ms=600_000, daemon_id=DAEMON
        )
        self.pool: PoolPolicy = resolve_pools(self.config)["default"]
        self.waiters: list[Waiter] = []
        self.tenant_of: dict[str, str] = {}

    def spec(self, tenant: str, tokens: int) -> LeaseSpec:
        token = lease_token(class_in(self.pool, "P1"), tenant)
        return LeaseSpec(f"default:P1:{token}", "", tenant, tokens, 0, 1.0, 60_000)

    async def hold(self) -> LeaseSpec:
        """Takes the one slot with a P2 request."""
        spec = LeaseSpec(f"default:P2:{new_lease_token()}", "", "", 10, 0, 1.0, 60_000)
        decision = await self.store.acquire(self.pool, class_in(self.pool, "P2"), spec, 0)
        assert decision.admitted
        return spec

    async def request(self, tenant: str, tokens: int) -> bool:
        """A P1 request, 1 ms after the last; True if admitted at once, else it waits."""
        self.clock.advance(1)
        spec = self.spec(tenant, tokens)
        decision = await self.store.acquire(self.pool, class_in(self.pool, "P1"), spec, 600_000)
        if decision.queued:
            self.waiters.append(Waiter("P1", float(tokens), spec))
            self.tenant_of[spec.lease_id] = tenant
        return decision.admitted

    async def admit(self, tenant: str, tokens: int) -> LeaseSpec:
        """A P1 request admitted at once (the slot is free); its lease."""
        spec = self.spec(tenant, tokens)
        p1 = class_in(self.pool, "P1")
        assert (await self.store.acquire(self.pool, p1, spec, 0)).admitted
        return spec

    async def release(self, spec: LeaseSpec, output_tokens: int = 0, *, undo: bool = False) -> None:
        """Settles a lease with its prompt and ``output_tokens``; ``undo``: the admission
        is undone, its caller gone."""
        cls = class_in(self.pool, spec.lease_id.split(":")[1])
        if undo:
            await self.store.undo(self.pool, cls, spec)
        else:
            usage = UsageReport(spec.input_tokens, output_tokens, Outcome.OK)
            await self.store.release(self.pool, cls, spec.lease_id, usage)

    async def serve_in_turn(self, holder: LeaseSpec) -> list[LeaseSpec]:
        """Frees the slot, lets the next waiter in, and so on until none waits: the
        waiters in the order they were admitted."""
        served = []
        while self.waiters:
            await self.release(holder)
            results = await self.store.pump(self.pool, self.waiters)
            admitted = [w for w, r in zip(self.waiters, results, strict=True)
                        if r.state is WaiterState.ADMITTED]  # fmt: skip
            assert len(admitted) == 1
            holder = admitted[0].lease
            served.append(holder)
            self.waiters.remove(admitted[0])
        return served

    def tenants(self, served: list[LeaseSpec]) -> list[str]:
        return [self.tenant_of[spec.lease_id] for spec in served]

    async def tenant(self, name: str) -> TenantStatus:
        """The tenant as status shows it, in P1."""
        (status,) = await self.store.tenants(self.pool, [name])
        assert status.qos_class == "P1" and status.tenant == name
        return status


@pytest.mark.fast
@pytest.mark.parametrize("fairness", ["vtc", "fifo"])
async def test_a_tenant_that_floods_the_class_does_not_go_first(fairness: str) -> None:
    """Six requests of one tenant queue, then two of another. First come, first
    served, the second tenant waits for all six; by tokens, its two go among the
    first four."""
    room = Room(one_slot(fairness))
    holder = await room.hold()
    for _ in range(6):
        assert not await room.request("heavy", 100)
    for _ in range(2):
        assert not await room.request("light", 100)
    order = room.tenants(await room.serve_in_turn(holder))
    if fairness == "fifo":
        assert order == ["heavy"] * 6 + ["light"] * 2
    else:
        assert sorted(order[:4]) == ["heavy", "heavy", "light", "light"]


async def test_backlogged_tenants_service_differs_by_at_most_the_paper_s_bound(
    redis_store: BucketStore | None,
) -> None:
    """Two tenants backlogged, one with 400-token prompts and one with 100-token ones:
    at every admission while both wait, the tokens served to each differ by at most
    twice the largest request's charge (VTC's bound, Theorem 4.4 of the paper), and
    each tenant's turns follow its counter, not its arrival. On every store."""
    room = Room(one_slot(), redis_store)
    holder = await room.hold()
    sizes = {"large": 400, "small": 100}
    for _ in range(20):
        for tenant, tokens in sizes.items():
            assert not await room.request(tenant, tokens)
    served = await room.serve_in_turn(holder)
    bound = 2 * max(sizes.values())
    totals = dict.fromkeys(sizes, 0)
    left = dict.fromkeys(sizes, 20)
    differences = []
    for spec in served:
        tenant = room.tenant_of[spec.lease_id]
        totals[tenant] += spec.input_tokens
        left[tenant] -= 1
        if all(left.values()):  # both still backlogged
            differences.append(abs(totals["large"] - totals["small"]))
    assert differences and max(differences) <= bound
    # While both wait, the small tenant gets about four turns per turn of the large.
    first_ten = room.tenants(served[:10])
    assert 6 <= first_ten.count("small") <= 8


async def test_a_request_is_weighed_with_its_own_size(redis_store: BucketStore | None) -> None:
    """A tenant that sends little else sends one long prompt, queued first: its counter
    is the lowest, but its request would leave it served more than the backlogged
    tenant's next three, so those go first (by start tags alone it would go at once,
    the first moment there is room, whatever its size). On every store."""
    room = Room(one_slot(), redis_store)
    holder = await room.hold()
    assert not await room.request("long", 1_200)
    for _ in range(3):
        assert not await room.request("busy", 100)
    assert len(room.waiters) == 4
    order = room.tenants(await room.serve_in_turn(holder))
    assert order == ["busy", "busy", "busy", "long"]


@pytest.mark.fast
async def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    """One tenant has been served 1,000 tokens while another was idle. When the idle
    one comes back, it is lifted to where the backlogged tenant stands: its three
    requests take turns with the busy tenant's, rather than all going first as its
    counter of 0 would have them."""
    room = Room(one_slot())
    holder = await room.hold()
    for _ in range(10):
        assert not await room.request("busy", 100)
    served = await room.serve_in_turn(holder)
    for _ in range(4):
        assert not await room.request("busy", 100)
    for _ in range(3):
        assert not await room.request("back", 100)
    order = room.tenants(await room.serve_in_turn(served[-1]))
    assert order.count("back") == 3
    assert order[:2].count("back") == 1 and order[2:4].count("back") == 1


@pytest.mark.fast
async def test_weights_share_the_class_in_proportion() -> None:
    """A tenant of weight 3 gets three requests' turns per turn of one of weight 1."""
    room = Room(one_slot(tenant_weights={"gold": 3.0}))
    holder = await room.hold()
    for _ in range(12):
        for tenant in ("gold", "plain"):
            assert not await room.request(tenant, 100)
    order = room.tenants(await room.serve_in_turn(holder))
    assert order[:8].count("gold") == 6


@pytest.mark.fast
async def test_release_settles_the_counter_with_the_real_output() -> None:
    """Both tenants' first requests are charged their estimate (no output expected):
    50 tokens and 100. One turns out to produce 1,000 output tokens, charged at
    release (w_q 2). Its next three requests now start after the other tenant's
    request, where by the estimate alone the first of them would go first."""
    room = Room(one_slot())
    await room.release(await room.admit("talker", 50), output_tokens=1_000)
    await room.release(await room.admit("quiet", 100))
    holder = await room.hold()
    for _ in range(3):
        assert not await room.request("talker", 100)
    assert not await room.request("quiet", 100)
    order = room.tenants(await room.serve_in_turn(holder))
    assert order == ["quiet", "talker", "talker", "talker"]


@pytest.mark.fast
async def test_an_undone_admission_gives_its_tenant_the_charge_back() -> None:
    """An admission undone (its caller gone) refunds its tenant's counter in full: the
    tenant's next request goes before one of a tenant charged 500 since."""
    room = Room(one_slot())
    await room.release(await room.admit("gone", 1_000), undo=True)
    await room.release(await room.admit("other", 500))
    holder = await room.hold()
    assert not await room.request("other", 100)
    assert not await room.request("gone", 100)
    assert room.tenants(await room.serve_in_turn(holder)) == ["gone", "other"]


@pytest.mark.fast
async def test_a_waiter_that_leaves_unserved_gives_its_charge_back() -> None:
    """Queueing charged a waiter's tenant; the waiter timed out and was cancelled, so
    the tenant has it back: its next request goes before one of a tenant served 50
    tokens since."""
    room = Room(one_slot())
    holder = await room.hold()
    assert not await room.request("impatient", 100)
    await room.store.cancel(room.pool, room.waiters)
    room.waiters.clear()
    await room.release(holder)
    await room.release(await room.admit("other", 50))
    holder = await room.hold()
    assert not await room.request("other", 100)
    assert not await room.request("impatient", 100)
    assert room.tenants(await room.serve_in_turn(holder)) == ["impatient", "other"]


@pytest.mark.fast
async def test_a_tenant_with_later_waiters_keeps_the_charge_of_one_that_left() -> None:
    """A tenant's first of two waiters times out: its second was queued to start after
    it, so the counter stays where the second left it. Given back, the tenant's next
    request would start ahead of its own queued one, and a tenant whose flood mostly
    times out would send a request to the front with every new one."""
    room = Room(one_slot())
    await room.hold()
    for _ in range(2):
        assert not await room.request("flood", 100)
    assert (await room.tenant("flood")).counter == 200
    await room.store.cancel(room.pool, room.waiters[:1])
    assert (await room.tenant("flood")).counter == 200
    await room.store.cancel(room.pool, room.waiters[1:])  # now its last: given back
    assert (await room.tenant("flood")).counter == 100


async def test_status_shows_a_tenants_counter_tokens_served_and_waiters(
    redis_store: BucketStore | None,
) -> None:
    """Served tokens count admissions (prompt plus expected output) and follow the real
    usage at Release; the counter moves with every charge; waiters are the tenant's
    own, counted in the queue; a tenant never seen is idle. On every store."""
    room = Room(one_slot(), redis_store)
    first = await room.admit("a", 100)
    assert await room.tenant("a") == TenantStatus("P1", "a", 100.0, 100.0, 0)
    for _ in range(2):
        assert not await room.request("a", 40)  # the slot is taken: both wait
    assert not await room.request("b", 30)
    assert await room.tenant("a") == TenantStatus("P1", "a", 180.0, 100.0, 2)
    # b starts at the class's virtual time: the start of the last request admitted, 0
    assert await room.tenant("b") == TenantStatus("P1", "b", 30.0, 0.0, 1)
    assert await room.tenant("nobody") == TenantStatus("P1", "nobody", None, 0.0, 0)
    await room.release(first, output_tokens=25)  # w_q 2: the counter moves by 50
    results = await room.store.pump(room.pool, room.waiters)
    assert [r.state for r in results].count(WaiterState.ADMITTED) == 1
    assert await room.tenant("b") == TenantStatus("P1", "b", 30.0, 30.0, 0)
    assert await room.tenant("a") == TenantStatus("P1", "a", 230.0, 125.0, 2)
    if redis_store is None:  # the embedded store's clock is the test's
        room.clock.advance(600_000)  # fairness.idle_s after its last charge
        assert (await room.tenant("b")).counter is None


@pytest.mark.fast
async def test_status_names_tenants_only_in_classes_that_share_by_tokens() -> None:
    room = Room(one_slot("fifo"))
    assert await room.store.tenants(room.pool, ["a"]) == []


@pytest.mark.fast
async def test_counters_of_idle_tenants_expire() -> None:
    """2,000 tenants, one request each 1 ms apart, leave a counter each, which is gone
    ``fairness.idle_s`` after its charge."""
    room = Room({"classes": {"P1": {"fairness": "vtc"}}, "fairness": {"idle_s": 5}})
    assert isinstance(room.store, EmbeddedStore)
    host = room.store.transport.host

    def counters() -> set[str]:
        return {key for key in set(host.keys()) if ":vtc:P1:" in key}

    for tenant in range(2_000):
        assert await room.request(f"t{tenant}", 1)
    assert len(counters()) == 2_000
    room.clock.advance(2_500)  # the first charged 4.5 s ago, the last 2.5 s ago
    assert len(counters()) == 2_000
    room.clock.advance(3_000)
    assert not counters()


async def _queued(qos: QosdClient, count: int) -> None:
    async def read() -> int:
        return (await qos.status("default")).pool("default").cls("P1").waiting

    assert await eventually(read, lambda n: n == count) == count


async def flood(
    first: QosdClient,
    second: QosdClient,
    while_queued: Callable[[], Awaitable[None]] | None = None,
) -> list[str]:
    """Holds the one slot, queues six requests of one tenant on ``first`` and then two
    of another on ``second`` (then calls ``while_queued``), then frees the slot and
    each admitted lease in turn: the tenants in the order they were admitted."""
    holder = await first.acquire("P2", 10, max_wait_ms=0)
    assert holder.admitted
    waiting: dict[asyncio.Task[Any], str] = {}
    senders = itertools.chain([(first, "heavy")] * 6, [(second, "light")] * 2)
    for n, (qos, tenant) in enumerate(senders):
        task = asyncio.create_task(qos.acquire("P1", 100, tenant=tenant, max_wait_ms=60_000))
        waiting[task] = tenant
        await _queued(first, n + 1)
    if while_queued is not None:
        await while_queued()
    clients = {"heavy": first, "light": second}
    lease, releasing, order = holder.lease_id, first, []
    while waiting:
        await releasing.release(lease)
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        task = done.pop()
        tenant = waiting.pop(task)
        assert task.result().admitted
        order.append(tenant)
        lease, releasing = task.result().lease_id, clients[tenant]
    await releasing.release(lease)
    return order


async def test_daemons_share_the_class_by_tokens_on_every_store(
    backend: Backend, make_daemon: DaemonFactory
) -> None:
    """Through two daemons on one Redis (one daemon on the embedded store, which lives
    in its process): one tenant's six requests queue on the first, another's two on
    the second; the second tenant's two are among the first four admitted, fleet-wide."""
    first = await make_daemon(one_slot())
    second = first if backend.redis is None else await make_daemon(one_slot())

    async def shown_while_queued() -> None:
        """Each tenant's waiters, fleet-wide, and its counter: 100 a request queued."""
        status = await second.client.status("default", tenants=["heavy", "light", "idle"])
        p1 = status.pool("default").cls("P1")
        assert p1.fairness == "vtc"
        assert [(t.name, t.live, t.counter, t.waiting) for t in p1.tenants] == [
            ("heavy", True, 600.0, 6),
            ("light", True, 200.0, 2),
            ("idle", False, 0.0, 0),
        ]
        code, out, err = await run_cli("status", "-a", first.address, "--tenant", "heavy")
        assert code == 0, err
        assert re.search(r"heavy\s+1\s+600\s+0\s+6$", out, re.MULTILINE), out

    order = await flood(first.client, second.client, shown_while_queued)
    assert sorted(order[:4]) == ["heavy", "heavy", "light", "light"]
    status = await first.client.status("default", tenants=["light"])
    assert status.pool("default").cls("P1").tenant("light").served_tokens == 200


async def test_fairness_is_live_through_reload(tmp_path: Path) -> None:
    """A class turned from fifo to vtc by a reload shares by tokens from the next call."""
    path = tmp_path / "qosd.yaml"
    daemon, reloader = await started(path, one_slot("fifo"))
    client = QosdClient(daemon.addresses[0])
    try:
        assert await flood(client, client) == ["heavy"] * 6 + ["light"] * 2
        write_config(path, one_slot("vtc"))
        plan = await reloader.reload("test")
        assert plan is not None and "classes.P1.fairness" in plan.live
        order = await flood(client, client)
        assert sorted(order[:4]) == ["heavy", "heavy", "light", "light"]
    finally:
        await client.close()
        await daemon.stop(0)
