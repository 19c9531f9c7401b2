"""Throwaway Redis servers, daemon processes and an OTLP trace receiver for tests,
benchmarks and the simulator's experiments.

Everything here starts its own processes in a temporary directory and kills them
afterwards, so no test ever touches a Redis it did not start. No server is started on
a port that was merely free a moment ago: one that can binds port 0 and reports the
port it got (the qosd commands' ready files), and redis-server, which cannot, gets a
port held for it (``PortReservation``) and another one if it finds that taken anyway.

A distribution of its own, qosd-harness: the daemon's image must not carry the code
that starts redis-server and qosd processes, and the daemon's tests must not need the
simulator's libraries (tritonclient, matplotlib) to use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import hiredis
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def free_port() -> int:
    """A port that was free a moment ago. Nothing holds it: another process (a test
    worker's server, an outgoing connection) may take it before the caller binds it.
    Use it only for a number that no server binds (a config that is only validated);
    a server binds port 0 and reports its port, or binds a ``reserve_port`` one, and
    an address that must stay closed is a ``closed_port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 that stays closed while the block runs: bound and never
    listened on, so a connection to it is refused and no other process (another
    test worker's server) can take it, as one could a port ``free_port`` found free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


class PortReservation:
    """A port on 127.0.0.1 held for a server that cannot bind port 0 and report it, or
    must come back on the same port after a kill: a socket bound with SO_REUSEADDR and
    never listened on. While it is held, Linux gives the port to no bind(0) (no other
    worker's server, no ``free_port``) and to no outgoing connection, but a server that
    sets SO_REUSEADDR itself (redis-server, gRPC, aiohttp, nginx, Go's listeners) may
    bind it and listen: the holder does not listen, so it is no conflict. Between a
    kill and a restart nobody else can take the port; connections to it are refused,
    as to a dead server. Hold it for the server's life, ``close`` it after."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = int(self._socket.getsockname()[1])

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reserve_port() -> PortReservation:
    return PortReservation()


class PortTaken(RuntimeError):
    """A server could not bind its port: another process took it first. Where the port
    was chosen for this start, the caller tries again on another."""


# How often a server the harness starts gets another port when its own was taken (a
# process outside the harness's reservations bound it first): each try is a new port,
# so a second collision is already far-fetched.
PORT_ATTEMPTS = 5
ADDRESS_IN_USE = "address already in use"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def listening_ports(pid: int) -> set[int]:
    """The TCP ports the process ``pid`` itself listens on (Linux, from /proc): what
    tells its own server from another process's on the same number."""
    inodes = _socket_inodes(pid)
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, one of its sockets
                    ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def wait_listening(
    process: subprocess.Popen[Any],
    ports: Sequence[int],
    log: Path | None = None,
    log_from: int = 0,
    timeout_s: float = 60.0,
    name: str = "server",
) -> None:
    """Waits until ``process`` listens on every one of ``ports`` with its own sockets.
    Raises ``PortTaken`` if it exits saying an address is in use (its ``log`` after
    byte ``log_from``, where it writes), RuntimeError if it exits otherwise or is not
    listening within ``timeout_s`` (generous: a start on a busy machine is slow, and a
    failed one is seen at once by the exit)."""
    _wait_started(
        process,
        lambda: set(ports) <= listening_ports(process.pid),
        f"{name} on {list(ports)}",
        log,
        log_from,
        timeout_s,
    )


def _wait_started(
    process: subprocess.Popen[Any],
    started: Callable[[], bool],
    what: str,
    log: Path | None,
    log_from: int,
    timeout_s: float,
) -> None:
    """Polls ``started`` until it holds; raises ``_start_failed``'s error if the
    process exits first, and kills it and raises RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not started():
        if process.poll() is not None:
            raise _start_failed(what, process, log, log_from)
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"{what} did not start within {timeout_s}s")
        time.sleep(0.01)


def spawn_on_reserved_port(
    name: str,
    argv_for: Callable[[int], Sequence[str]],
    log: Path,
    *,
    output_to_log: bool = False,
    timeout_s: float = 60.0,
) -> tuple[subprocess.Popen[bytes], PortReservation]:
    """Starts a server that cannot bind port 0 and say which port it got (nginx,
    prometheus, a TLS-only redis-server): ``argv_for(port)`` on a reserved port, ready
    once the process itself listens there (``wait_listening``). ``log``: where it writes
    its log (its own output with ``output_to_log``). On another port when it found that
    one taken anyway, up to PORT_ATTEMPTS times. The reservation is held for the
    server's life: close it after stopping the server."""
    for _ in range(PORT_ATTEMPTS):
        reservation = reserve_port()
        try:
            log_from = _log_size(log)
            with log.open("ab") if output_to_log else contextlib.nullcontext() as output:
                process = subprocess.Popen(
                    list(argv_for(reservation.port)),
                    stdout=output or subprocess.DEVNULL,
                    stderr=subprocess.STDOUT if output else subprocess.DEVNULL,
                )
            wait_listening(process, [reservation.port], log, log_from, timeout_s, name)
        except PortTaken:
            reservation.close()
            continue
        except BaseException:
            reservation.close()
            raise
        return process, reservation
    raise RuntimeError(f"{name} found its port taken {PORT_ATTEMPTS} times")


def _start_failed(
    what: str, process: subprocess.Popen[Any], log: Path | None, log_from: int
) -> Exception:
    """What a process that exited while starting raises: ``PortTaken`` when its log
    (after byte ``log_from``) says an address is in use, else RuntimeError; the log's
    tail in the message either way."""
    said = ""
    if log is not None and log.exists():
        with log.open("rb") as file:
            file.seek(log_from)
            said = file.read().decode(errors="replace")
    failed = PortTaken if ADDRESS_IN_USE in said.lower() else RuntimeError
    return failed(f"{what} exited with {process.returncode}: {said[-2000:]}")


def _log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


RawHandler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


async def serve_raw_unary(service: str, method: str, handler: RawHandler, port: int) -> None:
    """A grpc.aio server with one unary method that takes and answers raw bytes, on
    127.0.0.1:``port`` until the process is killed: the probe servers benchmarks
    compare (no servicer, no interceptors, no (de)serialization but the handler's)."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                service, {method: grpc.unary_unary_rpc_method_handler(handler)}
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def stop_process(process: subprocess.Popen[Any], timeout_s: float = 10.0) -> int:
    """SIGTERM, and SIGKILL if it has not exited within ``timeout_s``; its exit code."""
    if process.poll() is None:
        process.terminate()
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def source_commit(tree: Path) -> str:
    """The commit a checkout stands at, ``+changes`` when its work tree differs: what
    a benchmark that runs two checkouts side by side records of each."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tree), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def changed_paths(tree: Path, paths: Sequence[str]) -> list[str]:
    """What differs from the commit under ``paths`` of a checkout, untracked files
    included (a new module changes a run as much as an edited one)."""
    listed = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--", *paths],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [line[3:] for line in listed.splitlines() if line.strip()]


@contextlib.contextmanager
def clean_worktree(repo: Path, commit: str) -> Iterator[Path]:
    """A detached ``git worktree`` of ``commit`` in a temporary folder, removed after:
    a run pinned to a commit, whatever the checkout it was started from holds."""
    with tempfile.TemporaryDirectory(prefix="qosd-pinned-") as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), commit],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                check=False, capture_output=True,
            )  # fmt: skip


@contextlib.contextmanager
def one_at_a_time(name: str) -> Iterator[None]:
    """Holds an exclusive lock named ``name`` (a file in the temporary folder) while
    the body runs: two benchmark runs that must run alone on this machine wait for
    each other instead of sharing its CPUs. Says so when it has to wait."""
    path = Path(tempfile.gettempdir()) / f"{name}.lock"
    with path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run holding {path} to finish", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed; install it (apt-get install redis-server) — "
            "tests start their own Redis servers and never use an existing one"
        )
    return binary


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Until the server on ``port`` (``process``'s own: ``wait_listening`` saw it
    listen) answers a PING: it may still be loading its data."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):  # up (NOAUTH: requirepass)
                return
        time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} did not answer within {timeout_s}s")


@dataclass
class RedisServer:
    """One redis-server process that this code started and owns.

    ``port`` 0 (what the harness's own servers use): redis-server cannot bind port 0
    and say which port it got (``--port 0`` turns TCP off), so the harness reserves a
    port (``PortReservation``) and starts it there; if another process took that port
    anyway (redis-server exits saying the address is in use), it tries again on a new
    one, so a collision costs a retry, not a failure. The reservation is held until
    ``close``: across ``kill`` and ``start`` (a restart on the same port, which the
    tests' daemons name) no other process can take the port. ``cluster_bus``: a
    cluster node, whose bus port (``--cluster-port``) is reserved the same way.
    A port given (not 0) is used as it is, once: a collision there is an error."""

    port: int
    directory: Path
    extra_args: Sequence[str] = ()
    process: subprocess.Popen[bytes] | None = None
    cluster_bus: bool = False
    bus_port: int = 0
    _reservations: list[PortReservation] = field(default_factory=list, repr=False)
    _movable: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self._movable = self.port == 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        return self._spawn(["--save", "", "--appendonly", "no", *self.extra_args])

    def start_sentinel(self) -> RedisServer:
        """Starts ``redis-server CONFIG --sentinel`` (the config file and the flag in
        ``extra_args``): a sentinel takes none of a data server's persistence flags."""
        return self._spawn([], before=self.extra_args)

    def _reserve(self) -> None:
        self._release()
        self._reservations = [reserve_port() for _ in range(2 if self.cluster_bus else 1)]
        self.port = self._reservations[0].port
        self.bus_port = self._reservations[1].port if self.cluster_bus else 0

    def _release(self) -> None:
        for reservation in self._reservations:
            reservation.close()
        self._reservations = []

    def _spawn(self, after: Sequence[str], before: Sequence[str] = ()) -> RedisServer:
        """redis-server on this port and directory, ``before`` the common flags (a
        sentinel's config file comes first) and ``after`` them; on a new port when the
        one chosen for this first start was taken."""
        for _ in range(PORT_ATTEMPTS):
            if self._movable and not self._reservations:
                self._reserve()
            try:
                return self._spawn_once(after, before)
            except PortTaken:
                if not self._movable:
                    raise
                self._release()  # and another port on the next try
        raise RuntimeError(f"redis-server found its port taken {PORT_ATTEMPTS} times")

    def _spawn_once(self, after: Sequence[str], before: Sequence[str]) -> RedisServer:
        log = self.directory / "redis.log"
        where = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                 "--logfile", str(log)]  # fmt: skip
        if self.cluster_bus:
            where += ["--cluster-port", str(self.bus_port)]
        log_from = _log_size(log)
        self.process = subprocess.Popen(
            [redis_server_binary(), *before, *where, *after],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        ports = [self.port, self.bus_port] if self.cluster_bus else [self.port]
        try:
            wait_listening(self.process, ports, log, log_from, name="redis-server")
        except PortTaken:
            self.process = None
            raise
        _wait_for_port(self.port, self.process)
        self._movable = False  # started: it comes back on this port
        return self

    def kill(self) -> None:
        """Kills the server abruptly, as a crash or a network cut would. Its port stays
        reserved for a restart."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self.process = None

    def close(self) -> None:
        """Kills the server and gives its port back."""
        self.kill()
        self._release()

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def pause(self) -> None:
        """Stops the process (SIGSTOP): the kernel still accepts connections to its
        port, but nothing answers, as with a hung server or a cut link."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Lets a paused process go on (SIGCONT); what it was sent meanwhile is read."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def redis_server(extra_args: Sequence[str] = ()) -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="qosd-redis-") as directory:
        server = RedisServer(0, Path(directory), extra_args)
        try:
            yield server.start()
        finally:
            server.close()


@dataclass
class RedisCluster:
    """A 3-master Redis Cluster with no replicas, started from scratch."""

    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.nodes[0].url


@contextlib.contextmanager
def redis_cluster(size: int = 3) -> Iterator[RedisCluster]:
    with tempfile.TemporaryDirectory(prefix="qosd-cluster-") as directory:
        cluster = RedisCluster()
        try:
            for index in range(size):
                node_dir = Path(directory) / f"node{index}"
                node = RedisServer(
                    0,
                    node_dir,
                    (
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout", "2000",
                    ),
                    cluster_bus=True,
                )  # fmt: skip
                cluster.nodes.append(node)
                node.start()
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RuntimeError("redis-cli is not installed (it ships with redis-server)")
            subprocess.run(
                [cli, "--cluster", "create"]
                + [f"127.0.0.1:{node.port}" for node in cluster.nodes]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=30,
            )
            _wait_for_cluster_ok(cli, cluster)
            yield cluster
        finally:
            for node in cluster.nodes:
                node.close()


def _wait_for_cluster_ok(cli: str, cluster: RedisCluster, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [
            subprocess.run(
                [cli, "-p", str(node.port), "cluster", "info"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
            for node in cluster.nodes
        ]
        if all("cluster_state:ok" in state for state in states):
            return
        time.sleep(0.1)
    raise RuntimeError("redis cluster did not reach cluster_state:ok")


def redis_command(port: int, *args: str, timeout_s: float = 10.0) -> Any:
    """One command to the local server on ``port``, for harness code that must not
    depend on a client library's sentinel support; returns the decoded reply (an
    error reply as a ``hiredis.ReplyError``)."""
    reader = hiredis.Reader(encoding="utf-8")
    with socket.create_connection(("127.0.0.1", port), timeout_s) as sock:
        sock.sendall(hiredis.pack_command(tuple(args)))  # type: ignore[arg-type]
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"127.0.0.1:{port} closed the connection")
            reader.feed(chunk)
            reply = reader.gets()
            if reply is not False:
                return reply


def _role(port: int) -> str:
    with contextlib.suppress(OSError):
        reply = redis_command(port, "ROLE")
        if isinstance(reply, list):
            return str(reply[0])
    return "down"


@dataclass
class RedisSentinel:
    """A master, one replica of it and sentinels that monitor it as ``name``.

    The master refuses writes once it has no replica (``min-replicas-to-write 1``),
    the guard a Sentinel deployment should have: an old master still running after
    its replica was promoted then accepts nothing that the failover would lose. The
    replica has no such rule, so that once promoted it takes writes alone."""

    directory: Path
    name: str = "qosd-master"
    master: RedisServer | None = None
    replica: RedisServer | None = None
    sentinels: list[RedisServer] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def sentinel_addresses(self) -> list[str]:
        return [f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels]

    @property
    def servers(self) -> list[RedisServer]:
        return [server for server in (self.master, self.replica) if server is not None]

    def master_port(self, sentinel: int = 0) -> int | None:
        """The master's port as a sentinel names it now (None: it names none)."""
        reply = redis_command(
            self.sentinels[sentinel].port, "SENTINEL", "get-master-addr-by-name", self.name
        )
        return int(reply[1]) if reply else None

    def role(self, server: RedisServer) -> str:
        """``master``, ``slave``, or ``down`` when it does not answer."""
        return _role(server.port)

    def replica_known(self) -> bool:
        """Whether every sentinel sees the replica linked to the master, so that a
        SENTINEL FAILOVER has a replica to promote."""
        assert self.replica is not None
        for sentinel in self.sentinels:
            replicas = redis_command(sentinel.port, "SENTINEL", "replicas", self.name)
            fields = [dict(zip(r[::2], r[1::2], strict=True)) for r in replicas or []]
            if not any(
                f.get("port") == str(self.replica.port)
                and f.get("master-link-status") == "ok"
                and "s_down" not in f.get("flags", "")
                for f in fields
            ):
                return False
        return True

    def failover(self, timeout_s: float = 30.0) -> int:
        """Asks the first sentinel for a failover and waits until it names the other
        server and that server says it is the master; returns the new master's port."""
        assert self.master is not None and self.replica is not None
        old = self.master_port()
        target = self.replica if old == self.master.port else self.master
        deadline = time.monotonic() + timeout_s
        while True:  # NOGOODSLAVE until the sentinel has seen the replica's link up
            reply = redis_command(self.sentinels[0].port, "SENTINEL", "FAILOVER", self.name)
            if reply == "OK":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"SENTINEL FAILOVER kept answering {reply}")
            time.sleep(0.05)
        while self.master_port() != target.port or self.role(target) != "master":
            if time.monotonic() > deadline:
                raise RuntimeError(f"no failover to port {target.port} within {timeout_s}s")
            time.sleep(0.02)
        return target.port

    def kill(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.kill()

    def close(self) -> None:
        """Kills every server and gives their ports back."""
        for server in [*self.sentinels, *self.servers]:
            server.close()


def _replica_linked(port: int) -> bool:
    with contextlib.suppress(OSError):
        info = redis_command(port, "INFO", "replication")
        return "master_link_status:up" in str(info)
    return False


@contextlib.contextmanager
def redis_sentinel(
    sentinels: int = 1, *, down_after_ms: int = 1_000, master_args: Sequence[str] = ()
) -> Iterator[RedisSentinel]:
    """A master, a replica and ``sentinels`` sentinels (quorum 1), on free ports with
    their configs in a temporary directory; all killed afterwards. Yields once the
    replica is linked and every sentinel sees it."""
    with tempfile.TemporaryDirectory(prefix="qosd-sentinel-") as directory:
        group = RedisSentinel(Path(directory))
        try:
            master_flags = (
                "--min-replicas-to-write", "1", "--min-replicas-max-lag", "10",
                # A replica's first sync starts at once, not after Redis's default 5 s
                # wait for more replicas to share one diskless transfer.
                "--repl-diskless-sync-delay", "0",
            )  # fmt: skip
            master = group.master = RedisServer(
                0, group.directory / "master", (*master_flags, *master_args)
            )
            master.start()
            replica = group.replica = RedisServer(
                0,
                group.directory / "replica",
                ("--replicaof", "127.0.0.1", str(master.port), *master_args),
            )
            replica.start()
            for index in range(sentinels):
                sentinel_dir = group.directory / f"sentinel{index}"
                sentinel_dir.mkdir()
                config = sentinel_dir / "sentinel.conf"
                config.write_text(
                    f"sentinel monitor {group.name} 127.0.0.1 {master.port} 1\n"
                    f"sentinel down-after-milliseconds {group.name} {down_after_ms}\n"
                    f"sentinel failover-timeout {group.name} 10000\n"
                    f"sentinel parallel-syncs {group.name} 1\n"
                )
                # A sentinel rewrites its config file: it must be writable, its own.
                sentinel = RedisServer(0, sentinel_dir, (str(config), "--sentinel"))
                group.sentinels.append(sentinel)
                sentinel.start_sentinel()
            deadline = time.monotonic() + 30
            while not (_replica_linked(replica.port) and group.replica_known()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the sentinels did not see the replica linked")
                time.sleep(0.05)
            yield group
        finally:
            group.close()


def start_command(
    args: Sequence[str],
    directory: Path,
    name: str,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Starts ``qosd ARGS --ready-file ...`` (any command that writes one) with its
    output in ``directory/NAME.log``, and waits for its ready file: the process and
    what the file says. Raises RuntimeError, with the log's tail, if it exits first;
    ``PortTaken`` when what it said was that an address is in use. ``timeout_s`` is
    generous: a start on a busy machine is slow, and a failed one is seen at once.
    ``env``: the process's whole environment (say, a PYTHONPATH that runs another
    checkout's qosd beside this one); this process's when None."""
    directory.mkdir(parents=True, exist_ok=True)
    ready = directory / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log_path = directory / f"{name}.log"
    log_from = _log_size(log_path)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "qosd.cli", *args, "--ready-file", str(ready)],
            stdout=log, stderr=log, start_new_session=True,
            env=None if env is None else dict(env),
        )  # fmt: skip
    _wait_started(process, ready.exists, f"qosd {args[0]}", log_path, log_from, timeout_s)
    return process, json.loads(ready.read_text())


@dataclass
class DaemonProcess:
    """A ``qosd serve`` process started with a config written to a temporary file.

    ``workers``: ``--workers N`` (or ``auto``); the process is then the supervisor, and
    ``ready`` (the ready file it wrote) lists its workers' pids under ``workers``."""

    config: dict[str, Any]
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    addresses: list[str] = field(default_factory=list)
    workers: int | str | None = None
    log_level: str = "WARNING"
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def log_path(self) -> Path:
        return self.directory / "qosd.log"

    @property
    def address(self) -> str:
        return self.addresses[0]

    def start(self, timeout_s: float = 60.0) -> DaemonProcess:
        """Starts it and waits for its ready file (``timeout_s``, generous: a start on
        a busy machine is slow, and a failed one is seen at once by its exit)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        config_path = self.directory / "qosd.yaml"
        ready = self.directory / "ready.json"
        ready.unlink(missing_ok=True)
        config_path.write_text(yaml.safe_dump(self.config))
        log = (self.directory / "qosd.log").open("ab")
        workers = [] if self.workers is None else ["--workers", str(self.workers)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qosd.cli", "serve", "--config", str(config_path),
             "--ready-file", str(ready), "--log-level", self.log_level, *workers],
            stdout=log,
            stderr=log,
            # Its own session: a terminal's Ctrl-C goes to the whole foreground group, and
            # a daemon that died of it under a running demo or benchmark turned the
            # parent's clean interrupt into connection errors (exit 1, not 130). The
            # parent stops it in `kill`.
            start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"qosd exited with {self.process.returncode}: "
                    + (self.directory / "qosd.log").read_text()[-2000:]
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"qosd did not become ready within {timeout_s}s")
            time.sleep(0.02)
        self.ready = json.loads(ready.read_text())
        self.addresses = self.ready["addresses"]
        return self

    def terminate(self, timeout_s: float = 30.0) -> int:
        """Sends SIGTERM and waits for the drain to finish; returns the exit code."""
        if self.process is None:
            return 0
        code = stop_process(self.process, timeout_s)
        self.process = None
        return code

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None


@contextlib.contextmanager
def daemon_processes(config: dict[str, Any], count: int = 1) -> Iterator[list[DaemonProcess]]:
    """Starts ``count`` daemons, all with ``config``, each on a port of its own (port 0:
    each binds one and says which in its ready file); stops them after."""
    with tempfile.TemporaryDirectory(prefix="qosd-daemons-") as directory:
        daemons: list[DaemonProcess] = []
        try:
            for index in range(count):
                node_config = json.loads(json.dumps(config))
                node_config.setdefault("server", {})["listen"] = ["127.0.0.1:0"]
                daemons.append(DaemonProcess(node_config, Path(directory) / f"qosd{index}").start())
            yield daemons
        finally:
            for daemon in daemons:
                daemon.kill()


# -- an OpenTelemetry collector ----------------------------------------------------


@dataclass
class ExportedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]]
    status_code: int


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


@dataclass
class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector in this process: keeps every span it is sent
    (``keep=False``: only counts them, for benchmarks)."""

    spans: list[ExportedSpan] = field(default_factory=list)
    keep: bool = True
    received: int = 0

    def Export(  # noqa: N802 - OTLP method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            if not self.keep:
                self.received += sum(len(scope.spans) for scope in resource_spans.scope_spans)
                continue
            resource = _attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.received += 1
                    self.spans.append(
                        ExportedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            resource=resource,
                            links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in span.links],
                            status_code=span.status.code,
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, timeout_s: float = 10.0, **where: str) -> list[ExportedSpan]:
        """The spans matching ``where`` (name, trace_id, parent_id...) once some arrive."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [
                s for s in list(self.spans) if all(getattr(s, k) == v for k, v in where.items())
            ]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


@contextlib.contextmanager
def otlp_receiver(keep: bool = True) -> Iterator[tuple[OtlpReceiver, str]]:
    """An OTLP/gRPC trace receiver on a free port; yields it and its endpoint URL."""
    collector = OtlpReceiver(keep=keep)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        collector, server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)
