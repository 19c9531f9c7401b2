"""The distributions' boundaries (issue 14, "honest packages").

- ``pip install ./clients`` alone, in a fresh venv, gives a gateway ``qosd_client`` and
  the qosd.v1 stubs with grpcio, protobuf and opentelemetry-api: none of the daemon's
  dependencies, not the daemon, not the simulator; and that client talks to a daemon.
- The daemon never imports the simulator (qosd-sim) or its libraries; ``qosd demo``
  without it says how to install it.

The fresh-venv test installs from PyPI (or pip's cache): about 20 to 40 s.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

from qosd_harness import daemon_processes

ROOT = Path(__file__).resolve().parents[1]
# What a gateway must not get with the client: the daemon's own dependencies, the
# daemon, the simulator and its libraries.
NOT_WITH_THE_CLIENT = {
    "redis", "hiredis", "pydantic", "pydantic-core", "aiohttp", "uvloop", "pyyaml",
    "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc", "prometheus-client",
    "grpcio-health-checking", "grpcio-reflection", "qosd", "qosd-sim", "tritonclient",
    "matplotlib",
}  # fmt: skip
WITH_THE_CLIENT = {"qosd-client", "grpcio", "protobuf", "opentelemetry-api"}
SIMULATOR = ("qosd_sim", "tritonclient", "matplotlib")

# Run by the fresh venv's interpreter, against a daemon of this tree's venv.
CLIENT_SCRIPT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys

    import qosd_client
    from qosd_client import Outcome, SyncQosdClient
    from qosd_client.v1 import qosd_pb2, qosd_pb2_grpc

    # Every module but those of the [metrics] extra (aiohttp, prometheus-client).
    extra = {"qosd_client.server_load", "qosd_client.triton_metrics",
             "qosd_client.engine_metrics", "qosd_client.scraping"}
    for module in pkgutil.walk_packages(qosd_client.__path__, "qosd_client."):
        if module.name not in extra:
            importlib.import_module(module.name)
    assert qosd_pb2.DESCRIPTOR.package == "qosd.v1"
    assert qosd_pb2.DESCRIPTOR.services_by_name["QoS"].full_name == "qosd.v1.QoS"
    assert qosd_pb2_grpc.QoSStub and qosd_pb2_grpc.AdminStub

    with SyncQosdClient(sys.argv[1]) as qos:
        acquired = qos.acquire("P1", 100, model="m")
        released = qos.release(acquired.lease_id, input_tokens=90, outcome=Outcome.OK)
        status = qos.status()
    print(json.dumps({
        "admitted": acquired.admitted,
        "already_released": released.already_released,
        "pools": [pool.name for pool in status.pools],
        "modules": sorted({name.partition(".")[0] for name in sys.modules}),
    }))
    """
)


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{command}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def test_pip_install_clients_in_a_fresh_venv_gets_the_client_alone(tmp_path: Path) -> None:
    # A copy, so that the build proves clients/ needs nothing outside it (and writes
    # no build/ or egg-info into the tree).
    source = tmp_path / "clients"
    shutil.copytree(
        ROOT / "clients", source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", source)

    listed = json.loads(_run(python, "-m", "pip", "list", "--format", "json"))
    names = {entry["name"].lower().replace("_", "-") for entry in listed}
    print("fresh venv after pip install ./clients:", sorted(names))
    assert names >= WITH_THE_CLIENT, sorted(WITH_THE_CLIENT - names)
    assert not names & NOT_WITH_THE_CLIENT, sorted(names & NOT_WITH_THE_CLIENT)

    config = {"pools": {"default": {"capacity_tokens_s": 10_000, "models": ["m"]}}}
    with daemon_processes(config) as (daemon,):
        # cwd: the temporary directory, so that nothing of this tree is importable.
        result = json.loads(_run(python, "-c", CLIENT_SCRIPT, daemon.address, cwd=tmp_path))
    assert result["admitted"] is True
    assert result["already_released"] is False
    assert result["pools"] == ["default"]
    assert not {"qosd", "qosd_sim", "redis", "pydantic", "aiohttp", "uvloop"} & set(
        result["modules"]
    )


def test_the_daemon_never_imports_the_simulator() -> None:
    """Every module of qosd imported: nothing of qosd-sim or its libraries is loaded.
    `qosd --help` loads the simulator's command registrations (the qosd.commands entry
    points) and nothing heavier: no tritonclient, matplotlib, NumPy or the server."""
    probe = textwrap.dedent(
        """
        import importlib, io, json, pkgutil, sys, contextlib
        import qosd
        for module in pkgutil.walk_packages(qosd.__path__, "qosd."):
            importlib.import_module(module.name)
        before = sorted({name.partition(".")[0] for name in sys.modules})
        from qosd.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                main(["--help"])
            except SystemExit:
                pass
        print(json.dumps([before, sorted(sys.modules)]))
        """
    )
    before, after = json.loads(_run(sys.executable, "-c", probe, cwd=ROOT))
    assert "qosd" in before
    assert not set(before) & set(SIMULATOR), sorted(set(before) & set(SIMULATOR))
    heavy = {m for m in after if m.partition(".")[0] in {"tritonclient", "matplotlib", "numpy"}}
    assert not heavy, sorted(heavy)
    assert {m for m in after if m.startswith("qosd_sim")} <= {"qosd_sim", "qosd_sim.commands"}


def test_no_module_of_the_daemon_names_the_simulator() -> None:
    """The simulator adds its commands through entry points: nothing under qosd/
    imports it, or even names its package."""
    named = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "qosd").rglob("*.py"))
        if "qosd_sim" in path.read_text()
    ]
    assert not named


def test_qosd_demo_without_the_simulator_says_how_to_install_it() -> None:
    """As if qosd-sim were not installed: exit 2, one clear line, no traceback."""
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class NoSimulator(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "qosd_sim":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoSimulator())
        from qosd.cli import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    for command in (["demo", "--seconds", "1"], ["sim-triton", "--port", "0"]):
        done = subprocess.run(
            [sys.executable, "-c", script, *command], capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert f"qosd {command[0]} needs the simulator" in done.stderr
        assert "pip install ./clients . ./harness ./sim" in done.stderr
