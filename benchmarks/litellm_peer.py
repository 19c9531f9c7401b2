"""LiteLLM's proxy, the peer the proxy benchmarks run beside qosd's: installed from PyPI
into a virtual environment of its own (its dependencies are not qosd's), configured
with a YAML file, and started as ``litellm --config FILE --port PORT``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from qosd_harness import reserve_port, stop_process

MASTER_KEY = "sk-qosd-benchmark-0123456789abcdef"


def ensure_venv(venv: Path) -> Path:
    """LiteLLM's ``litellm`` command in ``venv``, installing ``litellm[proxy]`` there
    first when it is missing (about a minute)."""
    command = venv / "bin" / "litellm"
    if not command.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True)
    return command


def version(venv: Path) -> str:
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; "
         "print(m.version('litellm'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


@contextmanager
def litellm_proxy(
    venv: Path,
    config: dict[str, Any],
    directory: Path,
    *,
    cpu: int | None = None,
    timeout_s: float = 120.0,
) -> Iterator[tuple[str, int]]:
    """A running LiteLLM proxy (one worker) with ``config``: its base URL and pid (the
    leader of its process group). ``cpu``: pinned to that CPU with taskset."""
    command = ensure_venv(venv)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "litellm.yaml"
    path.write_text(yaml.safe_dump(config))
    # LiteLLM (uvicorn) takes a port, it does not report one: a reserved one, held
    # while it runs, so that no other process takes it first or answers for it.
    reservation = reserve_port()
    port = reservation.port
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    env = {**os.environ, "LITELLM_MASTER_KEY": MASTER_KEY, "LITELLM_LOG": "ERROR"}
    with (directory / "litellm.log").open("ab") as log:
        process = subprocess.Popen(
            [*pin, str(command), "--config", str(path), "--port", str(port), "--host",
             "127.0.0.1", "--num_workers", "1"],
            stdout=log, stderr=log, env=env, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _live(url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (directory / "litellm.log").read_text()[-2000:]
                raise RuntimeError(f"LiteLLM did not start: {tail}")
            time.sleep(0.2)
        yield url, process.pid
    finally:
        stop_process(process)
        reservation.close()


def _live(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health/liveliness", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def model_entry(model: str, upstream: str, **limits: Any) -> dict[str, Any]:
    """A deployment of ``model`` at the OpenAI-compatible ``upstream`` (vLLM's
    provider), with its ``rpm`` / ``tpm`` limits if given."""
    params: dict[str, Any] = {"model": f"hosted_vllm/{model}", "api_base": f"{upstream}/v1",
                              "api_key": "none", **limits}  # fmt: skip
    return {"model_name": model, "litellm_params": params}


def as_json(value: Any) -> str:
    return json.dumps(value, indent=2)


def group_pids(leader: int) -> list[int]:
    """The processes of a process group (a proxy and any workers it forked)."""
    found = subprocess.run(
        ["pgrep", "-g", str(leader)], check=False, capture_output=True, text=True
    )
    return [int(pid) for pid in found.stdout.split()] or [leader]
