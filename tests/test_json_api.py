"""The JSON API on the daemon's HTTP listener, called with curl: the same answers,
validation and authorization as gRPC (qosd/doors/json_api.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from qosd_harness import PortReservation, spawn_on_reserved_port
from qosd_sim.vllm import SimulatedVllm, VllmSettings, vllm_runner
from tests.conftest import DaemonFactory
from tests.waiting import eventually

HTTP = {"server": {"http_listen": "127.0.0.1:0"}}


def curl(url: str, *args: str) -> tuple[int, Any]:
    """curl's answer: the HTTP status and the JSON body."""
    done = subprocess.run(
        ["curl", "-s", "-w", "\\n%{http_code}", url, *args],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    body, _, code = done.stdout.rpartition("\n")
    return int(code), json.loads(body)


async def post(base: str, path: str, body: str, *headers: str) -> tuple[int, Any]:
    options = [arg for header in headers for arg in ("-H", header)]
    return await asyncio.to_thread(curl, f"{base}{path}", "-X", "POST", "-d", body, *options)


async def test_acquire_release_report_and_status_over_json(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    base = f"http://{running.daemon.http.address}"
    code, acquired = await post(base, "/v1/acquire", json.dumps(
        {"qos_class": "P1", "model": "llama-3-8b", "inputTokens": 1200,
         "expected_output_tokens": 256, "tenant": "acme"}))  # fmt: skip
    assert code == 200 and acquired["decision"] == "DECISION_ADMITTED"
    assert acquired["pool"] == "default" and acquired["lease_id"].startswith("default:P1:")
    status = (await running.client.status()).pool("default")
    assert status.active_leases == 1
    code, settled = await post(base, "/v1/release", json.dumps(
        {"lease_id": acquired["lease_id"], "actual_input_tokens": 1000,
         "actual_output_tokens": 100}))  # fmt: skip
    assert code == 200 and settled["already_released"] is False
    assert (await running.client.status()).pool("default").active_leases == 0
    code, reported = await post(base, "/v1/report", json.dumps(
        {"samples": [{"model": "llama-3-8b", "qos_class": "P0", "ttft_ms": 120}]}))  # fmt: skip
    assert code == 200 and reported["accepted"] == 1
    code, shown = await asyncio.to_thread(curl, f"{base}/v1/status?pool=default&history=2")
    assert code == 200
    (pool,) = shown["pools"]
    assert [c["name"] for c in pool["classes"]] == ["P0", "P1", "P2"]
    assert pool["classes"][0]["latency"]["samples"] == 1


async def test_bad_input_gets_a_400_naming_the_field(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    base = f"http://{running.daemon.http.address}"
    cases = {
        '{"qos_class": "P1", "model": "m", "input_tokens": "many"}': "input_tokens",
        '{"qos_class": "P1", "model": "m", "input_tokens": 0}': "input_tokens",
        '{"qos_class": "P9", "model": "m", "input_tokens": 5}': "qos_class",
        '{"qos_klass": "P1"}': "qos_klass",
        "{not json": "AcquireRequest",
        # What protobuf's JSON parser lets by (the probe): a boolean for a number, a
        # field under both its names, a name twice.
        '{"qos_class": "P1", "model": "m", "input_tokens": 5, "slo_ttft_ms": true}':
            "slo_ttft_ms: must be a number",
        '{"qos_class": "P2", "qosClass": "P0", "model": "m", "input_tokens": 5}':
            "qos_class: given twice",
        '{"qos_class": "P2", "qos_class": "P0", "model": "m", "input_tokens": 5}':
            "'qos_class' twice",
    }  # fmt: skip
    for body, field in cases.items():
        code, error = await post(base, "/v1/acquire", body)
        assert code == 400, body
        assert error["code"] == "INVALID_ARGUMENT" and field in error["message"], error
    # An enum as a number it does not define (protobuf wraps any integer modulo 2**32),
    # or as a fraction or a boolean; and a nested message's field, named by its path.
    for body, field in (
        ('{"lease_id": "default:P1:x", "outcome": 4294967298}', "outcome: 4294967298"),
        ('{"lease_id": "default:P1:x", "outcome": 1.5}', "outcome: 1.5"),
        ('{"lease_id": "default:P1:x", "outcome": true}', "outcome: true"),
    ):
        code, error = await post(base, "/v1/release", body)
        assert code == 400 and field in error["message"], (body, error)
    sample = '{"samples": [{"qos_class": "P1", "ttft_ms": true}]}'
    code, error = await post(base, "/v1/report", sample)
    assert code == 400 and "samples.ttft_ms: must be a number" in error["message"], error
    code, error = await post(base, "/v1/release", '{"lease_id": "default:P1:nope"}')
    assert code == 404 and error["code"] == "NOT_FOUND"
    code, error = await asyncio.to_thread(curl, f"{base}/v1/status?pool=gpu-9")
    assert code == 404 and "gpu-9" in error["message"]
    # A percent-escape that is not UTF-8 (aiohttp would read it as U+FFFD): a 400.
    code, error = await asyncio.to_thread(curl, f"{base}/v1/status?tenant=%ff")
    assert code == 400 and "not UTF-8" in error["message"]


async def test_the_same_auth_as_grpc(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    """auth.qos set: no token is a 401, a wrong one a 403, the token is served; a
    control call (PinRate) is not on the JSON API at all."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    running = await make_daemon({**HTTP, "auth": {"qos": {"token_file": str(token)}}})
    assert running.daemon.http is not None
    base = f"http://{running.daemon.http.address}"
    body = '{"qos_class": "P1", "model": "m", "input_tokens": 5}'
    code, error = await post(base, "/v1/acquire", body)
    assert code == 401 and error["code"] == "UNAUTHENTICATED"
    # Before the body is read (the probe: a caller with no token had 3.8 MB parsed,
    # and got a 400): a body that is no JSON at all is a 401 too.
    code, error = await post(base, "/v1/acquire", "{not json")
    assert code == 401 and error["code"] == "UNAUTHENTICATED"
    code, error = await post(base, "/v1/acquire", body, "authorization: Bearer wrong")
    assert code == 403 and error["code"] == "PERMISSION_DENIED"
    # Two credentials, one of them right: no door picks one (the first was read).
    code, error = await post(base, "/v1/acquire", body, "authorization: Bearer s3cret",
                             "authorization: Bearer wrong")  # fmt: skip
    assert code == 403 and error["code"] == "PERMISSION_DENIED"
    code, answer = await post(base, "/v1/acquire", body, "authorization: Bearer s3cret")
    assert code == 200 and answer["decision"] == "DECISION_ADMITTED"
    status = (await asyncio.to_thread(
        subprocess.run, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                         f"{base}/v1/pin"], capture_output=True, text=True, check=True,
    )).stdout  # fmt: skip
    assert status == "404"


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_nginx_with_lua_admits_through_the_json_api(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """A real gateway with no gRPC: nginx with Debian's Lua module, in front of a
    simulated vLLM, calls Acquire in its access phase and Release after the answer
    (tests/data/nginx_qosd.conf). Admitted requests reach the server and their leases
    end; a refused one is a 429 with qosd's reason; a bad class is qosd's 400."""
    running = await make_daemon({**HTTP, "classes": {"P2": {"burst_tokens": 50}}})
    assert running.daemon.http is not None
    qosd = running.daemon.http.address
    server = SimulatedVllm(VllmSettings(port=0, model_name="llama-3-8b"))
    runner = vllm_runner(server)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.gpu.start()
    conf = (Path(__file__).parent / "data" / "nginx_qosd.conf").read_text()
    for name, value in {"DIR": str(tmp_path), "QOSD": qosd,
                        "QOSD_HOST": qosd.rpartition(":")[0], "QOSD_PORT": qosd.rpartition(":")[2],
                        "UPSTREAM": f"127.0.0.1:{runner.addresses[0][1]}"}.items():  # fmt: skip
        conf = conf.replace(f"@{name}@", value)
    reservation, nginx = await _start_nginx(tmp_path, conf)
    port = reservation.port
    try:
        base = f"http://127.0.0.1:{port}"
        body = json.dumps({"model": "llama-3-8b", "max_tokens": 3,
                           "messages": [{"role": "user", "content": "one two"}]})  # fmt: skip
        code, answer = await post(base, "/v1/chat/completions", body, "x-qos-class: P0",
                                  "content-type: application/json")  # fmt: skip
        assert code == 200 and answer["usage"]["completion_tokens"] == 3
        status = await eventually(
            lambda: running.client.status("default"),
            lambda s: s.pool("default").active_leases == 0,
        )
        assert status.pool("default").active_leases == 0
        page = (await running.daemon.metrics_page()).decode()
        assert 'qosd_releases_total{outcome="OK",result="OK"} 1.0' in page  # from the timer
        refused = await asyncio.to_thread(
            subprocess.run,
            ["curl", "-s", "-D", "-", "-o", "/dev/null", "-X", "POST", f"{base}/v1/completions",
             "-H", "x-qos-class: P2", "-d", "{}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert refused.stdout.startswith("HTTP/1.1 429")
        assert "x-qos-reason: COST_EXCEEDS_BURST" in refused.stdout
        code, error = await post(base, "/v1/completions", "{}", "x-qos-class: P9")
        assert code == 400 and "qos_class" in error["message"]
    finally:
        nginx.terminate()
        await asyncio.to_thread(nginx.wait, 10)
        reservation.close()
        await runner.cleanup()
        await server.gpu.stop()


async def _start_nginx(
    directory: Path, conf: str
) -> tuple[PortReservation, subprocess.Popen[bytes]]:
    """nginx with ``conf`` (its @PORT@ filled), on a reserved port: it cannot bind port
    0 and say which it got. Started from a thread: CPython's spawn, as run_cli does."""

    def argv_for(port: int) -> list[str]:
        (directory / "nginx.conf").write_text(conf.replace("@PORT@", str(port)))
        return ["/usr/sbin/nginx", "-p", str(directory), "-c", str(directory / "nginx.conf"),
                "-e", str(directory / "error.log")]  # fmt: skip

    nginx, reservation = await asyncio.to_thread(
        spawn_on_reserved_port, "nginx", argv_for, directory / "error.log"
    )
    return reservation, nginx
