"""Configuration: one YAML file, overridden by environment variables, then by flags.

The file is validated as a whole on load, so a daemon never starts half-configured:
a bad value stops start-up with a message that names the field path and the reason
(`classes.P1.share: Input should be less than or equal to 1`). Precedence, lowest first:
built-in defaults < YAML file < ``QOSD_*`` environment variables < command-line flags.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# Names end up inside Redis keys and lease ids, so they must not contain the hash-tag
# braces, the key separator ':' or whitespace.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
_NAME_RE = re.compile(NAME_PATTERN)
#: The most servers one pool's prefill clocks count (each clock is kept in its state).
MAX_POOL_SERVERS = 256


class ConfigError(ValueError):
    """Raised for any configuration problem; the message is meant for an operator."""


class FailMode(StrEnum):
    """What Acquire answers when the shared store cannot be reached in time."""

    OPEN = "open"  # admit, marked REASON_FAIL_OPEN: availability over protection
    CLOSED = "closed"  # reject with REASON_BACKEND_UNAVAILABLE: protection over availability


class RedisMode(StrEnum):
    STANDALONE = "standalone"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"  # the master that Redis Sentinel names, followed on failover


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SloConfig(_Strict):
    """Latency objectives of a class; a request attains its SLO when it meets all set.

    The TTFT objective grows with the prompt: ``ttft_ms`` (the base) plus
    ``ttft_ms_per_1k_tokens`` for every 1,000 prompt tokens beyond
    ``ttft_free_tokens``. ``qosd.control.windows.request_objectives`` is the one place that
    applies the rule (and a request's own objectives, which replace the class's).
    """

    ttft_ms: Annotated[float, Field(gt=0)] | None = None
    tpot_ms: Annotated[float, Field(gt=0)] | None = None
    e2e_ms: Annotated[float, Field(gt=0)] | None = None
    # Allowance added to the TTFT objective per 1,000 prompt tokens beyond
    # ttft_free_tokens, ms: the long prompt's own prefill. 0: the same for any length.
    ttft_ms_per_1k_tokens: Annotated[float, Field(ge=0, le=86_400_000)] = 0.0
    # Prompt tokens the base objective already covers.
    ttft_free_tokens: Annotated[int, Field(ge=0, le=2**40)] = 4096

    @model_validator(mode="after")
    def _allowance_needs_a_base(self) -> SloConfig:
        if self.ttft_ms_per_1k_tokens > 0 and self.ttft_ms is None:
            raise ValueError(
                "ttft_ms_per_1k_tokens needs ttft_ms, the objective of a prompt of up to "
                "ttft_free_tokens tokens"
            )
        return self


class ClassConfig(_Strict):
    """One QoS class. Its bucket in each pool refills at ``share x pool capacity``.

    The share is assured: no other class can take it. What the class leaves unused
    overflows into the pool's shared tokens, which classes that may borrow use in
    priority order (docs/design.md, "Budgets").
    """

    priority: Annotated[int, Field(ge=0, le=15)]
    weight: Annotated[float, Field(gt=0, le=1000)] = 1.0
    share: Annotated[float, Field(gt=0, le=1)]
    burst_s: Annotated[float, Field(gt=0, le=3600)] = 0.5
    burst_tokens: Annotated[float, Field(gt=0)] | None = None
    max_cost_tokens: Annotated[float, Field(gt=0)] | None = None
    # Longest a request of this class may wait for budget; every class has one.
    max_wait_ms: Annotated[int, Field(ge=0, le=3_600_000)] = 0
    # May take the pool's shared (unused) tokens when its own share runs out.
    can_borrow: bool = True
    # Most requests of this class that may wait in one pool, fleet-wide.
    max_queue: Annotated[int, Field(ge=0, le=100_000)] = 1_000
    # A waiter moves up one priority rank for each aging_ms it waits (0: never).
    aging_ms: Annotated[int, Field(ge=0, le=3_600_000)] = 0
    # Most of the pool's capacity one tenant of this class may use (None: no limit).
    tenant_max_share: Annotated[float, Field(gt=0, le=1)] | None = None
    # The share the class keeps however far the SLO loop cuts the pool (a fraction of
    # the configured capacity); None: a quarter of its share.
    min_share: Annotated[float, Field(ge=0, le=1)] | None = None
    # How the class's waiters take turns: "fifo", by due time (arrival plus the TTFT
    # objective, docs/design.md "Admission by deadline"); "vtc", fair shares by tokens
    # among its tenants, fleet-wide: the request that would leave its tenant served
    # least per unit of weight goes first (the Virtual Token Counter, by finish tags;
    # top-level `fairness`).
    fairness: Literal["fifo", "vtc"] = "fifo"
    slo: SloConfig = SloConfig()

    @property
    def floor_share(self) -> float:
        return self.share / 4 if self.min_share is None else min(self.min_share, self.share)


class PoolConfig(_Strict):
    """A group of model servers that share one GPU budget."""

    capacity_tokens_s: Annotated[float, Field(gt=0, le=1e9)]
    models: list[str] = Field(default_factory=list)
    # How much unused capacity the shared tokens hold, in seconds of capacity.
    burst_s: Annotated[float, Field(gt=0, le=3600)] = 0.5
    # What the pool's servers can run at once, fleet-wide: leases in flight (admitted,
    # not yet released) may not exceed this many requests, nor this many prompt plus
    # expected output tokens (their KV cache, as estimated at Acquire). Typically the
    # servers' batch slots (vLLM max_num_seqs) and KV cache, summed over the pool.
    # Setting either makes the pool *GPU-gated*: within the bound admission is
    # work-conserving, a class short of tokens is admitted over its share when nobody
    # of better standing waits, and the token buckets decide who gets the next free
    # slot (docs/design.md). The SLO loop's cuts of the admitted rate shrink the bound
    # in proportion. None: no bound, the token buckets alone decide.
    max_in_flight: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    max_in_flight_tokens: Annotated[float, Field(gt=0, le=1e12)] | None = None
    # The part of that bound only the top class (P0) may use: its requests wait at
    # most a fraction of a second, and a full pool frees a slot only as a request
    # ends, so P0 arrivals must find room at once.
    top_reserve: Annotated[float, Field(ge=0, lt=1)] = 0.05
    # The reserve also follows the top class's recent peak demand (its requests in
    # flight plus waiting, at their highest, decaying by this half-life): classes below
    # it leave free what the top class held at its peak less what it holds now, up to
    # half the bound, so that the next burst of top-class requests finds room as the
    # last one did. 0: the fixed top_reserve alone.
    top_reserve_half_life_s: Annotated[float, Field(ge=0, le=3600)] = 60.0
    # The pool's servers chunk prefill (vLLM --enable-chunked-prefill, Sarathi): a long
    # prompt does not stall running streams, but the prompts behind it start after it
    # (chunks go oldest first), so the SLO loop learns which prompts would delay the
    # top class's first tokens too long, from its TTFT slack alone, and they wait for
    # a gap. False: from TTFT and TPOT slack (an unchunked prefill stalls every
    # stream). The prefill backlog bound below holds either way.
    chunked_prefill: bool = False
    # Until the SLO loop has learned a long-prefill threshold from reports (and
    # whenever it cannot), prompts longer than this wait for a gap in the top class's
    # traffic; e.g. the prompt whose prefill alone takes the top class's TTFT
    # objective on these servers. None: no rule before one is learned.
    long_prefill_tokens: Annotated[float, Field(gt=0, le=1e12)] | None = None
    # The servers' prefill, as measured on an idle one: a prompt of n tokens takes
    # c + a·n + b·n² ms, given as [c, a, b] (one lone request at each of a few prompt
    # lengths, e.g. vLLM's `bench latency --output-len 1`, fitted). The SLO loop
    # uses it whenever it has not learned its own from reports (before it has 20,
    # or once they age out): without a model nothing predicts prefill, so no backlog
    # bound, deadline refusal or prefill share holds, and on traffic of long prompts
    # that was the first minute of a run (docs/adr/0013). None: no model until then.
    prefill_model_ms: (
        tuple[
            Annotated[float, Field(ge=0, le=1e6)],
            Annotated[float, Field(gt=0, le=1e3)],
            Annotated[float, Field(ge=0, le=1e3)],
        ]
        | None
    ) = None
    # A GPU-gated pool: admit while the prompts already admitted would be prefilled
    # within this long (on a chunked server a backlog of prompts fills every pass, and
    # every stream's time per output token grows with it), by the prefill time the
    # SLO loop learns from reports (qosd/control/prefill.py), so that requests queue in qosd, in
    # priority order, rather than at the servers, first come first served. None: the
    # top class's base TTFT objective less its max wait, at least half the objective
    # (no such bound if it has none).
    max_prefill_backlog_ms: Annotated[float, Field(gt=0, le=86_400_000)] | None = None
    # Of the servers' time, the share prompts from classes below the top one may
    # keep busy with prefill, on average over the backlog bound: on an unchunked
    # server every stream waits through each prefill, so a stream's time per output
    # token is about the decode step / (1 - the prefill share). With a decode step of
    # ~25 ms at a full batch, 0.5 keeps it near 50 ms through a burst of prompts; the
    # top class's own prompts are bounded by the backlog alone (its requests then
    # wait behind at most max_prefill_backlog_ms of prefill). 1.0: no share.
    max_prefill_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    # Servers that prefill oldest first (not servers_schedule_by_priority): a prompt
    # of a class below the top one whose prefill outlasts the backlog bound keeps
    # every top-class prompt that arrives meanwhile from starting on time. While the
    # top class has traffic, such prompts may do that for at most this share of the
    # time, as a bucket of blocked time: it fills at this share of real time, up to
    # top_blocked_burst_s, and a prompt goes when the bucket holds its prefill past
    # the bound (or is full); shorter prompts go as before. About this share of the
    # top class's requests is what the lower classes' long prompts cost it, and the
    # bucket lets the prompts that block it least go first. On long-context traffic
    # (Mooncake 1.5x, chunked, development seeds) 0.2 raised P0 from 54.5 to 65.8 %
    # of offered and P2 from 52 to 77 %, for 0.02 of goodput (docs/adr/0013). 1.0:
    # no limit.
    max_top_blocked_share: Annotated[float, Field(gt=0, le=1)] = 0.2
    top_blocked_burst_s: Annotated[float, Field(ge=0, le=3_600)] = 3.0
    # The pool's servers schedule by the priority the gateway passes on
    # (AcquireResponse.server_priority; vLLM --scheduling-policy priority) and, if they
    # chunk prefill, cap one prompt's tokens per pass (vLLM
    # --long-prefill-token-threshold), so a top-class prompt starts behind the top
    # class's own prefill, not behind every prompt admitted before it. qosd then
    # predicts the top class's start, its deadline refusals and its backlog bound from
    # the top class's prefill alone. Long prompts still wait for a gap in its traffic:
    # a started prompt's chunks lengthen every pass its streams decode in.
    servers_schedule_by_priority: bool = False
    # How many servers the pool's traffic is spread over, each taking its next prompt
    # from the one with the least prefill ahead (`qosd proxy` routes so; a gateway
    # that balances by queue depth or KV load, as llm-d's and Dynamo's routers do,
    # about so). qosd then predicts a prompt's start by the earliest free of that
    # many prefill clocks, and lets the servers' time be that many times real time
    # (docs/adr/0015). None: 1, except behind `qosd proxy`, which counts the pool's
    # upstreams.
    servers: Annotated[int, Field(ge=1, le=MAX_POOL_SERVERS)] | None = None
    # A GPU-gated pool whose servers report their own load (ReportRequest.loads, from
    # `qosd triton-scrape` or a server-side reporter): classes below the top one are
    # not admitted while the requests the servers hold waiting, summed over them,
    # exceed max_server_waiting, or while any server's KV cache usage is at or above
    # max_kv_cache_usage. Leases count what qosd admitted; the servers know what
    # they really hold (other traffic, requests longer than estimated, a slow
    # replica). None: not used. Reads older than server_load_max_age_ms are ignored.
    max_server_waiting: Annotated[int, Field(ge=0, le=10_000_000)] | None = None
    max_kv_cache_usage: Annotated[float, Field(gt=0, le=1)] | None = None
    server_load_max_age_ms: Annotated[int, Field(ge=100, le=600_000)] = 5_000


class WaitingConfig(_Strict):
    # How often a daemon with waiters looks for grants (and admits heads itself).
    poll_ms: Annotated[int, Field(ge=1, le=1_000)] = 5
    # Waiters of a daemon not heard from for this long are dropped (a dead replica):
    # 100 missed polls. As long as redis.retry_interval_ms, the waiting room's patience
    # with a failing store, so a daemon cut off from Redis loses its waiters no sooner
    # than it answers them by the fail mode anyway.
    stale_after_ms: Annotated[int, Field(ge=50, le=600_000)] = 500


def readable_file(value: str | None) -> str | None:
    """A path that must name a readable file, or None (an empty string is None)."""
    if value in (None, ""):
        return None
    assert value is not None
    if not os.access(value, os.R_OK) or not os.path.isfile(value):
        raise ValueError(f"{value!r} is not a readable file")
    return value


FileSignature = tuple[int, int, int, int]


def file_signature(path: str) -> FileSignature:
    """What changes when a file is replaced or rewritten (device, inode, size, mtime),
    through symlinks: a Kubernetes Secret or ConfigMap volume swaps one on update."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class RedisTlsConfig(_Strict):
    """TLS to Redis beyond what a ``rediss://`` URL says: a private CA and a client
    certificate (Redis's ``tls-auth-clients``). Files are PEM, read at start, e.g.
    from a mounted Kubernetes Secret. Set here, each wins over the URL's
    ``ssl_ca_certs``, ``ssl_certfile`` and ``ssl_keyfile``."""

    # The CAs that sign the server's certificate; None: the system's trust store.
    ca_file: str | None = None
    # A client certificate and its key, for servers that require one.
    cert_file: str | None = None
    key_file: str | None = None
    # False: no certificate or host name check at all (a test server only; the URL's
    # ssl_cert_reqs=none says the same).
    verify: bool = True

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        return readable_file(value)

    @model_validator(mode="after")
    def _pair(self) -> RedisTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class RedisConfig(_Strict):
    url: str | None = None
    # Wins over a password in the URL; from a Kubernetes Secret through
    # $QOSD_REDIS_PASSWORD, so the URL in a ConfigMap carries none. Never printed.
    password: SecretStr | None = None
    # A Redis 6+ ACL user; wins over a user in the URL. None: the URL's, or "default".
    username: str | None = None
    mode: RedisMode = RedisMode.STANDALONE
    key_prefix: str = "qosd"
    timeout_ms: Annotated[int, Field(ge=1, le=60_000)] = 100
    connect_timeout_ms: Annotated[int, Field(ge=1, le=60_000)] = 250
    # The most commands in flight from this daemon to one node (in a cluster: to all
    # of them); each takes a connection of its own, and more wait within their
    # timeout. A pool's batches take at most three at a time.
    connections_per_node: Annotated[int, Field(ge=1, le=64)] = 16
    # After a failure, calls fail fast for this long before one probe tries again,
    # so an outage costs one timeout per interval instead of one per request.
    retry_interval_ms: Annotated[int, Field(ge=0, le=60_000)] = 500
    # With a rediss:// URL: a private CA, a client certificate (RedisTlsConfig).
    tls: RedisTlsConfig | None = None
    # Cluster mode: more nodes ("host:port") to read the topology from when the URL's
    # node is down, e.g. at a start after a failover; asked in this order.
    cluster_seeds: list[str] = Field(default_factory=list)
    # Sentinel mode: the sentinels ("host:port"), asked in this order for the master
    # named sentinel_master. The url then gives only the master's scheme (TLS),
    # credentials and db; its host is not used.
    sentinels: list[str] = Field(default_factory=list)
    sentinel_master: str | None = None
    # The sentinels' own credentials (sentinel requirepass or an ACL user there);
    # None: sentinels that ask for none.
    sentinel_username: str | None = None
    sentinel_password: SecretStr | None = None
    # TLS to the sentinels; None: as the url's scheme says for the master (rediss://:
    # TLS). Set for sentinels that differ from the master, e.g. TLS on the data port
    # and plain sentinels; with TLS they take the tls files (CA, client certificate).
    sentinel_tls: bool | None = None
    # How often the sentinels are asked whether the master moved, besides at once on
    # a lost connection or a READONLY; 0: only then. Off the request path.
    sentinel_check_interval_ms: Annotated[int, Field(ge=0, le=60_000)] = 1_000

    @field_validator("cluster_seeds", "sentinels")
    @classmethod
    def _seeds(cls, value: list[str]) -> list[str]:
        for seed in value:
            parse_host_port(seed)
        return value

    @field_validator("sentinel_master", "username", "sentinel_username")
    @classmethod
    def _no_blanks(cls, value: str | None) -> str | None:
        # Sentinel names and ACL user names are single words in the protocol.
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ValueError("must be non-empty, without whitespace")
        return value

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        assert value is not None
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> RedisConfig:
        if (
            self.tls is not None
            and not (self.url or "").startswith("rediss://")
            and not self.sentinel_tls
        ):
            raise ValueError("tls: needs a rediss:// url (or sentinel_tls: true)")
        return self

    @model_validator(mode="after")
    def _seeds_need_cluster(self) -> RedisConfig:
        if self.cluster_seeds and self.mode is not RedisMode.CLUSTER:
            raise ValueError("cluster_seeds: only with mode: cluster")
        return self

    @model_validator(mode="after")
    def _sentinel_settings(self) -> RedisConfig:
        sentinel = self.mode is RedisMode.SENTINEL
        if not sentinel:
            for name in ("sentinels", "sentinel_master", "sentinel_username",
                         "sentinel_password", "sentinel_tls"):  # fmt: skip
                if getattr(self, name) not in (None, []):
                    raise ValueError(f"{name}: only with mode: sentinel")
            return self
        if not self.sentinels:
            raise ValueError("sentinels: mode: sentinel needs at least one HOST:PORT")
        if self.sentinel_master is None:
            raise ValueError("sentinel_master: mode: sentinel needs the master's name")
        if (self.url or "").startswith("unix://"):
            raise ValueError("url: mode: sentinel needs redis:// or rediss://")
        return self

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(f"must match {NAME_PATTERN}")
        return value


class LeaseConfig(_Strict):
    # A lease never released expires after this long; its estimated charge stands.
    ttl_s: Annotated[float, Field(ge=0.001, le=86_400)] = 300.0
    # How long a lease is remembered after its TTL, so that a repeated Release gets
    # the first answer and a late one gets "expired" rather than "unknown".
    tombstone_s: Annotated[float, Field(ge=1, le=86_400)] = 120.0


class CostConfig(_Strict):
    # cost = (input_tokens + output_weight * output_tokens) * class weight. The seed's
    # rule charges the prompt only (prefill is what stalls a GPU): output_weight 0.
    # Set 1 to budget input-plus-output tokens, the unit of pool capacity.
    output_weight: Annotated[float, Field(ge=0, le=100)] = 0.0


class FairnessConfig(_Strict):
    """What a tenant of a class with ``fairness: vtc`` is charged, and its weight.

    A request charges ``(input_weight x prompt tokens + output_weight x expected output
    tokens) / the tenant's weight`` when it is admitted or queued (the paper's w_p and
    w_q: an output token costs about twice a prompt token)."""

    input_weight: Annotated[float, Field(ge=0, le=100)] = 1.0
    output_weight: Annotated[float, Field(ge=0, le=100)] = 2.0
    # Tenant -> weight: a tenant of weight 2 gets twice the tokens of one of weight 1
    # while both wait. Tenants not named get default_weight.
    tenant_weights: dict[str, Annotated[float, Field(gt=0, le=1e6)]] = Field(default_factory=dict)
    default_weight: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    # A tenant's counter is forgotten this long after its last charge (it then comes
    # back where the backlogged tenants stand, as it would anyway), so that many
    # tenants leave no state behind.
    idle_s: Annotated[float, Field(ge=1, le=86_400)] = 600.0


class LimitsConfig(_Strict):
    max_request_tokens: Annotated[int, Field(ge=1, le=2**40)] = 10_000_000
    max_report_batch: Annotated[int, Field(ge=1, le=1_000_000)] = 10_000
    max_message_bytes: Annotated[int, Field(ge=1024, le=256 * 2**20)] = 4 * 2**20


class ReportConfig(_Strict):
    window_size: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    # Samples older than this are left out of compliance (None: only the count bounds).
    max_age_s: Annotated[float, Field(gt=0, le=86_400)] | None = 300.0


class ControlConfig(_Strict):
    """The SLO loop: one leader per fleet retunes each pool's admitted rate.

    docs/control.md states the law and shows it stable against a simulated server.
    """

    enabled: bool = True
    # How often the leader looks at the windows, and the least time between changes.
    interval_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    cooldown_s: Annotated[float, Field(ge=0, le=3600)] = 5.0
    # Compliance: aim at target; grow only at target + margin or better, cut below
    # tolerance, hold between.
    target: Annotated[float, Field(gt=0, lt=1)] = 0.99
    margin: Annotated[float, Field(ge=0, lt=1)] = 0.005
    tolerance: Annotated[float, Field(gt=0, lt=1)] = 0.95
    # Relative steps: a cut; the largest growth, and the smallest a failed probe
    # halves it to.
    step_up: Annotated[float, Field(gt=0, le=0.5)] = 0.05
    step_down: Annotated[float, Field(gt=0, le=0.5)] = 0.10
    min_step: Annotated[float, Field(gt=0, le=0.5)] = 0.005
    # Near the known ceiling, growth waits this many cooldowns of good evidence; a
    # failed probe doubles the wait (up to this), a probe that held halves it.
    max_probe_wait: Annotated[int, Field(ge=1, le=10_000)] = 8
    # Growth needs the requests started within this long (and since the last change)
    # to meet target + margin.
    growth_window_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # A window needs this many samples since the last change to decide anything.
    min_samples: Annotated[int, Field(ge=1, le=1_000_000)] = 50
    # Grow only while the pool uses this much of its current rate (no windup at idle).
    min_utilization: Annotated[float, Field(ge=0, le=1)] = 0.8
    # Grow only while 95 % of each class's requests ran within this fraction of their
    # objectives (WindowStats.tail_pressure): room for the next step's load before
    # anyone misses. Compliance alone sees nothing until requests miss, and then a
    # failed probe has cost the top class its misses. 1.0: compliance alone.
    grow_headroom: Annotated[float, Field(gt=0, le=1)] = 0.85
    # Cut, as on low compliance, once 95 % of a class's requests no longer run within
    # this fraction of their objectives: at a saturated server latencies bunch up
    # (every stream shares one decode step), so the tail reaches the objective
    # together, and waiting for misses is waiting too long. Between grow_headroom
    # and cut_pressure the rate holds. Above 1: compliance alone.
    cut_pressure: Annotated[float, Field(gt=0, le=10)] = 0.95
    # In a GPU-gated pool, the decode model the loop learns (qosd/control/decode.py)
    # keeps every stream in flight within this fraction of its class's TPOT
    # objective: prompts below the top class are admitted at the prefill share that
    # leaves that much, and no new stream while the step alone would pass it. The
    # prediction is a mean over a stream's life, and prompts come in bursts that the
    # streams admitted before them did not see: the margin is for both (at 1.0, on
    # bursty traffic, the top class lost 6 points of its requests on time to TPOT).
    tpot_target: Annotated[float, Field(gt=0, le=1)] = 0.8
    # Bounds of the admitted rate, as fractions of the configured capacity.
    min_capacity: Annotated[float, Field(gt=0, le=100)] = 0.2
    max_capacity: Annotated[float, Field(gt=0, le=100)] = 2.0
    # The leader holds a lease this long and renews it every interval.
    leader_lease_s: Annotated[float, Field(ge=0.1, le=600)] = 3.0

    @model_validator(mode="after")
    def _consistent(self) -> ControlConfig:
        if not self.tolerance < self.target <= self.target + self.margin < 1:
            raise ValueError("needs tolerance < target and target + margin < 1")
        if self.min_capacity > 1 or self.max_capacity < 1:
            raise ValueError("needs min_capacity <= 1 <= max_capacity")
        if self.grow_headroom >= self.cut_pressure:
            raise ValueError("grow_headroom must be below cut_pressure (a band to hold in)")
        if self.min_step > self.step_up:
            raise ValueError("min_step must not exceed step_up")
        if self.leader_lease_s < 2 * self.interval_s:
            raise ValueError(
                "leader_lease_s must be at least twice interval_s (the leader renews it "
                "every turn, and a turn takes time)"
            )
        return self


class ServerTlsConfig(_Strict):
    """TLS on the TCP gRPC listeners and the HTTP listener (unix sockets stay plain:
    the file system guards them). PEM files, re-read when they change on disk, as
    cert-manager rotates a mounted Secret: new connections get the new certificate,
    open ones keep theirs."""

    cert_file: str | None = None
    key_file: str | None = None
    # Set: every TCP gRPC client must present a certificate this CA signed (mTLS).
    # grpcio offers no "request but do not require"; see docs/security.md.
    client_ca_file: str | None = None

    @field_validator("cert_file", "key_file", "client_ca_file")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        return readable_file(value)

    @model_validator(mode="after")
    def _complete(self) -> ServerTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("client_ca_file needs cert_file and key_file (mTLS is TLS first)")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


LOOPBACK_HOSTS = frozenset({"localhost", "::1", "[::1]"})


def is_local_address(address: str) -> bool:
    """A unix socket, or a TCP address only this host can reach (127.0.0.0/8, ::1)."""
    parsed = parse_listen_address(address)
    if parsed.unix_path is not None:
        return True
    host = parsed.target.rpartition(":")[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


# More workers than this is a typo (a port number?), not a machine.
MAX_WORKERS = 256


class ServerConfig(_Strict):
    listen: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    # The admin listener: the Admin service (status and the control RPCs PinRate and
    # UnpinRate) for whoever can reach it, with no credentials, so only a unix socket
    # or a loopback address. On `listen`, control RPCs need `auth.control`.
    admin_listen: list[str] = Field(default_factory=list)
    tls: ServerTlsConfig = ServerTlsConfig()
    # SIGTERM: stop taking calls at once, give in-flight calls this long, then exit.
    drain_grace_s: Annotated[float, Field(ge=0, le=600)] = 10.0
    # HTTP for kubelet probes (/healthz, /readyz); None: no HTTP listener.
    http_listen: str | None = None
    # An HTTP connection (this listener's, and qosd proxy's) that has not sent a whole
    # request head this long after it opened, or sits idle this long between
    # requests, is closed. Above the idle timeout of what connects to it (a load
    # balancer reusing a connection the server just closed gets a 502): 75 s is over
    # AWS ALB's and nginx-ingress's 60 s; behind GCP's load balancer (600 s) set 620.
    http_idle_timeout_s: Annotated[float, Field(ge=1, le=3_600)] = 75.0
    # How often the daemon checks that it can answer as configured (store reachable,
    # or fail-open), which is what gRPC health and /readyz report.
    health_check_interval_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    # Daemon processes serving the same addresses (SO_REUSEPORT), each a complete
    # daemon on the shared store: an integer, or "auto" (one per CPU this process may
    # use). One process is one core; more need Redis (qosd.workers, deployment.md).
    workers: int | Literal["auto"] = 1

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("needs at least one address")
        for address in value:
            parse_listen_address(address)
        return value

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object, info: ValidationInfo) -> object:
        """An integer (a digit string from ``--workers`` or ``$QOSD_WORKERS`` too) or
        "auto". Several workers cannot share a unix socket: SO_REUSEPORT is for TCP and
        UDP only, and a second bind would replace the first's socket file."""
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if value != "auto" and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORKERS
        ):
            raise ValueError(
                f"must be an integer from 1 to {MAX_WORKERS}, or 'auto' (got {value!r})"
            )
        unix = [a for a in info.data.get("listen", []) if parse_listen_address(a).unix_path]
        if value != 1 and unix:
            raise ValueError(
                f"{value!r} workers cannot share the unix socket {unix[0]} (server.listen): "
                "SO_REUSEPORT shares TCP ports only. Run one worker on a unix socket, or "
                "listen on TCP"
            )
        return value

    @field_validator("admin_listen")
    @classmethod
    def _admin_listen(cls, value: list[str]) -> list[str]:
        for address in value:
            if not is_local_address(address):
                raise ValueError(
                    f"{address!r}: the admin listener takes no credentials, so it must be "
                    "a unix socket or a loopback address (127.0.0.1, ::1, localhost)"
                )
        return value

    @field_validator("http_listen")
    @classmethod
    def _http_listen(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        if parse_listen_address(value).unix_path is not None:
            raise ValueError("HTTP listens on HOST:PORT only")
        return value


class CallerRule(_Strict):
    """Who may call a group of RPCs on the shared listeners: a bearer token (the
    ``authorization: Bearer ...`` metadata, compared in constant time with the
    file's content, re-read when the file changes), or an mTLS client certificate
    whose identity (a URI or DNS subject alternative name, or else the common name)
    is listed. Either one admits. Neither set: see each group."""

    token_file: str | None = None
    identities: list[str] = Field(default_factory=list)

    @field_validator("token_file")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        path = readable_file(value)
        if path is not None and not Path(path).read_text().strip():
            raise ValueError(f"{path!r} holds no token")
        return path

    @field_validator("identities")
    @classmethod
    def _identities(cls, value: list[str]) -> list[str]:
        for identity in value:
            if not identity.strip() or identity != identity.strip():
                raise ValueError(f"{identity!r}: an identity is a non-empty name, unpadded")
        return value

    @property
    def configured(self) -> bool:
        return self.token_file is not None or bool(self.identities)


class AuthConfig(_Strict):
    """Authorization on the shared listeners (`server.listen`). Health and
    reflection are always open (probes use them)."""

    # PinRate and UnpinRate: anything that changes the fleet's shared state. Not
    # configured: refused on the shared listeners, served on `server.admin_listen`.
    control: CallerRule = CallerRule()
    # Acquire, Release, Report, ShouldRateLimit and GetStatus. Not configured: open
    # to whoever reaches the listener (the sidecar's loopback, a NetworkPolicy).
    qos: CallerRule = CallerRule()


def _default_classes() -> dict[str, ClassConfig]:
    return {
        "P0": ClassConfig(
            priority=0,
            share=0.60,
            max_wait_ms=200,
            # 200 ms per 1,000 prompt tokens beyond 4,096 covers a long prompt's own
            # prefill (docs/configuration.md, "Objectives that scale with the prompt").
            slo=SloConfig(ttft_ms=500, tpot_ms=50, ttft_ms_per_1k_tokens=200),
        ),
        "P1": ClassConfig(
            priority=1,
            share=0.35,
            # Below the TTFT objective: a request admitted after waiting longer than
            # that has missed it already (benchmarks/qos_replay.py showed P1 at 48 %
            # attainment under overload with 3 s).
            max_wait_ms=1_000,
            slo=SloConfig(ttft_ms=2_000, tpot_ms=100, ttft_ms_per_1k_tokens=200),
        ),
        "P2": ClassConfig(priority=2, share=0.05, max_wait_ms=30_000, aging_ms=5_000),
    }


def _default_pools() -> dict[str, PoolConfig]:
    return {"default": PoolConfig(capacity_tokens_s=100_000)}


class LogFormat(StrEnum):
    TEXT = "text"  # for people at a terminal
    JSON = "json"  # one object per line, with trace and span ids, for log pipelines


class LoggingConfig(_Strict):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: LogFormat = LogFormat.TEXT

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


class TracingExporter(StrEnum):
    OTLP = "otlp"  # OTLP over gRPC, to a collector (the usual choice)
    CONSOLE = "console"  # spans as JSON on stdout, for a look without a collector


class TracingConfig(_Strict):
    """OpenTelemetry tracing. Every unset field falls back to the standard ``OTEL_*``
    variable for it, then to the SDK's default, so a pod spec that sets
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` and ``OTEL_SERVICE_NAME`` for every container gets
    qosd traced with no qosd-specific setting; a value written here wins over both.
    """

    # None: on when OTEL_EXPORTER_OTLP_ENDPOINT or ..._TRACES_ENDPOINT is set (and
    # OTEL_SDK_DISABLED is not true). Off costs nothing per call: no span wrapper.
    enabled: bool | None = None
    exporter: TracingExporter = TracingExporter.OTLP
    # OTLP/gRPC collector, e.g. http://otel-collector:4317 (http:// means plaintext).
    endpoint: str | None = None
    # Extra headers for the collector (authentication); OTEL_EXPORTER_OTLP_HEADERS too.
    headers: dict[str, str] = Field(default_factory=dict)
    # Fraction of new traces kept, parent-based: a caller's sampling decision always
    # wins. None: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, else keep all.
    sample_ratio: Annotated[float, Field(ge=0, le=1)] | None = None
    # None: OTEL_SERVICE_NAME, else "qosd".
    service_name: str | None = None
    # Added to OTEL_RESOURCE_ATTRIBUTES (these win on a clash), e.g. k8s.pod.name.
    resource_attributes: dict[str, str] = Field(default_factory=dict)
    # A child span per store (Redis) call inside a traced RPC.
    store_spans: bool = True


class EnvoyRlsConfig(_Strict):
    """How Envoy's rate limit service requests (``ShouldRateLimit``) map onto Acquire.

    Envoy sends descriptors: lists of key/value entries built by its rate limit
    actions (headers, remote address, generic keys). qosd reads the entries of all
    descriptors of a request as one map and makes one admission decision for it.
    """

    enabled: bool = True
    # Domains qosd decides for; others are answered OK (not limited), as
    # envoyproxy/ratelimit answers descriptors it has no limit for. Empty: every domain.
    domains: list[str] = Field(default_factory=list)
    # Descriptor entry keys that carry the class, tenant and model (the model picks
    # the pool, as AcquireRequest.model does).
    class_key: str = "qos_class"
    tenant_key: str = "tenant"
    model_key: str = "model"
    # Values Envoy sends mapped to class names, e.g. {"realtime": "P0"}.
    class_aliases: dict[str, str] = Field(default_factory=dict)
    # Class for requests without a class entry; None: they are refused (OVER_LIMIT
    # with x-qosd-reason INVALID_REQUEST).
    default_class: str | None = None
    # An entry whose value is the request's cost in tokens (e.g. a header with the
    # prompt's token count); None or absent: hits_addend × tokens_per_hit.
    cost_key: str | None = "tokens"
    tokens_per_hit: Annotated[float, Field(gt=0, le=1e9)] = 1.0
    # Envoy's filter gives up after 20 ms by default: answer at once unless told.
    max_wait_ms: Annotated[int, Field(ge=0, le=3_600_000)] = 0
    # There is no Release in this protocol: leases end on their own this soon.
    lease_ttl_ms: Annotated[int, Field(ge=1, le=86_400_000)] = 1_000


class PriorityRange(_Strict):
    """Dynamo request priorities from ``min`` to ``max`` (either open), and their class."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    min: int | None = None
    max: int | None = None
    qos_class: str = Field(alias="class")


class PeerHeadersConfig(_Strict):
    """The request headers of the peers qosd stands beside (llm-d, Dynamo), read by the
    proxy and the JSON API (and as gRPC metadata) after qosd's own (``x-qos-class``,
    ``x-qos-tenant``): docs/integrations.md. The class a header names never raises an
    API key's."""

    enabled: bool = True
    # llm-d's x-llm-d-inference-objective (and the deprecated
    # x-gateway-inference-objective): an InferenceObjective's name -> a class. Every
    # class is also its own objective name. None: {critical: P0, standard: P1,
    # sheddable: P2} (objectives named as the Inference Extension's former
    # criticalities), for those of the classes that are configured. An objective in no
    # entry falls through.
    objectives: dict[str, str] | None = None
    # Dynamo's x-dynamo-request-priority (higher is more important; below 0 counts as
    # 0, as Dynamo does), by the first range that holds it. None: 1 and above -> the
    # top class; 0 falls through.
    dynamo_priority: list[PriorityRange] | None = None


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    logging: LoggingConfig = LoggingConfig()
    tracing: TracingConfig = TracingConfig()
    redis: RedisConfig = RedisConfig()
    fail_mode: FailMode = FailMode.CLOSED
    classes: dict[str, ClassConfig] = Field(default_factory=_default_classes)
    pools: dict[str, PoolConfig] = Field(default_factory=_default_pools)
    # Pool used when a request names a model no pool lists; None: such requests fail.
    default_pool: str | None = "default"
    lease: LeaseConfig = LeaseConfig()
    cost: CostConfig = CostConfig()
    fairness: FairnessConfig = FairnessConfig()
    limits: LimitsConfig = LimitsConfig()
    report: ReportConfig = ReportConfig()
    waiting: WaitingConfig = WaitingConfig()
    control: ControlConfig = ControlConfig()
    envoy_rls: EnvoyRlsConfig = EnvoyRlsConfig()
    auth: AuthConfig = AuthConfig()
    peer_headers: PeerHeadersConfig = PeerHeadersConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if not self.classes:
            raise ValueError("classes: at least one class is required")
        for group in ("control", "qos"):
            if getattr(self.auth, group).identities and self.server.tls.client_ca_file is None:
                raise ValueError(
                    f"auth.{group}.identities: identities come from client certificates, "
                    "so they need server.tls.client_ca_file"
                )
        if self.server.workers != 1 and self.redis.url is None:
            raise ValueError(
                f"server.workers: more than one worker ({self.server.workers!r}) needs Redis "
                "(redis.url): "
                "the embedded store keeps its state in one process, so each worker would "
                "keep a budget of its own"
            )
        if not self.pools:
            raise ValueError("pools: at least one pool is required")
        for kind, names in (("classes", self.classes), ("pools", self.pools)):
            for name in names:
                if not _NAME_RE.match(name):
                    raise ValueError(f"{kind}.{name}: name must match {NAME_PATTERN}")
        rls = self.envoy_rls
        named = {"envoy_rls.default_class": rls.default_class} | {
            f"envoy_rls.class_aliases.{alias}": target
            for alias, target in rls.class_aliases.items()
        }
        peers = self.peer_headers
        named |= {f"peer_headers.objectives.{name}": target
                  for name, target in (peers.objectives or {}).items()}  # fmt: skip
        named |= {f"peer_headers.dynamo_priority[{index}].class": entry.qos_class
                  for index, entry in enumerate(peers.dynamo_priority or ())}  # fmt: skip
        for where, target in named.items():
            if target is not None and target not in self.classes:
                raise ValueError(
                    f"{where}: class {target!r} is not configured "
                    f"(classes: {', '.join(sorted(self.classes))})"
                )
        priorities = [c.priority for c in self.classes.values()]
        if len(set(priorities)) != len(priorities):
            raise ValueError("classes: every class needs a distinct priority")
        total_share = sum(c.share for c in self.classes.values())
        if total_share > 1.0 + 1e-9:
            raise ValueError(
                f"classes: shares add up to {total_share:.3f}; they are fractions of a "
                "pool's capacity and must add up to at most 1"
            )
        owner: dict[str, str] = {}
        for pool_name, pool in self.pools.items():
            for model in pool.models:
                if model in owner and owner[model] != pool_name:
                    raise ValueError(
                        f"pools.{pool_name}.models: model {model!r} is already served "
                        f"by pool {owner[model]!r}"
                    )
                owner[model] = pool_name
        if self.waiting.stale_after_ms < 4 * self.waiting.poll_ms:
            raise ValueError(
                f"waiting.stale_after_ms ({self.waiting.stale_after_ms}) must be at least 4 "
                f"times waiting.poll_ms ({self.waiting.poll_ms}), or live waiters would be "
                "taken for a dead daemon's"
            )
        if self.default_pool is not None and self.default_pool not in self.pools:
            raise ValueError(f"default_pool: no pool named {self.default_pool!r}")
        for class_name, cls in self.classes.items():
            for pool_name, pool in self.pools.items():
                burst = cls.burst_tokens or cls.burst_s * cls.share * pool.capacity_tokens_s
                if cls.max_cost_tokens is not None and cls.max_cost_tokens < burst:
                    raise ValueError(
                        f"classes.{class_name}.max_cost_tokens: {cls.max_cost_tokens:g} is "
                        f"below the burst of {burst:g} tokens in pool {pool_name!r}"
                    )
        return self


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A parsed listen address: TCP ``host:port`` or ``unix:/path``."""

    target: str  # as grpc's add_insecure_port wants it
    unix_path: str | None


def parse_host_port(
    address: str, *, port_zero: bool = False, expected: str = "HOST:PORT"
) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as (host, port); port 0 (any free
    port) only where ``port_zero``, as a listen address may have it."""
    host, sep, port = address.rpartition(":")
    lowest = 0 if port_zero else 1
    if not sep or not host or not port.isdigit() or not lowest <= int(port) <= 65535:
        raise ValueError(f"{address!r}: expected {expected}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def parse_listen_address(address: str) -> ListenAddress:
    if address.startswith("unix:"):
        path = address.removeprefix("unix:").removeprefix("//")
        if not path:
            raise ValueError(f"{address!r}: unix socket address needs a path")
        return ListenAddress(target=f"unix:{path}", unix_path=path)
    parse_host_port(address, port_zero=True, expected="HOST:PORT or unix:PATH")
    return ListenAddress(target=address, unix_path=None)


# Environment variables that override single settings, mapped to their field path.
ENV_OVERRIDES: Mapping[str, tuple[str, ...]] = {
    "QOSD_REDIS_URL": ("redis", "url"),
    "QOSD_REDIS_PASSWORD": ("redis", "password"),
    "QOSD_REDIS_USERNAME": ("redis", "username"),
    "QOSD_REDIS_MODE": ("redis", "mode"),
    "QOSD_REDIS_TIMEOUT_MS": ("redis", "timeout_ms"),
    "QOSD_REDIS_KEY_PREFIX": ("redis", "key_prefix"),
    "QOSD_REDIS_TLS_CA_FILE": ("redis", "tls", "ca_file"),
    "QOSD_REDIS_TLS_CERT_FILE": ("redis", "tls", "cert_file"),
    "QOSD_REDIS_TLS_KEY_FILE": ("redis", "tls", "key_file"),
    "QOSD_REDIS_CLUSTER_SEEDS": ("redis", "cluster_seeds"),  # comma-separated
    "QOSD_REDIS_SENTINELS": ("redis", "sentinels"),  # comma-separated
    "QOSD_REDIS_SENTINEL_MASTER": ("redis", "sentinel_master"),
    "QOSD_REDIS_SENTINEL_USERNAME": ("redis", "sentinel_username"),
    "QOSD_REDIS_SENTINEL_PASSWORD": ("redis", "sentinel_password"),
    "QOSD_REDIS_SENTINEL_TLS": ("redis", "sentinel_tls"),  # true or false
    "QOSD_FAIL_MODE": ("fail_mode",),
    "QOSD_LISTEN": ("server", "listen"),  # comma-separated
    "QOSD_DRAIN_GRACE_S": ("server", "drain_grace_s"),
    "QOSD_HTTP_LISTEN": ("server", "http_listen"),
    "QOSD_ADMIN_LISTEN": ("server", "admin_listen"),  # comma-separated
    "QOSD_WORKERS": ("server", "workers"),  # an integer or auto
    "QOSD_TLS_CERT_FILE": ("server", "tls", "cert_file"),
    "QOSD_TLS_KEY_FILE": ("server", "tls", "key_file"),
    "QOSD_TLS_CLIENT_CA_FILE": ("server", "tls", "client_ca_file"),
    "QOSD_CONTROL_TOKEN_FILE": ("auth", "control", "token_file"),
    "QOSD_QOS_TOKEN_FILE": ("auth", "qos", "token_file"),
    "QOSD_LOG_LEVEL": ("logging", "level"),
    "QOSD_LOG_FORMAT": ("logging", "format"),
    "QOSD_LEASE_TTL_S": ("lease", "ttl_s"),
    "QOSD_TRACING_ENABLED": ("tracing", "enabled"),
}


# The overrides whose value is a comma-separated list.
LIST_OVERRIDES = frozenset(
    {
        ("server", "listen"),
        ("server", "admin_listen"),
        ("redis", "cluster_seeds"),
        ("redis", "sentinels"),
    }
)


def _set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {location}: {message}")
    return "\n".join(lines)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What is wrong and where (line, column), without the file's text."""
    problem = getattr(error, "problem", None) or type(error).__name__
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return str(problem)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[tuple[str, ...], Any] | None = None,
) -> Config:
    """Loads, overrides and validates the configuration; raises ConfigError."""
    tree: dict[str, Any] = {}
    source = "built-in defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {source}: {exc.strerror}") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            # Not str(exc): it quotes the offending line, which may hold a password.
            raise ConfigError(
                f"config file {source} is not valid YAML: {_yaml_problem(exc)}"
            ) from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {source}: top level must be a mapping")
        tree = loaded
    environment = os.environ if env is None else env
    for variable, field_path in ENV_OVERRIDES.items():
        if variable in environment:
            raw: Any = environment[variable]
            if field_path in LIST_OVERRIDES:
                raw = [part.strip() for part in raw.split(",") if part.strip()]
            _set_path(tree, field_path, raw)
            source += f" + ${variable}"
    for field_path, value in (overrides or {}).items():
        _set_path(tree, field_path, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from exc
