"""Every query of the Grafana dashboard returns series from a real Prometheus (Debian's
``prometheus``) that scrapes a live daemon every second and evaluates the alert
rules file, while the daemon takes a short load that provokes what the panels count:
waits and a queue timeout, samples that miss their objectives, an operator's pin and
a call refused for want of a token, a config reload refused, a store that comes back
empty, and then a store that is gone (store errors, fail-open answers).

No query is padded (``or vector(0)``): each series comes from the daemon."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml

from qosd.config import load_config
from qosd.reload import ConfigReloader
from qosd.server import Daemon, start
from qosd_client import LatencySample, QosdClient, Reason, ServerLoad, Unauthenticated
from qosd_harness import RedisServer, redis_server, spawn_on_reserved_port, stop_process
from tests.conftest import BASE_CONFIG, merge
from tests.test_monitoring_dashboard import dashboard, panel_queries
from tests.waiting import eventually, until

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "helm" / "qosd" / "rules" / "qosd-alerts.yaml"
# Grafana's variables as a Prometheus query needs them: every pool and class, and a
# rate window that covers the whole run (Grafana's $__rate_interval is at least four
# scrape intervals).
VARIABLES = {"$pool": ".*", "$class": ".*", "$__rate_interval": "1m"}
MAX_IN_FLIGHT = 4


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def daemon_config(tmp_path: Path, own_redis: RedisServer) -> dict[str, Any]:
    (tmp_path / "control-token").write_text("operator\n")
    return merge(
        BASE_CONFIG,
        {
            "server": {"http_listen": "127.0.0.1:0"},
            "fail_mode": "open",
            "redis": {
                "url": own_redis.url,
                "key_prefix": f"t{uuid.uuid4().hex[:12]}",
                "timeout_ms": 1_000,
                "connect_timeout_ms": 200,
                "retry_interval_ms": 200,
            },
            "pools": {"default": {"max_in_flight": MAX_IN_FLIGHT, "max_in_flight_tokens": 100_000}},
            "classes": {"P0": {"slo": {"ttft_ms": 500}}, "P2": {"max_wait_ms": 100}},
            "auth": {"control": {"token_file": str(tmp_path / "control-token")}},
        },
    )


class Prometheus:
    """A prometheus process with its own storage, scraping one target every second and
    evaluating the alert rules every second. On a reserved port (``PortReservation``),
    held until ``stop``: prometheus takes port 0 but never says which port it got; once
    it listens there itself, started; on another port if it found that one taken."""

    def __init__(self, tmp_path: Path, target: str) -> None:
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "qosd", "static_configs": [{"targets": [target]}]}],
        }
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        binary = shutil.which("prometheus")
        assert binary, "prometheus is needed (scripts/system_packages.sh installs it)"
        self.log = tmp_path / "prometheus.log"
        self.process, self.reservation = spawn_on_reserved_port(
            "prometheus",
            lambda port: [
                binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            self.log,
            output_to_log=True,
        )
        self.port = self.reservation.port

    def stop(self) -> None:
        stop_process(self.process)
        self.reservation.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def ready(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(f"{self.url}/-/ready") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    async def series(self, session: aiohttp.ClientSession, query: str) -> list[Any]:
        """The instant query's result; fails the test on a query Prometheus refuses."""
        async with session.get(f"{self.url}/api/v1/query", params={"query": query}) as response:
            body = await response.json()
        assert body["status"] == "success", (query, body)
        result: list[Any] = body["data"]["result"]
        return result

    async def rules(self, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
        """Every rule Prometheus loaded, with its health after its last evaluation."""
        async with session.get(f"{self.url}/api/v1/rules") as response:
            body = await response.json()
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]


def resets(daemon: Daemon) -> float:
    value = daemon.metrics.registry.get_sample_value("qosd_store_resets_total", {"pool": "default"})
    return value or 0.0


def substituted(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


async def scraped(prometheus: Prometheus, session: aiohttp.ClientSession, samples: int) -> None:
    """Until Prometheus holds a scrape that counts ``samples`` accepted samples: rates
    need the counters to move between two scrapes. (The first scrape comes some 5 s
    after Prometheus starts: its discovery hands over new targets at most every 5 s.)"""
    query = 'sum(qosd_report_samples_total{result="accepted"})'

    async def seen() -> float:
        result = await prometheus.series(session, query)
        return float(result[0]["value"][1]) if result else 0.0

    assert await eventually(seen, lambda value: value >= samples, timeout_s=30) >= samples


async def load(
    daemon: Daemon, token_file: str, prometheus: Prometheus, session: aiohttp.ClientSession
) -> None:
    """Admissions with waits and one queue timeout, samples (P0 misses some), server
    loads, a pin without and with the control token."""
    async with QosdClient(daemon.addresses[0]) as qos:
        # The in-flight bound full: P1 waits for a slot (a wait in the histogram), P2
        # times out waiting.
        held = [await qos.acquire("P0", 100, model="llama-3-8b") for _ in range(MAX_IN_FLIGHT)]
        assert all(lease.admitted for lease in held)
        waiting = asyncio.create_task(qos.acquire("P1", 100, model="llama-3-8b"))
        timed_out = await qos.acquire("P2", 100, model="llama-3-8b")
        assert timed_out.reason is Reason.QUEUE_TIMEOUT
        for lease in held:
            await qos.release(lease.lease_id, output_tokens=20)
        admitted = await waiting
        assert admitted.admitted and admitted.waited_s > 0
        await qos.release(admitted.lease_id)
        for round_ in (1, 2):  # in rounds, each scraped before the next
            await qos.report(
                [LatencySample("llama-3-8b", "P0", ttft_ms=100 + i, tpot_ms=20) for i in range(8)]
                + [LatencySample("llama-3-8b", "P0", ttft_ms=900, tpot_ms=20)],
                loads=[ServerLoad("llama-3-8b", "vllm-0", waiting_requests=3, kv_cache_usage=0.5)],
            )
            for cls in ("P0", "P1"):
                lease = await qos.acquire(cls, 200 + round_, model="llama-3-8b")
                await qos.release(lease.lease_id, output_tokens=10)
            await scraped(prometheus, session, 9 * round_)
        with pytest.raises(Unauthenticated):
            await qos.pin_rate("default", 8_000)
        async with QosdClient(daemon.addresses[0], token_file=token_file) as operator:
            await operator.pin_rate("default", 8_000)


async def test_every_dashboard_query_returns_series_from_prometheus(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    started = time.monotonic()
    config_path = tmp_path / "qosd.yaml"
    tree = daemon_config(tmp_path, own_redis)
    config_path.write_text(yaml.safe_dump(tree))
    daemon = await start(load_config(str(config_path)))
    assert daemon.http is not None
    prometheus = await asyncio.to_thread(Prometheus, tmp_path, daemon.http.address)
    try:
        async with aiohttp.ClientSession() as session:
            assert await eventually(lambda: prometheus.ready(session), bool, timeout_s=30)
            await load(daemon, tree["auth"]["control"]["token_file"], prometheus, session)
            # A config file that does not validate: refused, the running config stays.
            reloader = ConfigReloader(
                lambda: load_config(str(config_path)),
                lambda: daemon.config,
                daemon.apply,
                path=None,
                sample_ratio_live=False,
                on_result=daemon.reload_result,
            )
            config_path.write_text(yaml.safe_dump(merge(tree, {"classes": {"P9": {}}})))
            assert await reloader.reload("test") is None
            # The store comes back empty (a reset), then goes away: the daemon answers
            # fail-open and counts the store's errors.
            client = redis.Redis(host="127.0.0.1", port=own_redis.port)
            client.flushall()
            client.close()
            async with QosdClient(daemon.addresses[0]) as qos:
                assert (await qos.acquire("P1", 10, model="llama-3-8b")).admitted
                assert await until(lambda: resets(daemon) > 0)
                own_redis.kill()
                answer = await qos.acquire("P1", 10, model="llama-3-8b")
                assert answer.reason is Reason.FAIL_OPEN

            queries = [(title, substituted(expr)) for title, expr in panel_queries(dashboard())]

            async def empty() -> list[tuple[str, str]]:
                return [
                    (title, query)
                    for title, query in queries
                    if not await prometheus.series(session, query)
                ]

            missing = await eventually(empty, lambda left: not left, timeout_s=30, interval_s=0.5)
            # The rules file evaluates on real series without an error (a vector
            # match that finds duplicates would say so here, not in promtool's tests).
            rules = await eventually(
                lambda: prometheus.rules(session),
                lambda found: all(rule["health"] == "ok" for rule in found),
                timeout_s=15,
                interval_s=0.5,
            )
    finally:
        prometheus.stop()
        await daemon.stop(0)
    assert not missing, json.dumps(missing, indent=1) + prometheus.log.read_text()[-2000:]
    # Every rule of the file was loaded and evaluated (not a count kept by hand).
    written = [rule for group in yaml.safe_load(RULES.read_text())["groups"]
               for rule in group["rules"]]  # fmt: skip
    assert len(rules) == len(written) >= 17
    assert [
        (r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"
    ] == []
    assert len(queries) >= 30
    assert time.monotonic() - started < 60
