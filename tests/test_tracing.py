"""OpenTelemetry tracing end to end: a real daemon process and a real Redis export
spans over OTLP/gRPC to a receiver this test runs, and the spans must continue the
client's trace with what qosd decided as attributes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Span, Tracer

from qosd.config import ConfigError, TracingConfig, load_config
from qosd.tracing import _resource, start_tracing, tracing_enabled
from qosd.v1 import envoy_rls_pb2
from qosd_client import LatencySample, QosdClient
from qosd_client.reporter import LatencyReporter
from qosd_client.tracing import trace_metadata
from qosd_client.v1 import qosd_pb2, qosd_pb2_grpc
from qosd_harness import (
    DaemonProcess,
    OtlpReceiver,
    RedisServer,
    daemon_processes,
    otlp_receiver,
)
from qosd_sim.experiment import simulator_process
from qosd_sim.gpu import GpuModel

ACQUIRE = "qosd.v1.QoS/Acquire"


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[OtlpReceiver, str]]:
    with otlp_receiver() as (collector, endpoint):
        yield collector, endpoint


@pytest.fixture(scope="module")
def traced_daemon(
    receiver: tuple[OtlpReceiver, str], redis_standalone: RedisServer
) -> Iterator[DaemonProcess]:
    """A daemon process on Redis, configured by its file to export to the receiver."""
    _, endpoint = receiver
    tree = {
        "redis": {"url": redis_standalone.url, "key_prefix": f"trace{uuid.uuid4().hex[:12]}"},
        "server": {"http_listen": "127.0.0.1:0"},  # the JSON API's, in the ready file
        "pools": {"llm": {"capacity_tokens_s": 10_000, "models": ["llm"]}},
        "default_pool": "llm",
        "cost": {"output_weight": 1.0},
        "classes": {
            "P0": {"priority": 0, "share": 0.6, "burst_s": 0.5},
            # P2's bucket holds 500 tokens and refills at 1,000/s: easy to empty.
            "P2": {
                "priority": 2,
                "share": 0.1,
                "burst_s": 0.5,
                "max_wait_ms": 3_000,
                "can_borrow": False,
            },
        },
        "tracing": {
            "enabled": True,
            "endpoint": endpoint,
            "resource_attributes": {"deployment.environment": "test"},
        },
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within the test's patience
        with daemon_processes(tree) as (daemon,):
            yield daemon


def _client_tracer() -> Tracer:
    """The gateway's own tracer: spans only in memory, so the test knows their ids."""
    return TracerProvider(resource=Resource({"service.name": "gateway"})).get_tracer("gateway")


def _ids(span: Span) -> tuple[str, str]:
    context = span.get_span_context()
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


async def test_acquire_and_release_spans_continue_the_callers_trace(
    receiver: tuple[OtlpReceiver, str], traced_daemon: DaemonProcess
) -> None:
    collector, _ = receiver
    tracer = _client_tracer()
    async with QosdClient(traced_daemon.address) as qos:
        with tracer.start_as_current_span("gateway.request") as parent:
            result = await qos.acquire(
                "P0", 120, model="llm", expected_output_tokens=30, tenant="acme",
                request_id="req-trace-1",
            )  # fmt: skip
            await qos.release(result.lease_id, input_tokens=120, output_tokens=10)
    trace_id, parent_id = _ids(parent)

    (acquire,) = collector.wait_for(name=ACQUIRE, trace_id=trace_id)
    assert acquire.parent_id == parent_id  # a child of the gateway's span
    assert acquire.kind == 2  # SPAN_KIND_SERVER
    assert acquire.attributes["rpc.system"] == "grpc"
    assert acquire.attributes["qosd.class"] == "P0"
    assert acquire.attributes["qosd.tenant"] == "acme"
    assert acquire.attributes["qosd.model"] == "llm"
    assert acquire.attributes["qosd.pool"] == "llm"
    assert acquire.attributes["qosd.request_id"] == "req-trace-1"
    assert acquire.attributes["qosd.decision"] == "admitted"
    assert acquire.attributes["qosd.reason"] == "NONE"
    assert acquire.attributes["qosd.cost_tokens"] == 150.0  # 120 in + 30 out expected
    assert acquire.attributes["qosd.wait_ms"] == 0
    assert acquire.attributes["qosd.lease_id"] == result.lease_id
    assert acquire.attributes["qosd.retry_after_ms"] == 0
    assert acquire.resource["service.name"] == "qosd"
    assert acquire.resource["deployment.environment"] == "test"
    assert acquire.resource["service.instance.id"]

    # The Redis round trip is a child of the Acquire span.
    (store,) = collector.wait_for(name="qosd.store/acquire", parent_id=acquire.span_id)
    assert store.trace_id == trace_id
    assert store.kind == 3  # SPAN_KIND_CLIENT
    assert store.attributes["db.system.name"] == "redis"

    (release,) = collector.wait_for(name="qosd.v1.QoS/Release", trace_id=trace_id)
    assert release.parent_id == parent_id
    assert release.attributes["qosd.lease_id"] == result.lease_id
    assert release.attributes["qosd.actual_input_tokens"] == 120
    assert release.attributes["qosd.cost_tokens"] == 130.0  # 120 in + 10 out settled
    assert release.attributes["qosd.adjustment_tokens"] == -20.0
    assert collector.wait_for(name="qosd.store/release", parent_id=release.span_id)


async def test_json_api_calls_continue_the_callers_trace(
    receiver: tuple[OtlpReceiver, str], traced_daemon: DaemonProcess
) -> None:
    """An Acquire over the JSON API with a traceparent header is a child of the
    caller's span, with the attributes a gRPC Acquire's span has."""
    collector, _ = receiver
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    answer = await asyncio.to_thread(
        subprocess.run,
        ["curl", "-s", "-X", "POST", f"http://{traced_daemon.ready['http']}/v1/acquire",
         "-H", f"traceparent: 00-{trace_id}-{parent_id}-01",
         "-d", '{"qos_class": "P0", "model": "llm", "input_tokens": 40, "tenant": "json"}'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(answer.stdout)["decision"] == "DECISION_ADMITTED"
    (acquire,) = collector.wait_for(name=ACQUIRE, trace_id=trace_id)
    assert acquire.parent_id == parent_id
    assert acquire.attributes["qosd.tenant"] == "json"
    assert acquire.attributes["qosd.decision"] == "admitted"


async def test_waits_rejections_and_errors_are_in_the_trace(
    receiver: tuple[OtlpReceiver, str], traced_daemon: DaemonProcess
) -> None:
    collector, _ = receiver
    tracer = _client_tracer()
    async with QosdClient(traced_daemon.address) as qos:
        with tracer.start_as_current_span("drain-p2"):
            await qos.acquire("P2", 500, model="llm", max_wait_ms=0)  # empties P2's bucket
        with tracer.start_as_current_span("rejected") as rejected_parent:
            rejected = await qos.acquire("P2", 400, model="llm", max_wait_ms=0)
        with tracer.start_as_current_span("queued") as queued_parent:
            queued = await qos.acquire("P2", 300, model="llm", max_wait_ms=2_000)
        channel = grpc.aio.insecure_channel(traced_daemon.address)
        with (
            tracer.start_as_current_span("invalid") as invalid_parent,
            pytest.raises(grpc.aio.AioRpcError),
        ):
            await qosd_pb2_grpc.QoSStub(channel).Acquire(
                qosd_pb2.AcquireRequest(qos_class="P9", model="llm", input_tokens=5),
                metadata=trace_metadata(),
            )
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        await channel.close()
    assert not rejected.admitted and rejected.retry_after_s > 0
    assert queued.admitted and queued.waited_s > 0

    trace_id, _ = _ids(rejected_parent)
    (span,) = collector.wait_for(name=ACQUIRE, trace_id=trace_id)
    assert span.attributes["qosd.decision"] == "rejected"
    assert span.attributes["qosd.reason"] == "RATE_LIMITED"
    assert span.attributes["qosd.retry_after_ms"] == round(rejected.retry_after_s * 1000) > 0
    assert span.status_code == 0  # a policy answer is not an error

    trace_id, _ = _ids(queued_parent)
    (span,) = collector.wait_for(name=ACQUIRE, trace_id=trace_id)
    (room,) = collector.wait_for(name="qosd.waiting_room", parent_id=span.span_id)
    assert room.attributes["qosd.class"] == "P2"
    assert room.attributes["qosd.decision"] == "admitted"
    assert room.attributes["qosd.wait_ms"] == span.attributes["qosd.wait_ms"] > 0

    trace_id, _ = _ids(invalid_parent)
    (span,) = collector.wait_for(name=ACQUIRE, trace_id=trace_id)
    # The caller's mistake: the status code says so; the span status stays UNSET, as
    # the RPC conventions ask of a server; qosd.error says what was wrong.
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert span.status_code == 0
    assert span.attributes["qosd.class"] == "P9"
    assert "P9" in span.attributes["qosd.error"]
    # Health probes are not traced: they would bury the requests.
    assert not [s for s in collector.spans if "grpc.health" in s.name]


async def test_reported_latencies_join_the_requests_trace(
    receiver: tuple[OtlpReceiver, str], traced_daemon: DaemonProcess
) -> None:
    """gateway → qosd → model server → report, in one trace: the gateway passes its
    context to the (simulated) Triton server, which reports the request's latencies
    with it, and qosd puts them in that trace."""
    collector, _ = receiver
    tracer = _client_tracer()
    with simulator_process(GpuModel(speed=4.0), qosd_target=traced_daemon.address) as simulated:
        address = simulated.grpc
        async with (
            QosdClient(traced_daemon.address) as qos,
            triton.InferenceServerClient(address) as model_server,
        ):
            with tracer.start_as_current_span("gateway.request") as parent:
                lease = await qos.acquire("P0", 200, model="llm", expected_output_tokens=8)
                tensors = []
                for name, value in (("input_tokens", 200), ("output_tokens", 8)):
                    tensor = triton.InferInput(name, [1], "INT32")
                    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
                    tensors.append(tensor)
                # The gateway passes its trace context on, as to a real Triton server.
                await model_server.infer(
                    "llm",
                    tensors,
                    parameters={"qos_class": "P0", "lease_id": lease.lease_id},
                    headers=dict(trace_metadata() or ()),
                )
                await qos.release(lease.lease_id, output_tokens=8)
            trace_id, parent_id = _ids(parent)
            (sample,) = collector.wait_for(name="qosd.report_sample", trace_id=trace_id)
    assert sample.parent_id == parent_id
    assert sample.attributes["qosd.class"] == "P0"
    assert sample.attributes["qosd.lease_id"] == lease.lease_id
    assert sample.attributes["qosd.output_tokens"] == 8
    assert sample.attributes["qosd.ttft_ms"] > 0
    assert sample.attributes["qosd.status"] == "OK"
    # Linked to the Report call that delivered it (a trace of its own).
    ((link_trace, link_span),) = sample.links
    (report,) = collector.wait_for(name="qosd.v1.QoS/Report", span_id=link_span)
    assert report.trace_id == link_trace != trace_id
    assert report.attributes["qosd.samples_accepted"] >= 1


async def test_envoy_rls_calls_are_traced_like_acquires(
    receiver: tuple[OtlpReceiver, str], traced_daemon: DaemonProcess
) -> None:
    collector, _ = receiver
    tracer = _client_tracer()
    request = envoy_rls_pb2.RateLimitRequest(domain="llm", hits_addend=7)
    request.descriptors.add().entries.add(key="qos_class", value="P0")
    async with grpc.aio.insecure_channel(traced_daemon.address) as channel:
        call = channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            request_serializer=envoy_rls_pb2.RateLimitRequest.SerializeToString,
            response_deserializer=envoy_rls_pb2.RateLimitResponse.FromString,
        )
        with tracer.start_as_current_span("envoy") as parent:
            answer = await call(request, metadata=trace_metadata(), timeout=5)
    assert answer.overall_code == envoy_rls_pb2.RateLimitResponse.OK
    trace_id, parent_id = _ids(parent)
    name = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    (span,) = collector.wait_for(name=name, trace_id=trace_id)
    assert span.parent_id == parent_id
    assert span.attributes["qosd.class"] == "P0"
    assert span.attributes["qosd.envoy.domain"] == "llm"
    assert span.attributes["qosd.envoy.hits"] == 7
    assert span.attributes["qosd.decision"] == "admitted"
    assert span.attributes["qosd.cost_tokens"] == 7.0


async def test_the_console_exporter_prints_spans() -> None:
    """tracing.exporter: console, for a look without a collector; flushed on SIGTERM."""
    tree = {"tracing": {"enabled": True, "exporter": "console"}}
    with daemon_processes(tree) as (daemon,):
        async with QosdClient(daemon.address) as qos:
            await qos.acquire("P1", 10, tenant="console")
        assert daemon.terminate() == 0
        printed = (daemon.directory / "qosd.log").read_text()
    assert '"name": "qosd.v1.QoS/Acquire"' in printed
    assert '"qosd.tenant": "console"' in printed


async def test_the_reporter_takes_the_current_span(
    receiver: tuple[OtlpReceiver, str], traced_daemon: DaemonProcess
) -> None:
    collector, _ = receiver
    tracer = _client_tracer()
    async with (
        QosdClient(traced_daemon.address) as qos,
        LatencyReporter(qos, flush_interval_s=0.05) as reporter,
    ):
        with tracer.start_as_current_span("served") as parent:
            reporter.record(LatencySample("llm", "P0", ttft_ms=120.0, e2e_ms=900.0))
        # A malformed traceparent is ignored, not refused: the sample still counts.
        reporter.record(LatencySample("llm", "P0", ttft_ms=1.0, traceparent="00-zz-zz-01"))
    assert reporter.stats.sent == 2 and reporter.stats.refused == 0
    trace_id, parent_id = _ids(parent)
    (sample,) = collector.wait_for(name="qosd.report_sample", trace_id=trace_id)
    assert sample.parent_id == parent_id
    assert sample.attributes["qosd.ttft_ms"] == 120.0
    assert "qosd.tpot_ms" not in sample.attributes


async def test_otel_environment_alone_turns_tracing_on_and_sampling_follows_the_caller(
    receiver: tuple[OtlpReceiver, str], redis_standalone: RedisServer
) -> None:
    """No tracing section at all: the standard variables configure everything."""
    collector, endpoint = receiver
    tree = {"redis": {"url": redis_standalone.url, "key_prefix": f"env{uuid.uuid4().hex[:12]}"}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        patch.setenv("OTEL_SERVICE_NAME", "qosd-sidecar")
        patch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=gateway-0")
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        with daemon_processes(tree) as (daemon,):
            sampled = _client_tracer()
            unsampled = TracerProvider(sampler=ALWAYS_OFF).get_tracer("gateway")
            async with QosdClient(daemon.address) as qos:
                with unsampled.start_as_current_span("not-sampled") as dropped:
                    await qos.acquire("P1", 10)
                with sampled.start_as_current_span("sampled") as kept:
                    await qos.acquire("P1", 10)
            trace_id, _ = _ids(kept)
            (span,) = collector.wait_for(name=ACQUIRE, trace_id=trace_id)
            assert span.resource["service.name"] == "qosd-sidecar"
            assert span.resource["k8s.pod.name"] == "gateway-0"
            # The caller chose not to sample: qosd records nothing of that trace.
            dropped_trace, _ = _ids(dropped)
            assert not collector.wait_for(timeout_s=0.5, trace_id=dropped_trace)


def test_when_tracing_is_on() -> None:
    off, on, auto = TracingConfig(enabled=False), TracingConfig(enabled=True), TracingConfig()
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    assert not tracing_enabled(auto, {})
    assert tracing_enabled(auto, endpoint)
    assert tracing_enabled(auto, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"})
    assert not tracing_enabled(auto, {**endpoint, "OTEL_SDK_DISABLED": "true"})
    assert not tracing_enabled(on, {"OTEL_SDK_DISABLED": "true"})  # the SDK would no-op
    assert not tracing_enabled(auto, {**endpoint, "OTEL_TRACES_EXPORTER": "none"})
    assert not tracing_enabled(off, endpoint)
    assert tracing_enabled(on, {})
    assert start_tracing(auto, "d1", {}) is None


def test_resource_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    resource = _resource(TracingConfig(), "d1").attributes
    assert resource["service.name"] == "qosd" and resource["service.instance.id"] == "d1"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7,team=ml")
    resource = _resource(TracingConfig(), "d1").attributes
    assert resource["service.name"] == "from-env"
    assert resource["service.instance.id"] == "pod-7" and resource["team"] == "ml"
    configured = TracingConfig(service_name="from-config", resource_attributes={"team": "infra"})
    resource = _resource(configured, "d1").attributes
    assert resource["service.name"] == "from-config" and resource["team"] == "infra"


def test_bad_tracing_config_is_refused(tmp_path: Any) -> None:
    path = tmp_path / "qosd.yaml"
    path.write_text("tracing:\n  sample_ratio: 1.5\n  exporter: zipkin\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, env={})
    message = str(error.value)
    assert "tracing.sample_ratio" in message and "tracing.exporter" in message
    assert load_config(env={"QOSD_TRACING_ENABLED": "true"}).tracing.enabled is True
