"""``qosctl`` against a running daemon (a real process over a real socket)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qosd_client import SyncQosdClient
from qosd_harness import daemon_processes

QOSCTL = [sys.executable, "-c", "from qosd.ctl import main; raise SystemExit(main())"]
CONFIG = {"pools": {"default": {"capacity_tokens_s": 10_000, "models": ["m"]}}}


def qosctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QOSCTL, *args], capture_output=True, text=True, timeout=60, check=False)


def test_qosctl_is_installed() -> None:
    assert shutil.which("qosctl", path=str(Path(sys.executable).parent))


def test_status_watch_leases_pin_unpin(tmp_path: Path) -> None:
    token = tmp_path / "control-token"
    token.write_text("an-operator's-token\n")
    config = {**CONFIG, "auth": {"control": {"token_file": str(token)}}}
    with daemon_processes(config) as (daemon,):
        address = ["--address", daemon.address]
        with SyncQosdClient(daemon.address) as qos:
            held = [qos.acquire("P1", 100, model="m") for _ in range(2)]
            assert all(result.admitted for result in held)
        leases = qosctl("leases", *address, "--json")
        assert leases.returncode == 0, leases.stderr
        assert json.loads(leases.stdout) == {"default": 2}
        table = qosctl("leases", *address)
        assert "default" in table.stdout and "2" in table.stdout.splitlines()[1]
        watch = qosctl("watch", *address, "--interval", "0.1", "--count", "2")
        assert watch.returncode == 0
        assert watch.stdout.count("pool default: admitting") == 2  # two redraws
        assert "2 active leases" in watch.stdout
        anonymous = qosctl("pin", *address, "default", "8000")
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr
        wrong = tmp_path / "wrong-token"
        wrong.write_text("a guess\n")
        guessed = qosctl("pin", *address, "--token-file", str(wrong), "default", "8000")
        assert guessed.returncode == 1 and "PERMISSION_DENIED" in guessed.stderr
        address += ["--token-file", str(token)]
        pinned = qosctl("pin", *address, "default", "8000")
        assert pinned.returncode == 0 and "PINNED" in pinned.stdout
        status = json.loads(qosctl("status", *address, "--json").stdout)
        assert status["pools"][0]["pinned"] and status["pools"][0]["active_leases"] == 2
        assert "PINNED" not in qosctl("unpin", *address, "default").stdout
        unknown = qosctl("pin", *address, "nope", "8000")
        assert unknown.returncode == 1 and "nope" in unknown.stderr
        # `qosctl watch | head -1`: the reader leaves, and qosctl ends quietly.
        with subprocess.Popen(
            [*QOSCTL, "watch", *address, "--interval", "0.05"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        ) as piped:  # fmt: skip
            assert piped.stdout is not None and piped.stderr is not None
            assert piped.stdout.readline()  # the first line of the first redraw
            piped.stdout.close()
            assert piped.wait(timeout=30) == 1
            assert b"Traceback" not in piped.stderr.read()
        healthy = qosctl("health", *address)
        assert healthy.returncode == 0 and healthy.stdout.strip() == "SERVING"
        no_such = qosctl("health", *address, "--service", "nope.Service")
        assert no_such.returncode == 1 and "NOT_FOUND" in no_such.stderr


@pytest.mark.parametrize(
    ("text", "code", "expected"),
    [
        ("fail_mode: open\n", 0, '"fail_mode": "open"'),
        ("classes: {P0: {share: 2}}\n", 2, "classes.P0.share"),
    ],
)
def test_config_check(tmp_path: Path, text: str, code: int, expected: str) -> None:
    path = tmp_path / "qosd.yaml"
    path.write_text(text)
    checked = qosctl("config", "check", str(path))
    assert checked.returncode == code
    assert expected in (checked.stdout if code == 0 else checked.stderr)


def test_unreachable_daemon_is_a_clear_error() -> None:
    down = qosctl("status", "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert down.returncode == 1 and down.stderr.startswith("qosctl status:")
    unhealthy = qosctl("health", "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert unhealthy.returncode == 1 and "UNAVAILABLE" in unhealthy.stderr
