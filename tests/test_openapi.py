"""qosd/doors/openapi.json: valid OpenAPI 3.1, exactly what scripts/gen_openapi.py
writes, served on both listeners, and true of the live daemon and proxy.

The fuzz tests point schemathesis at a daemon's JSON API and at a proxy in front of
``qosd sim-vllm``, both on a real Redis, on real sockets, and run its own checks on
every answer (a documented status, content type, headers and body) plus one of ours: no
5xx at all, since the upstream and the store are healthy. Afterwards no lease may be
left in flight that its caller was not told of: the proxy settles every lease it took,
and every lease the JSON API admitted was answered to the fuzzer, which releases them.

Most fuzzed requests are refused at validation (a random class name is unknown). So
that admission, forwarding and settlement are fuzzed too, some examples are steered,
by Hypothesis itself, toward the deployment's names (its classes, its model, a prompt
within ``limits.max_request_tokens``, a lease the fuzzer holds); each such example is
still one the document allows.

Bounded and reproducible: schemathesis's coverage cases (each boundary and type
violation once), then a fixed number of derandomized Hypothesis examples per operation
and generation mode, each within a wall-clock share; a failure is reported with
schemathesis's curl command for the request.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck
from hypothesis import strategies as st
from openapi_spec_validator import OpenAPIV31SpecValidator, validate
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from qosd.config import Config
from qosd.doors.proxy.handler import ProxySettings
from qosd.doors.proxy.server import RunningProxy, start_proxy
from qosd.doors.proxy.upstreams import Upstreams
from qosd.server import Daemon, start
from qosd_harness import RedisServer
from qosd_sim.gpu import GpuModel
from qosd_sim.vllm import SimulatedVllm, VllmSettings, vllm_runner
from tests.conftest import BASE_CONFIG, TEST_REDIS_TIMEOUT_MS, merge

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT = ROOT / "qosd" / "doors" / "openapi.json"
MODEL = "llama-3-8b"  # the base config's pool serves it
CLASSES = ("P0", "P1", "P2")
#: Requests' token counts stay small, so that a simulated answer is quick to stream.
MAX_REQUEST_TOKENS = 512
#: Examples per operation and generation mode (positive: valid by the document;
#: negative: not).
MAX_EXAMPLES = 40
#: Seconds for one fuzz run (the JSON API's, or the proxy's), shared evenly among its
#: operations and modes: past its share, once it has sent MIN_SENT, a run draws its
#: remaining examples but sends none. Well above what 2 loaded CPUs need (about 5 s
#: each).
BUDGET_S = 20.0
#: The fewest examples a run must send, its share of the time spent or not: a busy
#: machine makes a run take longer, never test less (one sent 7 in its 1.7 s on a
#: machine with a core kept busy, when the share alone ended it).
MIN_SENT = 10
#: Two examples in three are steered (the simplest one is).
STEERED = st.sampled_from((True, True, False))
#: A request that takes longer has hung: a finding, not a wait.
REQUEST_TIMEOUT_S = 10.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def test_the_document_is_valid_openapi_3_1() -> None:
    validate(json.loads(DOCUMENT.read_text("utf-8")), cls=OpenAPIV31SpecValidator)


def test_the_committed_document_is_what_the_generator_writes() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_openapi.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


# -- the fuzzer -----------------------------------------------------------------------

#: Steers one generated case toward the deployment (drawing from ``data``), in place.
Steer = Callable[[Case[Any], st.DataObject], None]


@dataclass
class Findings:
    """What a fuzz run saw: statuses per operation, failures with their reproductions,
    and the leases the fuzzer was given."""

    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)  # first of each kind
    leases: list[str] = field(default_factory=list)

    def report(self) -> str:
        return "\n\n".join(self.failures.values())


def fuzz(base_url: str, tags: list[str], steer: dict[str, Steer], findings: Findings) -> None:
    """Every operation tagged ``tags`` in the document the server at ``base_url``
    serves: schemathesis's coverage cases (each boundary and type violation of every
    parameter and body, once: deterministic), then Hypothesis's positive and negative
    examples; each answer checked. Blocking: run in a thread, beside the servers'
    event loop."""
    raw = requests.get(f"{base_url}/openapi.json", timeout=REQUEST_TIMEOUT_S)
    assert raw.content == DOCUMENT.read_bytes()  # the committed document is served
    assert raw.headers["content-type"].startswith("application/json")
    schema = schemathesis.openapi.from_dict(raw.json()).include(tag=tags)
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result.err()  # every operation is well described
        operations.append(result.ok())
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    with requests.Session() as session:
        fuzzer = Fuzzer(base_url, session, findings)
        for operation in operations:
            config = schema.config.generation_for(operation=operation)
            for case in schema.iter_coverage_cases(
                operation, generation_modes=modes, generation_config=config
            ):
                fuzzer.send(case, "coverage")
        runs = [
            (operation, mode)
            for operation in operations
            for mode in modes
            # An operation that takes nothing has no negative examples.
            if mode is GenerationMode.POSITIVE or _takes_input(operation.definition.raw)
        ]
        share_s = BUDGET_S / len(runs)
        for operation, mode in runs:
            fuzzer.explore(operation, mode, steer.get(operation.label), share_s)


class Fuzzer:
    """Sends cases to one server and records what they found."""

    def __init__(self, base_url: str, session: requests.Session, findings: Findings) -> None:
        self.base_url = base_url
        self.session = session
        self.findings = findings

    def explore(
        self,
        operation: APIOperation[Any, Any, Any, Any],
        mode: GenerationMode,
        steer: Steer | None,
        share_s: float,
    ) -> None:
        """Hypothesis's examples of ``operation`` in ``mode``, within ``share_s``."""
        deadline = time.monotonic() + share_s
        least = MIN_SENT if _takes_input(operation.definition.raw) else 1

        @hypothesis.settings(
            max_examples=MAX_EXAMPLES,
            derandomize=True,  # the same examples every run: a failure reproduces
            database=None,
            deadline=None,
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode), data=st.data())
        def run(case: Case[Any], data: st.DataObject) -> None:
            # Every draw before the time check: an example that drew on one run and
            # stopped before drawing on a later one (past the deadline, as a busy
            # machine makes likely) is inconsistent data generation to Hypothesis.
            if steer is not None and data.draw(STEERED, "steered"):
                steer(case, data)
            sent = self.findings.sent[operation.label, mode.value]
            if time.monotonic() > deadline and sent >= least:
                return
            self.send(case, mode.value)

        run()
        sent = self.findings.sent[operation.label, mode.value]
        assert sent >= least, f"{operation.label} ({mode.value}): {sent} examples in {share_s} s"

    def send(self, case: Case[Any], phase: str) -> None:
        label, findings = case.operation.label, self.findings
        findings.sent[label, phase] += 1
        try:
            response = case.call(
                base_url=self.base_url, session=self.session, timeout=REQUEST_TIMEOUT_S
            )
        except requests.RequestException as exc:  # a hang or a dropped connection
            key = f"{label}: {type(exc).__name__}"
            findings.failures.setdefault(key, f"{key}: {exc}\n{case.as_curl_command()}")
            return
        findings.statuses[label, phase, response.status_code] += 1
        if label == "POST /v1/acquire" and response.status_code == 200:
            lease = response.json().get("lease_id")
            if lease:
                findings.leases.append(lease)
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:  # the checks that failed, with a curl command
            for failure in group.exceptions:
                findings.failures.setdefault(f"{label}: {failure.title}", f"{label}: {group}")


def _takes_input(definition: dict[str, Any]) -> bool:
    return "requestBody" in definition or bool(definition.get("parameters"))


def _set(case: Case[Any], name: str, value: Any, *aliases: str) -> None:
    """Sets a body field (by its .proto name), dropping its JSON-name alias, which
    would make it a second value for the same field."""
    if isinstance(case.body, dict):
        for alias in aliases:
            case.body.pop(alias, None)
        case.body[name] = value


def steer_acquire(case: Case[Any], data: st.DataObject) -> None:
    _set(case, "qos_class", data.draw(st.sampled_from(CLASSES)), "qosClass")
    _set(case, "model", data.draw(st.sampled_from([MODEL, "default"])))
    _set(case, "input_tokens", data.draw(st.integers(1, MAX_REQUEST_TOKENS + 50)), "inputTokens")
    _set(case, "expected_output_tokens", data.draw(st.integers(0, 100)), "expectedOutputTokens")
    for name, alias in (("max_wait_ms", "maxWaitMs"), ("slo_ttft_ms", "sloTtftMs")):
        if data.draw(st.booleans()):
            _set(case, name, data.draw(st.integers(0, 100)), alias)


def steer_release(leases: list[str]) -> Steer:
    def steer(case: Case[Any], data: st.DataObject) -> None:
        if leases:
            _set(case, "lease_id", data.draw(st.sampled_from(leases)), "leaseId")

    return steer


def steer_report(case: Case[Any], data: st.DataObject) -> None:
    """Samples and loads of the served model and a known class."""
    if not isinstance(case.body, dict):
        return
    for name in ("samples", "loads"):
        items = case.body.get(name)
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict):
                item["model"] = MODEL
                item.pop("qosClass", None)
                if name == "samples":
                    item["qos_class"] = data.draw(st.sampled_from(CLASSES))


def steer_status(case: Case[Any], data: st.DataObject) -> None:
    if case.query is not None:
        case.query["pool"] = data.draw(st.sampled_from(["", "default"]))


def steer_completion(case: Case[Any], data: st.DataObject) -> None:
    """The served model, a known class, an answer within the limit (or none), streamed
    or not; sometimes a prompt of words, which is too long for P2 past 50."""
    if case.headers is not None:
        case.headers["x-qos-class"] = data.draw(st.sampled_from(CLASSES))
    if not isinstance(case.body, dict):
        return
    case.body["model"] = MODEL
    case.body.pop("max_completion_tokens", None)
    case.body.pop("max_tokens", None)
    # Long streams are what a proxy is for; the fuzzer reads 20 events of a stream and
    # leaves, as a client may.
    answer = data.draw(st.sampled_from([None, MAX_REQUEST_TOKENS]) | st.integers(0, 64))
    if answer is not None:
        case.body["max_tokens"] = answer
    case.body["stream"] = data.draw(st.sampled_from((True, True, False)))
    if data.draw(st.booleans()):
        words = " ".join(["word"] * data.draw(st.integers(0, 400)))
        if "messages" in case.body:
            case.body["messages"] = [{"role": "user", "content": words}]
        else:
            case.body["prompt"] = words


# -- the servers ----------------------------------------------------------------------


def config(redis: RedisServer, extra: dict[str, Any] | None = None) -> Config:
    tree = merge(
        BASE_CONFIG,
        {
            "redis": {
                "url": redis.url,
                "mode": "standalone",
                "timeout_ms": TEST_REDIS_TIMEOUT_MS,
                "key_prefix": f"t{uuid.uuid4().hex[:12]}",
            },
            "limits": {"max_request_tokens": MAX_REQUEST_TOKENS},
            # Short waits: a fuzzed request that queues holds the fuzzer up. P2 holds 50
            # tokens and never waits: a P2 request soon after another is refused (a 429
            # at the proxy).
            "classes": {name: {"max_wait_ms": 100} for name in CLASSES}
            | {"P2": {"max_wait_ms": 0, "burst_tokens": 50}},
        },
    )
    return Config.model_validate(merge(tree, extra or {}))


async def in_flight(daemon: Daemon) -> dict[str, int]:
    """Leases in flight per pool and class, as the status service reads the store."""
    status = await daemon.status.status(daemon.admission.pool_names())
    found = {}
    for pool in status.pools:
        found[pool.name] = pool.active_leases
        found |= {f"{pool.name}/{cls.name}": cls.in_flight for cls in pool.classes}
    return found


@pytest.fixture
async def daemon(redis_standalone: RedisServer) -> AsyncIterator[Daemon]:
    started = await start(config(redis_standalone, {"server": {"http_listen": "127.0.0.1:0"}}))
    yield started
    await started.stop(0)


@pytest.fixture
async def proxy(redis_standalone: RedisServer) -> AsyncIterator[RunningProxy]:
    """A proxy in front of a simulated vLLM whose GPU is 1,000 times an A100: the
    answers are quick, the HTTP real."""
    server = SimulatedVllm(VllmSettings(port=0, model_name=MODEL, gpu=GpuModel(speed=1000.0)))
    runner = vllm_runner(server)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.gpu.start()
    try:
        settings = ProxySettings(
            upstreams=Upstreams.parse([f"{MODEL}=http://127.0.0.1:{runner.addresses[0][1]}"]),
            default_class="P1",
        )
        running = await start_proxy(config(redis_standalone), "127.0.0.1:0", settings)
        try:
            yield running
        finally:
            await running.stop()
    finally:
        await runner.cleanup()
        await server.gpu.stop()


async def test_the_json_api_under_the_fuzzer(daemon: Daemon) -> None:
    assert daemon.http is not None
    base = f"http://{daemon.http.address}"
    findings = Findings()
    steer: dict[str, Steer] = {
        "POST /v1/acquire": steer_acquire,
        "POST /v1/release": steer_release(findings.leases),
        "POST /v1/report": steer_report,
        "GET /v1/status": steer_status,
    }
    tags = ["json-api", "probes", "document"]
    await asyncio.to_thread(fuzz, base, tags, steer, findings)
    assert not findings.failures, findings.report()
    admitted = findings.statuses["POST /v1/acquire", "positive", 200]
    assert findings.leases and admitted, findings.statuses  # the admission path was fuzzed
    # Every lease the fuzzer was told of, released (a second release is harmless):
    # then none may be left in flight.
    with requests.Session() as session:
        for lease in set(findings.leases):
            answer = await asyncio.to_thread(
                session.post, f"{base}/v1/release", json={"lease_id": lease}, timeout=10
            )
            assert answer.status_code == 200, answer.text
    left = await in_flight(daemon)
    assert not any(left.values()), left


async def test_the_proxy_under_the_fuzzer(proxy: RunningProxy) -> None:
    findings = Findings()
    steer: dict[str, Steer] = {
        "POST /v1/chat/completions": steer_completion,
        "POST /v1/completions": steer_completion,
    }
    tags = ["proxy", "document"]
    await asyncio.to_thread(fuzz, f"http://{proxy.address}", tags, steer, findings)
    assert not findings.failures, findings.report()
    forwarded = sum(
        n
        for (label, _, status), n in findings.statuses.items()
        if status == 200 and "completions" in label
    )
    assert forwarded, findings.statuses  # admission, forwarding and settlement were fuzzed
    await proxy.proxy.settled()
    left = await in_flight(proxy.daemon)
    assert not any(left.values()), left
    # Nor a 5xx the fuzzer did not see: the proxy's own count of its answers (what an
    # operator's alert reads) holds none either. The fuzzer leaves a long stream after
    # 20 events, as a client may.
    page = (await proxy.daemon.metrics_page()).decode()
    errors = [
        line
        for line in page.splitlines()
        if line.startswith("qosd_proxy_requests_total") and 'code="5' in line
    ]
    assert not errors, f"the proxy counted 5xx answers (its log says why): {errors}"
