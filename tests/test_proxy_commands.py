"""``qosd sim-vllm`` and ``qosd proxy`` started as written, in their own processes,
called with curl: the OpenAI API, the HTTP listener's probes and metrics, and the
daemon's gRPC listener for qosctl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from qosd_harness import start_command, stop_process


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-s", "-w", "\\n%{http_code}", *args],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip


def test_sim_vllm_and_the_proxy_start_as_written(tmp_path: Path) -> None:
    vllm, ready = start_command(
        ["sim-vllm", "--listen", "127.0.0.1:0", "--model", "llama-3-8b"], tmp_path, "vllm"
    )
    upstream = f"http://127.0.0.1:{ready['port']}"
    proxy = None
    try:
        # Every listener on port 0: the ready file says which ports they got.
        proxy, ready = start_command(
            ["proxy", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
             "--grpc-listen", "127.0.0.1:0", "--upstream", f"llama-3-8b={upstream}",
             "--log-level", "INFO"],
            tmp_path, "proxy",
        )  # fmt: skip
        base = f"http://{ready['address']}"
        http, (grpc,) = ready["http"], ready["grpc"]
        body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "one two"}],
                "max_tokens": 3}  # fmt: skip
        answer = curl(f"{base}/v1/chat/completions", "-H", "content-type: application/json",
                      "-H", "x-qos-class: P0", "-d", json.dumps(body))  # fmt: skip
        text, code = answer.stdout.rsplit("\n", 1)
        assert code == "200"
        assert json.loads(text)["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                             "total_tokens": 5}  # fmt: skip
        assert curl(f"http://{http}/healthz").stdout.endswith("200")
        assert curl(f"http://{http}/readyz").stdout.endswith("200")
        metrics = curl(f"http://{http}/metrics").stdout
        assert 'qosd_proxy_requests_total{class="P0",code="200",model="llama-3-8b"} 1.0' in metrics
        assert 'qosd_acquire_decisions_total{class="P0",decision="admitted"' in metrics
        status = subprocess.run(
            [sys.executable, "-m", "qosd.cli", "status", "-a", grpc],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        assert "pool default:" in status.stdout
        served = curl(f"{upstream}/metrics").stdout
        assert 'vllm:request_success_total{engine="0",finished_reason="length",' in served
    finally:
        if proxy is not None:
            assert stop_process(proxy) == 0
        assert stop_process(vllm) == 0
