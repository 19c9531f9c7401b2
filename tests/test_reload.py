"""Hot reload: a new config file applies to new calls, keeps what is in flight, and a
bad one changes nothing (qosd.reload); SIGHUP and a ConfigMap-style symlink swap
trigger it in a real ``qosd serve``; replicas on different configs share one budget."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from qosd.config import Config, ConfigError, load_config
from qosd.model import LeaseSpec, new_lease_token
from qosd.policy import ClassPolicy, PoolPolicy, resolve_pools
from qosd.reload import ConfigReloader, plan_reload
from qosd.server import Daemon, start
from qosd.store.redis import RedisStore
from qosd_client import InvalidRequest, QosdClient, Reason
from qosd_harness import RedisServer, closed_port
from tests.conftest import BASE_CONFIG, merge
from tests.waiting import eventually


def config_of(extra: dict[str, Any]) -> Config:
    return Config.model_validate(merge(BASE_CONFIG, extra))


# -- the plan: what is live, what waits for a restart --------------------------------


@pytest.mark.fast
def test_live_changes_apply_and_restart_ones_keep_their_running_values() -> None:
    running = config_of({})
    new = config_of(
        {
            "classes": {"P1": {"share": 0.2, "max_wait_ms": 900}},
            "pools": {"default": {"capacity_tokens_s": 12_000}, "big": {"capacity_tokens_s": 1}},
            "server": {"listen": ["127.0.0.1:7777"], "drain_grace_s": 9},
            "redis": {"timeout_ms": 250},
            "logging": {"level": "DEBUG", "format": "json"},
        }
    )
    plan = plan_reload(running, new, sample_ratio_live=False)
    assert set(plan.live) >= {
        "classes.P1.share",
        "classes.P1.max_wait_ms",
        "pools.default.capacity_tokens_s",
        "pools.big",  # added: one entry, not one per setting
        "logging.level",
    }
    assert set(plan.restart) == {
        "server.listen",
        "server.drain_grace_s",
        "redis.timeout_ms",
        "logging.format",
    }
    applied = plan.config
    assert applied.classes["P1"].share == 0.2 and applied.pools["big"].capacity_tokens_s == 1
    assert applied.logging.level == "DEBUG"
    # What needs a restart runs as before.
    assert applied.server == running.server and applied.redis == running.redis
    assert applied.logging.format == running.logging.format


@pytest.mark.fast
def test_a_removed_class_or_pool_stays_until_a_restart() -> None:
    running = config_of({"pools": {"spare": {"capacity_tokens_s": 500}}})
    tree = merge(BASE_CONFIG, {"classes": {"P1": {"max_wait_ms": 900}}})
    del tree["classes"]["P2"]
    new = Config.model_validate(tree)
    plan = plan_reload(running, new, sample_ratio_live=False)
    assert set(plan.restart) == {"classes.P2", "pools.spare"}
    assert "classes.P1.max_wait_ms" in plan.live
    assert not any(path.startswith(("classes.P2.", "pools.spare.")) for path in plan.live)
    assert set(plan.config.classes) == {"P0", "P1", "P2"}  # P2's leases still settle
    assert "spare" in plan.config.pools


@pytest.mark.fast
def test_a_change_that_does_not_fit_the_running_parts_is_refused_naming_them() -> None:
    running = config_of({})
    tree = merge(BASE_CONFIG, {"classes": {"P0": {"share": 0.7}}})
    del tree["classes"]["P2"]  # 0.7 + 0.3 alone is fine, but P2 (0.1) stays until a restart
    with pytest.raises(ConfigError, match=r"classes\.P2.*shares add up to 1\.100"):
        plan_reload(running, Config.model_validate(tree), sample_ratio_live=False)


@pytest.mark.fast
def test_keys_that_hold_dots_are_keys_not_paths() -> None:
    """A resource attribute such as deployment.environment is one key: a change to it
    is one field (tracing: a restart), and the plan still validates."""
    running = config_of({"tracing": {"resource_attributes": {"deployment.environment": "dev"}}})
    new = config_of({"tracing": {"resource_attributes": {"deployment.environment": "prod"}},
                     "limits": {"max_message_bytes": 1_000_000}})  # fmt: skip
    plan = plan_reload(running, new, sample_ratio_live=False)
    assert plan.restart == (
        "limits.max_message_bytes",  # the gRPC servers' option, set when they were made
        "tracing.resource_attributes.deployment.environment",
    )
    assert plan.config.tracing.resource_attributes == {"deployment.environment": "dev"}


@pytest.mark.fast
async def test_no_reload_once_the_daemon_is_stopping() -> None:
    """A SIGHUP during the drain must not apply a config (it could start an SLO loop
    against a store about to close)."""
    loads: list[int] = []

    def load() -> Config:
        loads.append(1)
        return config_of({})

    reloader = ConfigReloader(
        load, lambda: config_of({}), lambda plan: None, path=None, sample_ratio_live=False,
        on_result=lambda applied, plan: None,
    )  # fmt: skip
    await reloader.stop()
    reloader.request("SIGHUP")
    await asyncio.sleep(0)  # a task it started would have run its first step by now
    assert loads == []


@pytest.mark.fast
def test_an_unchanged_file_changes_nothing() -> None:
    plan = plan_reload(config_of({}), config_of({}), sample_ratio_live=True)
    assert not plan.changed


@pytest.mark.fast
def test_the_sample_ratio_is_live_only_between_two_ratios() -> None:
    running = config_of({"tracing": {"sample_ratio": 0.5}})
    to_ratio = plan_reload(
        running, config_of({"tracing": {"sample_ratio": 0.1}}), sample_ratio_live=True
    )
    assert to_ratio.live == ("tracing.sample_ratio",) and not to_ratio.restart
    to_env = plan_reload(running, config_of({}), sample_ratio_live=True)  # OTEL_* sampler
    assert to_env.restart == ("tracing.sample_ratio",)


# -- in a running daemon -----------------------------------------------------------------


def write_config(path: Path, extra: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump(merge(BASE_CONFIG, extra)))
    os.replace(temporary, path)


async def started(path: Path, extra: dict[str, Any]) -> tuple[Daemon, ConfigReloader]:
    write_config(path, extra)
    daemon = await start(load_config(path))
    reloader = ConfigReloader(
        lambda: load_config(path),
        lambda: daemon.config,
        daemon.apply,
        path=None,  # reloaded by hand here; the watch has a test of its own
        sample_ratio_live=False,
        on_result=daemon.reload_result,
    )
    return daemon, reloader


def metric(daemon: Daemon, name: str) -> float:
    value = daemon.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


async def test_a_reload_applies_to_new_calls_and_keeps_waiters_and_leases(
    tmp_path: Path,
) -> None:
    path = tmp_path / "qosd.yaml"
    slow_p1 = {"classes": {"P1": {"burst_s": 10, "max_wait_ms": 20_000}}}
    daemon, reloader = await started(
        path, merge(slow_p1, {"pools": {"default": {"capacity_tokens_s": 1_000}}})
    )
    client = QosdClient(daemon.addresses[0])
    try:
        # P1 drained (300 tokens/s, burst 3,000): a lease out, and a waiter queued that
        # needs 8 s of refill at this rate.
        lease = await client.acquire("P1", 3_000, max_wait_ms=0)
        assert lease.admitted
        waiter = asyncio.create_task(client.acquire("P1", 2_500, max_wait_ms=20_000))
        await eventually(client.status, lambda s: s.pool("default").classes[1].waiting == 1)
        write_config(path, merge(slow_p1, {"pools": {"default": {"capacity_tokens_s": 20_000}}}))
        plan = await reloader.reload("test")
        assert plan is not None and plan.live == ("pools.default.capacity_tokens_s",)
        status = await client.status()
        assert status.pool("default").capacity_tokens_s == 20_000
        assert status.pool("default").classes[1].configured_rate_tokens_s == 6_000
        # The waiter was kept, and is admitted at the new rate (6,000 tokens/s).
        admitted = await asyncio.wait_for(waiter, 10)
        assert admitted.admitted and admitted.waited_s < 4
        # The lease from before the reload settles as usual.
        assert not (await client.release(lease.lease_id, input_tokens=3_000)).already_released
        assert metric(daemon, "qosd_config_reloads_total") == 1
        assert metric(daemon, "qosd_config_restart_required") == 0
    finally:
        await client.close()
        await daemon.stop(0)


async def test_a_bad_file_keeps_the_running_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "qosd.yaml"
    daemon, reloader = await started(path, {})
    client = QosdClient(daemon.addresses[0])
    try:
        before = metric(daemon, "qosd_config_last_reload_success_timestamp_seconds")
        write_config(path, {"classes": {"P1": {"share": -1}}})
        assert await reloader.reload("test") is None
        assert "classes.P1.share" in caplog.text and "running config stays" in caplog.text
        assert metric(daemon, "qosd_config_reload_failures_total") == 1
        assert metric(daemon, "qosd_config_last_reload_successful") == 0
        assert metric(daemon, "qosd_config_last_reload_success_timestamp_seconds") == before
        status = await client.status()
        assert status.pool("default").classes[1].configured_rate_tokens_s == 3_000
        assert (await client.acquire("P1", 10, max_wait_ms=0)).admitted
        path.write_text("classes: [not, a, mapping")  # not YAML at all
        assert await reloader.reload("test") is None
        assert metric(daemon, "qosd_config_reload_failures_total") == 2
    finally:
        await client.close()
        await daemon.stop(0)


async def test_a_restart_only_change_is_reported_and_not_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "qosd.yaml"
    daemon, reloader = await started(path, {})
    listening = list(daemon.addresses)
    try:
        with closed_port() as port:  # a listen address that only the plan compares
            write_config(path, {"server": {"listen": [f"127.0.0.1:{port}"]}, "fail_mode": "open"})
        plan = await reloader.reload("test")
        assert plan is not None and plan.restart == ("server.listen",)
        assert plan.live == ("fail_mode",)
        assert "server.listen changed; that takes a restart" in caplog.text
        assert metric(daemon, "qosd_config_restart_required") == 1
        assert daemon.config.server.listen == ["127.0.0.1:0"] and daemon.monitor.fail_open
        client = QosdClient(listening[0])  # still served where it was
        try:
            assert (await client.acquire("P0", 10, max_wait_ms=0)).admitted
        finally:
            await client.close()
    finally:
        await daemon.stop(0)


async def test_new_pools_and_models_are_served_after_a_reload(tmp_path: Path) -> None:
    path = tmp_path / "qosd.yaml"
    daemon, reloader = await started(path, {"default_pool": None})
    client = QosdClient(daemon.addresses[0])
    try:
        with pytest.raises(InvalidRequest, match="not served by any configured pool"):
            await client.acquire("P0", 10, model="mistral", max_wait_ms=0)
        small = {"capacity_tokens_s": 100, "models": ["mistral"]}
        write_config(path, {"default_pool": None, "pools": {"small": small}})
        assert await reloader.reload("test") is not None
        plan = daemon.config.pools["small"]
        assert plan.capacity_tokens_s == 100
        # P0 gets 60 tokens/s of the new pool, a burst of 30: one call of 30, not two.
        first = await client.acquire("P0", 30, model="mistral", max_wait_ms=0)
        second = await client.acquire("P0", 30, model="mistral", max_wait_ms=0)
        assert first.admitted and first.pool == "small"
        assert not second.admitted and second.reason is Reason.RATE_LIMITED
    finally:
        await client.close()
        await daemon.stop(0)


# -- qosd serve: SIGHUP and the file watch -------------------------------------------


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, str, Path, str]]:
    """``qosd serve`` on a ConfigMap-shaped volume: qosd.yaml -> ..data/qosd.yaml, and
    ..data -> a timestamped directory that an update replaces with a new one."""
    volume = tmp_path / "volume"
    volume.mkdir()
    first = volume / "..2026_12_01_00_00_00.1"
    first.mkdir()
    write_config(first / "qosd.yaml", HTTP)
    os.symlink(first.name, volume / "..data")
    os.symlink("..data/qosd.yaml", volume / "qosd.yaml")
    ready = tmp_path / "ready.json"
    log_path = tmp_path / "qosd.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "qosd.cli", "serve", "--config", str(volume / "qosd.yaml"),
             "--ready-file", str(ready), "--log-level", "INFO"],
            stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "qosd did not start"
            time.sleep(0.02)
        where = json.loads(ready.read_text())
        yield process, volume, where["addresses"][0], log_path, where["http"]
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


HTTP = {"server": {"http_listen": "127.0.0.1:0"}}


def swap_configmap(volume: Path, extra: dict[str, Any], generation: int) -> None:
    """What the kubelet does: a new directory, then ..data renamed onto it."""
    directory = volume / f"..2026_12_01_00_00_00.{generation}"
    directory.mkdir()
    write_config(directory / "qosd.yaml", merge(HTTP, extra))
    os.symlink(directory.name, volume / "..data_tmp")
    os.replace(volume / "..data_tmp", volume / "..data")


async def p1_rate(address: str) -> float:
    client = QosdClient(address)
    try:
        return (await client.status()).pool("default").classes[1].configured_rate_tokens_s
    finally:
        await client.close()


async def test_sighup_and_a_configmap_swap_reload_a_running_daemon(
    served: tuple[subprocess.Popen[bytes], Path, str, Path, str],
) -> None:
    process, volume, address, log_path, http = served
    assert await p1_rate(address) == 3_000
    # The kubelet's swap alone: the watch sees it (no signal).
    swap_configmap(volume, {"classes": {"P1": {"share": 0.2}}}, 2)
    await eventually(lambda: p1_rate(address), lambda rate: rate == 2_000, timeout_s=20)
    # A bad file, then SIGHUP: refused, named, and the daemon serves on.
    swap_configmap(volume, {"classes": {"P1": {"share": "lots"}}}, 3)
    await eventually(
        lambda: asyncio.to_thread(log_path.read_text),
        lambda text: "classes.P1.share" in text and "refused" in text,
        timeout_s=20,
    )
    os.kill(process.pid, signal.SIGHUP)
    await eventually(
        lambda: asyncio.to_thread(log_path.read_text),
        lambda text: text.count("refused, the running config stays") >= 2,
        timeout_s=20,
    )
    assert process.poll() is None  # SIGHUP no longer kills it
    assert await p1_rate(address) == 2_000
    # A good file in place (no swap) and SIGHUP: a new capacity, on /metrics too.
    bigger = {
        "classes": {"P1": {"share": 0.25}},
        "pools": {"default": {"capacity_tokens_s": 20_000}},
    }
    write_config(volume / "..data" / "qosd.yaml", merge(HTTP, bigger))
    os.kill(process.pid, signal.SIGHUP)
    await eventually(lambda: p1_rate(address), lambda rate: rate == 5_000, timeout_s=20)
    metrics = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    )
    assert 'qosd_pool_configured_capacity_tokens_per_second{pool="default"} 20000.0' in metrics
    assert "qosd_config_reloads_total 2.0" in metrics  # the swap, then this one
    assert "qosd_config_reload_failures_total 2.0" in metrics
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(process.wait, 30) == 0


# -- a rollout: replicas on different configs, one budget ---------------------------------


async def test_replicas_on_two_configs_share_one_budget_within_both(
    redis_standalone: RedisServer, tmp_path: Path
) -> None:
    """During a rollout each replica applies its own config to the calls it serves; the
    budget is one. Every refill is at the rate of the replica whose call made it, and
    the tokens are capped at its burst, so the pool admits no more than the higher
    config allows and, under demand on both, no less than the lower one does."""
    prefix = f"t{os.getpid()}{time.monotonic_ns()}"
    old = {"redis": {"url": redis_standalone.url, "key_prefix": prefix}}
    new = merge(old, {"pools": {"default": {"capacity_tokens_s": 20_000}}})
    daemons = [await start(config_of(old)), await start(config_of(new))]
    clients = [QosdClient(daemon.addresses[0]) for daemon in daemons]
    try:
        admitted = 0.0
        began = time.monotonic()
        seconds = 3.0

        async def caller(client: QosdClient) -> None:
            nonlocal admitted
            while time.monotonic() - began < seconds:
                result = await client.acquire("P1", 100, max_wait_ms=50)
                admitted += 100 if result.admitted else 0

        await asyncio.gather(*(caller(client) for client in clients for _ in range(4)))
        took = time.monotonic() - began
        # P1's rate: 3,000 tokens/s (old) or 6,000 (new); bursts 3,000 and 6,000.
        low, high = 3_000 * took, 6_000 * took + 6_000
        print(f"\nP1 admitted {admitted:.0f} tokens in {took:.2f} s (bounds {low:.0f}..{high:.0f})")
        assert admitted <= high
        assert admitted >= 0.9 * low
    finally:
        for client in clients:
            await client.close()
        for daemon in daemons:
            await daemon.stop(0)


async def test_a_replica_without_a_new_class_keeps_its_leases_in_flight_counted(
    redis_standalone: RedisServer,
) -> None:
    """Mid-way through a rollout that adds class P3, an old replica's calls rewrite the
    pool's lease-expiry records (per second, per class name). They keep P3's part,
    which they cannot read, and their sweep ends P3's expired leases by name: the
    in-flight count of a GPU-gated pool must not keep leases that ended."""
    prefix = f"t{os.getpid()}{time.monotonic_ns()}"
    redis_settings = {"url": redis_standalone.url, "key_prefix": prefix}
    gated = {"pools": {"default": {"max_in_flight": 100}}}
    old = config_of(merge(gated, {"redis": redis_settings}))
    new = config_of(
        merge(
            gated,
            {
                "redis": redis_settings,
                "classes": {"P2": {"share": 0.05}, "P3": {"priority": 3, "share": 0.05}},
            },
        )
    )
    old_pool, new_pool = resolve_pools(old)["default"], resolve_pools(new)["default"]

    def class_of(pool: PoolPolicy, name: str) -> ClassPolicy:
        return next(cls for cls in pool.classes if cls.name == name)

    def lease(qos_class: str, ttl_ms: int = 1_000) -> LeaseSpec:
        return LeaseSpec(f"default:{qos_class}:{new_lease_token()}", "", "", 10, 0, 1.0, ttl_ms)

    stores = [
        RedisStore(old.redis, tombstone_ms=1_000, daemon_id="old"),
        RedisStore(new.redis, tombstone_ms=1_000, daemon_id="new"),
    ]
    for store in stores:
        await store.start()
    old_store, new_store = stores
    try:
        p1, p2 = class_of(old_pool, "P1"), class_of(old_pool, "P2")
        # A long lease keeps the pool's leases in flight past the others' expiry, so
        # the sweep ends them second by second (not all at once).
        assert (await old_store.acquire(old_pool, p2, lease("P2", 60_000), 0)).admitted
        p3 = await new_store.acquire(new_pool, class_of(new_pool, "P3"), lease("P3"), 0)
        assert p3.admitted
        for _ in range(3):  # the old replica's leases, in the same expiry seconds
            assert (await old_store.acquire(old_pool, p1, lease("P1"), 0)).admitted
        assert (await new_store.status(new_pool)).classes["P3"].in_flight == 1  # kept
        # Past the TTL, the old replica's own calls end the expired leases, P3's too.
        ended = await eventually(
            lambda: old_store.status(old_pool), lambda s: s.classes["P1"].in_flight == 0
        )
        assert ended.classes["P2"].in_flight == 1  # the long one
        assert (await new_store.status(new_pool)).classes["P3"].in_flight == 0
    finally:
        for store in stores:
            await store.close()
