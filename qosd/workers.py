"""``qosd serve --workers N``: N daemon processes on the same addresses, one supervisor.

One daemon is one Python process, so one core: its gRPC server, admission and store
client share one event loop. On a machine with more cores the way up is more
processes, and a complete daemon per process keeps every fleet rule as it is: each
worker has its own daemon id, store connections, waiting room, heartbeats and its turn
in the SLO loop's election, exactly as N replicas would, only on one port. Hence the
Redis store: the embedded one keeps its state in a process (the config refuses it).

Why fresh processes and not fork: gRPC's threads and fork do not mix (grpc/grpc#22624),
and a forked child would share the parent's random state (daemon ids, lease tokens).
The supervisor never imports grpc; it starts ``python -m qosd.cli`` with the same
arguments, tells each process it is a worker through ``$QOSD_INTERNAL_WORKER`` (its
index, the resolved addresses and where to say it is ready), and then only forwards
signals and watches for deaths.

Sharing the port: every worker binds it with SO_REUSEPORT (``grpc.so_reuseport``, and
aiohttp's ``reuse_port`` for HTTP), and the kernel spreads new connections over them by
a hash of the connection's addresses. A port must be known before the workers bind, so
the supervisor resolves port 0 itself and holds a reservation (a bound, never
listening, SO_REUSEPORT socket) until they serve. It first binds each address without
SO_REUSEPORT, so a port another daemon or another worker group holds is a start-up
error, as with one daemon, and never a silent split of the traffic.

The admin listener (``server.admin_listen``, a unix socket in the chart) is served by
worker 0 alone: its calls act on the store (pins) or report it, which any worker can
do, and a unix socket cannot be shared.

Failure: a worker that exits before all serve ends the start with its own message
(printed on the shared stderr) and a non-zero exit; one that dies later stops the
others and the supervisor exits non-zero, for Kubernetes to restart the pod: a respawn
loop inside would hide a crash loop from the orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import math
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import multiprocess

from qosd.config import Config, parse_host_port, parse_listen_address

log = logging.getLogger(__name__)

WORKER_ENV = "QOSD_INTERNAL_WORKER"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# How often the supervisor looks for the workers' ready files while they start.
READY_POLL_S = 0.02
# After the drain grace, how long the workers get before they are killed.
STOP_MARGIN_S = 10.0
PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """The worker group cannot start (an address is taken)."""


# -- how many -----------------------------------------------------------------------


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest cgroup v2 CPU quota over this process, in CPUs (None: no quota).

    ``cpu.max`` is ``QUOTA PERIOD`` (or ``max PERIOD``) in this process's cgroup and in
    each one above it; in a container the namespaced root (``/sys/fs/cgroup/cpu.max``)
    is the container's own limit, which is where Kubernetes puts ``limits.cpu``."""
    directories = [root]
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                own = root / line[3:].strip().lstrip("/")
                directories = [own, *own.parents]
                directories = [d for d in directories if d == root or root in d.parents]
    limits = []
    for directory in directories:
        try:
            quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        except OSError:
            continue
        if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
            limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def available_cpus(
    affinity: Callable[[], int] | None = None, quota: Callable[[], float | None] | None = None
) -> int:
    """The CPUs this process may use: its affinity mask, bounded by a CPU quota
    (rounded up: 1.5 CPUs of quota is worth a second worker), at least 1."""
    cpus = affinity() if affinity else len(os.sched_getaffinity(0))
    limit = quota() if quota else cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def resolve_workers(value: int | Literal["auto"]) -> int:
    """``server.workers`` as a number of processes."""
    return available_cpus() if value == "auto" else value


# -- the worker's side --------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRole:
    """What the supervisor tells a worker: who it is, what to bind, where to report.

    Its listen addresses replace the config's on every load (start and reload), so a
    worker serves the ports the supervisor resolved."""

    index: int
    supervisor_pid: int
    ready_file: str
    listen: list[str]
    http_listen: str | None
    admin_listen: list[str] = field(default_factory=list)

    def overrides(self) -> dict[tuple[str, ...], Any]:
        return {
            ("server", "listen"): self.listen,
            ("server", "http_listen"): self.http_listen,
            ("server", "admin_listen"): self.admin_listen,
        }

    def encode(self) -> str:
        return json.dumps(asdict(self))


def worker_role(environ: dict[str, str] | None = None) -> WorkerRole | None:
    """This process's role, when a supervisor started it."""
    text = (os.environ if environ is None else environ).get(WORKER_ENV)
    return WorkerRole(**json.loads(text)) if text else None


def die_with_supervisor(role: WorkerRole) -> None:
    """Asks the kernel for SIGTERM (a drain) when the supervisor goes, so that a
    supervisor killed outright (SIGKILL, the OOM killer) leaves no worker holding the
    port; and exits at once if it is gone already. Linux only; elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != role.supervisor_pid:
        raise SystemExit(f"qosd worker {role.index}: the supervisor is gone")


# -- the supervisor -----------------------------------------------------------------


def _probe_and_reserve(address: str) -> tuple[str, socket.socket]:
    """Checks that no one holds a TCP address, resolves its port, and holds it with
    SO_REUSEPORT for the workers (``host:port`` as given, the port resolved)."""
    host_text, _, _ = address.rpartition(":")
    host, port = parse_host_port(address, port_zero=True)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            # As gRPC and aiohttp bind: connections in TIME_WAIT do not hold a port.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
            port = probe.getsockname()[1]
        reservation = socket.socket(family, kind, proto)
        try:
            reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            reservation.bind((sockaddr[0], port, *sockaddr[2:]))
        except OSError:
            reservation.close()
            raise
    except OSError as exc:
        raise StartupError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
    return f"{host_text}:{port}", reservation


def reserve_addresses(config: Config) -> tuple[list[str], str | None, list[socket.socket]]:
    """The gRPC and HTTP addresses the workers share, ports resolved, and the sockets
    that hold them until the workers serve. Closes what it took when one fails."""
    reservations: list[socket.socket] = []
    try:
        listen = []
        for address in config.server.listen:
            assert parse_listen_address(address).unix_path is None  # refused by the config
            resolved, held = _probe_and_reserve(address)
            listen.append(resolved)
            reservations.append(held)
        http = None
        if config.server.http_listen:
            http, held = _probe_and_reserve(config.server.http_listen)
            reservations.append(held)
    except StartupError:
        for held in reservations:
            held.close()
        raise
    return listen, http, reservations


@dataclass
class _Worker:
    index: int
    role: WorkerRole
    process: asyncio.subprocess.Process
    exited: asyncio.Task[int]
    ready: dict[str, Any] | None = None


def _read_ready(worker: _Worker) -> bool:
    """Whether the worker has said where it serves (qosd.server.write_ready_file)."""
    path = Path(worker.role.ready_file)
    if not path.exists():
        return False
    worker.ready = json.loads(path.read_text())
    return True


class Supervisor:
    """Starts the workers, says when all serve, forwards signals, watches for deaths."""

    def __init__(
        self,
        config: Config,
        argv: Sequence[str],
        count: int,
        ready_file: str | None,
        run_dir: Path,
    ) -> None:
        self._config = config
        self._argv = list(argv)
        self._count = count
        self._ready_file = ready_file
        self._run_dir = run_dir
        self._metrics_dir = run_dir / "metrics"
        self._workers: list[_Worker] = []
        self._stop = asyncio.Event()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        try:
            listen, http, reservations = reserve_addresses(self._config)
        except StartupError as exc:
            print(f"qosd: {exc}", file=sys.stderr)
            return 1
        try:
            self._metrics_dir.mkdir()
            for index in range(self._count):
                await self._spawn(index, listen, http)
            outcome = await self._until_ready()
        finally:
            for held in reservations:  # the workers' listening sockets hold the ports now
                held.close()
        if outcome is not None:
            return outcome
        self._announce()
        stopping = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait(
            [stopping, *(w.exited for w in self._workers)], return_when=asyncio.FIRST_COMPLETED
        )
        if stopping in done:
            return await self._drain()
        stopping.cancel()
        return await self._after_death()

    async def _spawn(self, index: int, listen: list[str], http: str | None) -> None:
        role = WorkerRole(
            index=index,
            supervisor_pid=os.getpid(),
            ready_file=str(self._run_dir / f"worker-{index}.json"),
            listen=listen,
            http_listen=http,
            admin_listen=self._config.server.admin_listen if index == 0 else [],
        )
        env = {**os.environ, WORKER_ENV: role.encode(), MULTIPROC_ENV: str(self._metrics_dir)}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "qosd.cli", *self._argv, env=env
        )
        exited = asyncio.create_task(process.wait())
        self._workers.append(_Worker(index, role, process, exited))

    async def _until_ready(self) -> int | None:
        """None once every worker serves; an exit code when the start is over: a
        worker that exited first (its code), or a SIGTERM (0 once all have stopped)."""
        waiting = list(self._workers)
        while waiting:
            waiting = [worker for worker in waiting if not _read_ready(worker)]
            early = next((w for w in self._workers if w.exited.done()), None)
            if early is not None:
                code = early.exited.result()
                log.error(
                    "qosd worker %d (pid %d) exited with %d before every worker served; "
                    "stopping the others", early.index, early.process.pid, code,
                )  # fmt: skip
                await self._stop_workers()
                return code if code > 0 else 1
            if self._stop.is_set():
                return await self._drain()
            await asyncio.sleep(READY_POLL_S)
        return None

    def _announce(self) -> None:
        first = self._workers[0].ready or {}
        pids = [w.process.pid for w in self._workers]
        if self._ready_file:
            # What qosd.server.write_ready_file writes for one daemon (pid: this one),
            # plus the workers' pids; the same way, through a rename. Not imported from
            # there: the supervisor does not load grpc.
            content = {
                "pid": os.getpid(),
                "addresses": first.get("addresses", []),
                "admin": first.get("admin", []),
                "http": first.get("http"),
                "workers": pids,
            }
            temporary = f"{self._ready_file}.tmp"
            Path(temporary).write_text(json.dumps(content))
            os.replace(temporary, self._ready_file)
        log.info(
            "qosd: %d workers serving on %s (pids %s)",
            self._count, ", ".join(first.get("addresses", [])), ", ".join(map(str, pids)),
        )  # fmt: skip

    def _forward(self, signum: int) -> None:
        for worker in self._workers:
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signum)

    async def _stop_workers(self) -> bool:
        """SIGTERM to every worker (each drains within server.drain_grace_s), then
        SIGKILL to any still running past it; True when every one stopped cleanly (0,
        or dead of that SIGTERM before it could handle it, at start)."""
        self._forward(signal.SIGTERM)
        timeout = self._config.server.drain_grace_s + STOP_MARGIN_S
        exits = [w.exited for w in self._workers]
        _, late = await asyncio.wait(exits, timeout=timeout)
        for worker in self._workers:
            if not worker.exited.done():
                log.error("qosd worker %d (pid %d) did not stop in %.0fs; killing it",
                          worker.index, worker.process.pid, timeout)  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
        if late:
            await asyncio.wait(late)
        self._forget_dead()
        return all(w.exited.result() in (0, -signal.SIGTERM) for w in self._workers) and not late

    async def _drain(self) -> int:
        log.info("qosd: stopping %d workers", len(self._workers))
        clean = await self._stop_workers()
        return 0 if clean else 1

    async def _after_death(self) -> int:
        dead = [w for w in self._workers if w.exited.done()]
        for worker in dead:
            log.error(
                "qosd worker %d (pid %d) exited unexpectedly with %d; stopping the others "
                "and exiting, for the supervisor (Kubernetes) to restart the group",
                worker.index, worker.process.pid, worker.exited.result(),
            )  # fmt: skip
        self._forget_dead()
        await self._stop_workers()
        code = dead[0].exited.result()
        return code if code > 0 else 1

    def _forget_dead(self) -> None:
        """Drops the live gauges of exited workers from /metrics (prometheus_client's
        ``live*`` modes), as the documentation of its multiprocess mode asks."""
        for worker in self._workers:
            if worker.exited.done():
                pid, directory = worker.process.pid, str(self._metrics_dir)
                multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


def supervise(config: Config, argv: Sequence[str], count: int, ready_file: str | None) -> int:
    """Runs ``count`` workers until SIGTERM/SIGINT (0 once all drained) or a worker's
    death (non-zero). ``argv`` is the command line each worker runs, as given."""
    with tempfile.TemporaryDirectory(prefix="qosd-workers-") as run_dir:
        supervisor = Supervisor(config, argv, count, ready_file, Path(run_dir))
        return asyncio.run(supervisor.run())
