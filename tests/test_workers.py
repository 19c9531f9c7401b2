"""``qosd serve --workers N`` (qosd.workers): N daemons on one port, one supervisor.

Real processes on real sockets, on a Redis the tests start: both workers answer on the
one port (each a daemon of its own id), /metrics counts both workers' decisions and
shows the fleet's state once, SIGHUP reloads every worker, SIGTERM drains them all,
a worker's death ends the group, and a start that cannot work fails at once with the
reason. The resolution of ``auto`` and the config's refusals are pure unit tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from qosd.config import ConfigError, load_config
from qosd.workers import available_cpus, cgroup_cpu_limit, resolve_workers
from qosd_client import QosdClient
from qosd_client.types import Status
from qosd_harness import DaemonProcess, RedisServer, closed_port
from tests.conftest import TEST_REDIS_TIMEOUT_MS
from tests.waiting import eventually, wait_until

# -- auto, and what the config refuses (no processes) --------------------------------


def cgroup(tmp_path: Path, own: str, limits: dict[str, str]) -> tuple[Path, Path]:
    """A fake /sys/fs/cgroup (``limits``: a directory under it -> its cpu.max) and a
    /proc/self/cgroup naming ``own``."""
    root = tmp_path / "cgroup"
    (root / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for directory, text in limits.items():
        (root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (root / directory.lstrip("/") / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


@pytest.mark.fast
@pytest.mark.parametrize(
    ("affinity", "limits", "expected"),
    [
        (8, {}, 8),  # no cpu.max anywhere (cgroup v1, or no controller): the mask
        (8, {"/": "max 100000"}, 8),  # no quota
        (8, {"/": "200000 100000"}, 2),  # limits.cpu: 2
        (8, {"/": "150000 100000"}, 2),  # 1.5 CPUs: rounded up
        (8, {"/": "50000 100000"}, 1),  # half a CPU: still one worker
        (2, {"/": "400000 100000"}, 2),  # a quota above the mask: the mask
        (8, {"/": "max 100000", "/kubepods/pod1": "300000 100000"}, 3),  # the own cgroup
        (8, {"/kubepods": "100000 100000", "/kubepods/pod1": "300000 100000"}, 1),  # above
    ],
)
def test_auto_is_the_cpus_this_process_may_use(
    tmp_path: Path, affinity: int, limits: dict[str, str], expected: int
) -> None:
    root, proc = cgroup(tmp_path, "/kubepods/pod1", limits)
    assert available_cpus(lambda: affinity, lambda: cgroup_cpu_limit(root, proc)) == expected


@pytest.mark.fast
def test_auto_resolves_on_this_machine_and_numbers_stay() -> None:
    assert resolve_workers(3) == 3
    assert 1 <= resolve_workers("auto") <= len(os.sched_getaffinity(0))


@pytest.mark.fast
def test_unreadable_cgroup_files_mean_no_quota(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, "/", {"/": "garbage"})
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-too") is None


# Validated only: load_config connects to nothing.
REDIS_URL: dict[tuple[str, ...], Any] = {("redis", "url"): "redis://127.0.0.1:1/0"}


@pytest.mark.fast
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({("server", "workers"): 2}, "server.workers: more than one worker (2) needs Redis"),
        ({("server", "workers"): "auto"}, "server.workers: more than one worker ('auto')"),
        ({**REDIS_URL, ("server", "workers"): 0}, "server.workers: must be an integer from 1"),
        ({**REDIS_URL, ("server", "workers"): "many"}, "server.workers: must be an integer"),
        ({**REDIS_URL, ("server", "workers"): True}, "server.workers: must be an integer"),
        (
            {**REDIS_URL, ("server", "workers"): "2", ("server", "listen"): ["unix:/run/q.sock"]},
            "server.workers: 2 workers cannot share the unix socket unix:/run/q.sock",
        ),
    ],
)
def test_the_config_refuses_workers_that_cannot_work(
    overrides: dict[tuple[str, ...], Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=r"server\.workers") as error:
        load_config(overrides=overrides, env={})
    assert message in str(error.value)


@pytest.mark.fast
def test_workers_from_the_file_the_environment_and_flags() -> None:
    assert load_config(env={}).server.workers == 1
    assert load_config(env={"QOSD_WORKERS": "auto"}, overrides=REDIS_URL).server.workers == "auto"
    flags = {**REDIS_URL, ("server", "workers"): "4"}
    assert load_config(env={"QOSD_WORKERS": "auto"}, overrides=flags).server.workers == 4


# -- worker groups --------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def worker_group(
    tmp_path: Path, config: dict[str, Any], workers: int | str = 2
) -> Iterator[DaemonProcess]:
    """A supervisor and its workers; whatever is left of them is killed afterwards."""
    group = DaemonProcess(config, tmp_path / "group", workers=workers, log_level="INFO")
    pids: list[int] = []
    try:
        group.start()
        pids = list(group.ready["workers"])
        yield group
    finally:
        group.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def redis_config(redis: RedisServer, **server: Any) -> dict[str, Any]:
    return {
        "redis": {
            "url": redis.url,
            "key_prefix": f"w{uuid.uuid4().hex[:10]}",
            "timeout_ms": TEST_REDIS_TIMEOUT_MS,
        },
        "server": {"listen": ["127.0.0.1:0"], **server},
        "pools": {"default": {"capacity_tokens_s": 10_000}},
    }


def new_connection(address: str) -> QosdClient:
    """A client on a TCP connection of its own: gRPC shares one per target and
    options in a process, and the kernel picks a worker per connection."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    return QosdClient(address, channel=grpc.aio.insecure_channel(address, options=options))


async def status_on_a_new_connection(address: str) -> Status:
    async with new_connection(address) as client:
        return await client.status()


async def daemon_ids(address: str, workers: int = 2, connections: int = 200) -> set[str]:
    """The daemon ids behind the port, over new connections until ``workers`` are seen
    (the kernel spreads connections by a hash: 200 all on one of 2 is 2^-199)."""
    seen: set[str] = set()
    for _ in range(connections):
        seen.add((await status_on_a_new_connection(address)).daemon_id)
        if len(seen) == workers:
            break
    return seen


def scrape(http: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` as {sample name: [(labels, value)]}."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


async def test_two_workers_answer_on_one_port_and_metrics_count_both(
    redis_standalone: RedisServer, tmp_path: Path
) -> None:
    config = redis_config(redis_standalone, http_listen="127.0.0.1:0")
    with worker_group(tmp_path, config) as group:
        ready = group.ready
        assert group.process is not None and ready["pid"] == group.process.pid
        assert len(ready["workers"]) == 2
        assert all(alive(pid) for pid in ready["workers"])
        # Acquires over new connections, each counted by the daemon that answered it.
        answered: Counter[str] = Counter()
        for _ in range(200):
            async with new_connection(group.address) as client:
                result = await client.acquire("P1", 10)
                assert result.admitted
                answered[(await client.status()).daemon_id] += 1
            if len(answered) == 2 and answered.total() >= 10:
                break
        assert len(answered) == 2, answered  # two daemons, one port
        total = answered.total()

        def admitted() -> float:
            return sum(
                value
                for labels, value in scrape(ready["http"])["qosd_acquire_decisions_total"]
                if labels["decision"] == "admitted"
            )

        # Whichever worker answers the scrape, it counts both workers' decisions.
        for _ in range(4):
            assert await eventually(lambda: asyncio.to_thread(admitted), lambda n: n == total) == (
                total
            )
        samples = await asyncio.to_thread(scrape, ready["http"])
        # State is the fleet's, read by the worker that answers: once, not summed.
        assert samples["qosd_pool_configured_capacity_tokens_per_second"] == [
            ({"pool": "default"}, 10_000.0)
        ]
        assert samples["qosd_store_up"] == [({}, 1.0)]
        # One of the two leads the SLO loop (the only daemons on this store): max is 1,
        # once one has won the election, which a loaded machine can hold past the scrape.
        leaders = await eventually(
            lambda: asyncio.to_thread(lambda: scrape(ready["http"])["qosd_controller_leader"]),
            lambda found: found == [({}, 1.0)],
            timeout_s=20,
        )
        assert leaders == [({}, 1.0)]
        assert samples["qosd_config_last_reload_successful"] == [({}, 1.0)]
        assert "qosd_store_call_seconds_bucket" in samples  # histograms merge too
        assert group.terminate() == 0


async def test_sighup_reloads_every_worker(redis_standalone: RedisServer, tmp_path: Path) -> None:
    with worker_group(tmp_path, redis_config(redis_standalone)) as group:
        ids = await daemon_ids(group.address)
        assert len(ids) == 2
        # The same size and mtime, rewritten in place: the file watch sees no change
        # (qosd.reload), so what reloads the workers is the SIGHUP passed on to them.
        path = group.directory / "qosd.yaml"
        before = path.stat()
        changed = yaml.safe_dump(
            {**group.config, "pools": {"default": {"capacity_tokens_s": 20_000}}}
        )
        assert len(changed) == before.st_size
        path.write_text(changed)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert group.process is not None
        group.process.send_signal(signal.SIGHUP)
        capacity: dict[str, float] = {}

        async def both_reloaded() -> dict[str, float]:
            status = await status_on_a_new_connection(group.address)
            capacity[status.daemon_id] = status.pool("default").capacity_tokens_s
            return capacity

        seen = await eventually(both_reloaded, lambda c: c == dict.fromkeys(ids, 20_000.0), 30)
        assert seen == dict.fromkeys(ids, 20_000.0)
        assert group.log_path.read_text().count("config reloaded (SIGHUP)") == 2


async def test_sigterm_drains_every_worker_and_exits_0(
    redis_standalone: RedisServer, tmp_path: Path
) -> None:
    with worker_group(tmp_path, redis_config(redis_standalone)) as group:
        pids = group.ready["workers"]
        assert group.terminate() == 0
        # The supervisor waited for them: none is left, not even as a zombie.
        assert not any(alive(pid) for pid in pids)
        log = group.log_path.read_text()
        assert log.count("draining: refusing new calls") == 2
        assert log.count("qosd.server: stopped") == 2


async def test_a_dead_worker_ends_the_group(redis_standalone: RedisServer, tmp_path: Path) -> None:
    with worker_group(tmp_path, redis_config(redis_standalone)) as group:
        first, second = group.ready["workers"]
        os.kill(second, signal.SIGKILL)
        assert group.process is not None
        code = await asyncio.to_thread(group.process.wait, 30)
        assert code != 0
        assert not alive(first)
        assert f"(pid {second}) exited unexpectedly with -9" in group.log_path.read_text()


def running(pid: int) -> bool:
    """Alive and not a zombie: a worker whose supervisor is gone is reaped by whoever
    adopts it, perhaps late."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def test_workers_drain_when_the_supervisor_is_killed(
    redis_standalone: RedisServer, tmp_path: Path
) -> None:
    """A supervisor killed outright (the OOM killer) must leave no worker on the port."""
    with worker_group(tmp_path, redis_config(redis_standalone)) as group:
        pids = group.ready["workers"]
        group.kill()
        assert wait_until(lambda: not any(running(pid) for pid in pids), timeout_s=30)
        assert group.log_path.read_text().count("qosd.server: stopped") == 2  # drained


def serve(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``qosd serve ARGS`` to its end: these must not start, or not for long."""
    return subprocess.run(
        [sys.executable, "-m", "qosd.cli", "serve", *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip


def test_the_embedded_store_refuses_workers_before_anything_starts() -> None:
    # A port held closed, never bound: were the refusal to come after the bind, that
    # bind would fail at once (exit 1) rather than serve on some port until the timeout.
    with closed_port() as port:
        done = serve("--workers", "2", "--listen", f"127.0.0.1:{port}")
    assert done.returncode == 2
    assert "server.workers: more than one worker (2) needs Redis" in done.stderr
    assert "qosd serving" not in done.stderr


def test_a_unix_socket_with_workers_is_refused(tmp_path: Path) -> None:
    done = serve("--workers", "2", "--redis-url", "redis://127.0.0.1:1/0",
                 "--listen", f"unix:{tmp_path}/q.sock")  # fmt: skip
    assert done.returncode == 2
    assert "server.workers: 2 workers cannot share the unix socket" in done.stderr


def test_a_taken_port_fails_the_start(redis_standalone: RedisServer) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = serve("--workers", "2", "--redis-url", redis_standalone.url,
                     "--listen", f"127.0.0.1:{port}")  # fmt: skip
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_two_groups_cannot_share_a_port(redis_standalone: RedisServer, tmp_path: Path) -> None:
    """SO_REUSEPORT would let a second group of the same user join the first's port
    and split its traffic; the supervisor's bind without it refuses instead."""
    with worker_group(tmp_path, redis_config(redis_standalone)) as group:
        done = serve("--workers", "2", "--redis-url", redis_standalone.url,
                     "--listen", group.address)  # fmt: skip
        assert done.returncode == 1
        assert f"cannot listen on {group.address}" in done.stderr
        assert all(alive(pid) for pid in group.ready["workers"])


def test_a_worker_that_cannot_start_ends_the_start_with_its_message(
    redis_standalone: RedisServer, tmp_path: Path
) -> None:
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("not a PEM file\n")
    tls = {"cert_file": str(tmp_path / "tls.crt"), "key_file": str(tmp_path / "tls.key")}
    config = tmp_path / "qosd.yaml"
    config.write_text(yaml.safe_dump({"server": {"tls": tls}}))
    done = serve("--workers", "2", "--redis-url", redis_standalone.url, "--config", str(config),
                 "--listen", "127.0.0.1:0")  # fmt: skip
    assert done.returncode == 1
    assert "qosd: server.tls: the files do not load" in done.stderr
    assert "before every worker served; stopping the others" in done.stderr
