"""The harness's servers on reserved ports: a start that found its port taken moves to
another, and one that fails otherwise says why. Real processes on real ports."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from qosd_harness import PortTaken, listening_ports, spawn_on_reserved_port, stop_process

pytestmark = pytest.mark.fast


def _says_and_exits(log: Path, words: str) -> list[str]:
    """A server that writes ``words`` to its log and exits 1 at once."""
    code = f"open({str(log)!r}, 'a').write({words!r}); raise SystemExit(1)"
    return [sys.executable, "-c", code]


def _http_server(port: int) -> list[str]:
    # http.server sets SO_REUSEADDR, as the servers the harness starts do.
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def test_a_start_that_found_its_port_taken_moves_to_another(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    tried: list[int] = []

    def argv_for(port: int) -> list[str]:
        tried.append(port)
        if len(tried) == 1:
            return _says_and_exits(log, "bind: Address already in use\n")
        return _http_server(port)

    process, reservation = spawn_on_reserved_port("server", argv_for, log)
    try:
        assert len(tried) == 2 and tried[0] != tried[1]
        assert reservation.port == tried[1]
        assert listening_ports(process.pid) == {tried[1]}
    finally:
        stop_process(process)
        reservation.close()


def test_a_start_that_fails_otherwise_says_why_and_frees_its_port(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    tried: list[int] = []

    def argv_for(port: int) -> list[str]:
        tried.append(port)
        return _says_and_exits(log, "fatal: no such config file\n")

    with pytest.raises(RuntimeError, match="no such config file") as failure:
        spawn_on_reserved_port("server", argv_for, log)
    assert not isinstance(failure.value, PortTaken)
    assert len(tried) == 1  # not retried: another port would not help
    # The reservation was closed: a socket without SO_REUSEADDR binds the port now.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain:
        plain.bind(("127.0.0.1", tried[0]))


def test_a_port_taken_every_time_is_an_error_that_counts_the_tries(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="found its port taken 5 times"):
        spawn_on_reserved_port(
            "server", lambda _: _says_and_exits(log, "Address already in use\n"), log
        )
