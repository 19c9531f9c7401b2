#!/usr/bin/env python3
"""LiteLLM's proxy in front of ``qosd proxy`` in front of ``qosd sim-vllm``: shows what
reaches qosd through LiteLLM, and what comes back (docs/integrations.md, "LiteLLM").

    python scripts/litellm_chain.py [--litellm-venv DIR]

LiteLLM's model entry names qosd's proxy as its OpenAI-compatible upstream, with an
API key of qosd's (class P1) and llm-d's objective header asking for ``sheddable``
(P2, lower: allowed). It prints, from qosd's own /metrics, the class each request was
admitted in; the rate-limit headers LiteLLM's answer carries; and, for a refusal qosd
says to retry and one it says not to, how many attempts reached qosd. LiteLLM comes from PyPI into a
virtual environment of its own (``benchmarks/litellm_peer.py``; about a minute the
first time).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.litellm_peer import MASTER_KEY, litellm_proxy  # noqa: E402
from qosd_harness import start_command, stop_process  # noqa: E402

MODEL = "llm"
QOSD_KEY = "qosd-key-of-the-gateway"


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json", **headers},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            answer.read()
            return answer.status, dict(answer.headers)
    except urllib.error.HTTPError as error:
        error.read()
        return error.code, dict(error.headers)


def counters(http: str) -> dict[str, float]:
    """qosd's proxy and decision counters, from its /metrics."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as answer:
        page = answer.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(("qosd_proxy_requests_total{", "qosd_acquire_decisions_total{"))
    }


def show_refusal(
    litellm: str, body: dict[str, Any], through: dict[str, str], http: str, why: str
) -> None:
    """One request through LiteLLM that qosd refuses: what LiteLLM answered, and how
    many attempts reached qosd (LiteLLM's client reads x-should-retry)."""
    key = 'qosd_proxy_requests_total{class="P2",code="429",model="llm"}'
    before = counters(http).get(key, 0.0)
    status, headers = post(f"{litellm}/v1/chat/completions", body, through)
    shown = {k: v for k, v in headers.items()
             if "retry" in k.lower() or "qos" in k.lower()}  # fmt: skip
    attempts = counters(http).get(key, 0.0) - before
    print(
        f"refused ({why}) through LiteLLM: {status}, {attempts:.0f} attempts reached "
        f"qosd; headers: {json.dumps(shown)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--litellm-venv", type=Path, default=Path(tempfile.gettempdir()) / "litellm-venv"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        work = Path(scratch)
        config = work / "qosd.yaml"
        config.write_text(json.dumps({
            "pools": {"default": {"capacity_tokens_s": 10_000, "max_in_flight": 1,
                                  "top_reserve": 0}},
            "classes": {"P0": {"priority": 0, "share": 0.6},
                        "P1": {"priority": 1, "share": 0.35},
                        "P2": {"priority": 2, "share": 0.05, "max_wait_ms": 0,
                               "tenant_max_share": 0.0001}},
        }))  # fmt: skip
        server, ready = start_command(
            ["sim-vllm", "--listen", "127.0.0.1:0", "--model", MODEL], work, "vllm"
        )
        stack.callback(stop_process, server)
        upstream = f"http://127.0.0.1:{ready['port']}"
        proxy, proxied = start_command(
            ["proxy", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0",
             "--http-listen", "127.0.0.1:0", "--upstream", f"{MODEL}={upstream}",
             "--api-key", f"{QOSD_KEY}=P1:gateway", "--config", str(config)],
            work, "proxy",
        )  # fmt: skip
        stack.callback(stop_process, proxy)
        qosd = f"http://{proxied['address']}"
        entry = {"model_name": MODEL, "litellm_params": {
            "model": f"openai/{MODEL}", "api_base": f"{qosd}/v1", "api_key": QOSD_KEY,
            "extra_headers": {"x-llm-d-inference-objective": "sheddable"}}}  # fmt: skip
        litellm, _ = stack.enter_context(
            litellm_proxy(args.litellm_venv, {"model_list": [entry]}, work / "litellm")
        )
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        through = {"authorization": f"Bearer {MASTER_KEY}"}
        status, headers = post(f"{litellm}/v1/chat/completions", body, through)
        limits = {k: v for k, v in headers.items() if "ratelimit" in k.lower()}
        print(f"through LiteLLM: {status}; rate-limit headers: {json.dumps(limits)}")
        seen = counters(proxied["http"])
        print("qosd admitted:", {k: v for k, v in seen.items() if "admitted" in k})
        # A refusal to retry: the pool's one slot held by a stream sent to qosd directly.
        holder = urllib.request.urlopen(urllib.request.Request(
            f"{qosd}/v1/chat/completions", method="POST",
            data=json.dumps({**body, "max_tokens": 2_000, "stream": True}).encode(),
            headers={"content-type": "application/json", "authorization": f"Bearer {QOSD_KEY}"},
        ), timeout=60)  # fmt: skip
        holder.readline()
        show_refusal(litellm, body, through, proxied["http"], "the slot held")
        holder.close()
        left = 'qosd_proxy_requests_total{class="P1",code="499",model="llm"}'
        deadline = time.monotonic() + 30
        while counters(proxied["http"]).get(left, 0.0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling qosd's own count: the holder's lease has ended
        # A refusal not to retry: P2's tenant ceiling (1 token/s), which a 2,000-word
        # prompt leaves in debt for about forty minutes.
        long = {**body, "messages": [{"role": "user", "content": "word " * 2_000}]}
        status, _ = post(f"{litellm}/v1/chat/completions", long, through)
        print(f"a 2,000-word prompt through LiteLLM: {status}")
        show_refusal(litellm, long, through, proxied["http"], "the tenant's ceiling")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
