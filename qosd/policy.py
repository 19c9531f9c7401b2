"""Resolved policy: what each budget call needs to know of a pool and its classes.

``qosd.config`` is the schema of the file (validated, with defaults and bounds);
this module turns it into the frozen, precomputed records that the stores, the
waiting room and the SLO loop take, so that none of them depends on the schema.
``resolve_pools`` is the one place that maps one to the other. The policy at the
admitted rate the SLO loop sets (floors first, then the shares in priority order,
the rest shared) is derived where it is enforced, in the scripts (``lua/pool/allocation.lua``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qosd.model import new_lease_token

if TYPE_CHECKING:
    from qosd.config import Config, PoolConfig

#: On chunked servers that serve the top class first and cap one prompt's tokens per
#: pass, what each prompt in prefill costs a new top-class prompt beside it, times the
#: new prompt's own prefill: its chunk of every pass the new one needs, as long as the
#: new one's chunk where the two are as deep, about three times where it is deep in a
#: long prompt (lua/pool/budget.lua: predict.top_wait_until; docs/adr/0013). On
#: Mooncake 1.5x chunked-priority (development seeds 1 to 10), 2 and 3 gave P0 186 and
#: 185 requests on time of 240, against 178 with the backlog counted whole; on bursty
#: 1.5x (seeds 4 to 10), 1,163 and 1,169 of 2,280, against 1,148.
SHARED_PASS_STRETCH = 3.0


def tenant_digest(tenant: str) -> str:
    """A tenant's name in the store: 16 hex digits of its BLAKE2b hash. Fixed length
    and key-safe whatever the name, and carried in the lease id, so that whichever
    daemon settles a lease finds the tenant's counter without another lookup."""
    return hashlib.blake2b(tenant.encode(), digest_size=8).hexdigest()


def lease_token(cls: ClassPolicy, tenant: str) -> str:
    """A new lease's token; in a class that shares by tokens it ends in ``-`` and its
    tenant's digest (``tenant_of_lease`` reads it back)."""
    token = new_lease_token()
    return f"{token}-{tenant_digest(tenant)}" if cls.fair else token


def tenant_of_lease(lease_id: str) -> str | None:
    """The tenant digest a lease id carries; None for a lease of a first-come class."""
    token = lease_id.rpartition(":")[2]
    head, dash, digest = token.rpartition("-")
    return digest if dash and head else None


@dataclass(frozen=True, slots=True)
class FairShares:
    """A class whose tenants share it by tokens (``fairness: vtc``): what a request
    charges its tenant's counter, per unit of the tenant's weight, and how long an
    idle tenant's counter is kept (config.FairnessConfig)."""

    idle_ms: int
    input_weight: float
    output_weight: float
    default_weight: float
    weights: Mapping[str, float] = field(default_factory=dict)  # by tenant digest

    def weight(self, digest: str) -> float:
        """The tenant's weight: its share of the class relative to the others'."""
        return self.weights.get(digest, self.default_weight)

    def per_token(self, digest: str) -> tuple[float, float]:
        """The charge of one prompt token and of one output token to this tenant."""
        weight = self.weight(digest)
        return self.input_weight / weight, self.output_weight / weight

    def charge(self, digest: str, input_tokens: int, output_tokens: int) -> float:
        per_input, per_output = self.per_token(digest)
        return per_input * input_tokens + per_output * output_tokens


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """A class's resolved parameters in one pool: everything a budget call needs."""

    pool: str
    name: str
    priority: int
    rank: int  # 0 for the highest-priority class, then 1, 2, ...
    weight: float
    rate: float  # assured tokens per second
    burst: float  # bucket capacity, tokens
    max_cost: float  # largest admissible cost; > burst means borrowing is allowed
    max_wait_ms: int
    can_borrow: bool
    max_queue: int
    aging_ms: int
    tenant_rate: float  # tokens per second one tenant may use; 0: no tenant limit
    tenant_burst: float
    floor_rate: float  # what the SLO loop leaves the class however far it cuts
    burst_s: float  # burst in seconds of rate; 0 when burst_tokens fixes it
    tenant_share: float  # tenant_max_share, 0 when none
    fair: FairShares | None = None  # None: the class's waiters go first come, first served


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    """A pool's resolved budget: its classes in priority order and its shared tokens.

    As configured; the scripts derive the policy at the admitted rate the SLO
    loop sets, which is what the stores enforce.
    """

    name: str
    capacity: float  # tokens per second
    classes: tuple[ClassPolicy, ...]
    burst_s: float  # shared tokens hold this many seconds of the admitted rate
    min_capacity: float  # bounds of the admitted rate, tokens per second
    max_capacity: float
    # The in-flight bound at the admitted rate (configured, scaled by the SLO loop's
    # cuts); 0: none. Either set makes the pool GPU-gated (PoolConfig).
    max_in_flight: float = 0.0
    max_in_flight_tokens: float = 0.0
    top_reserve: float = 0.0  # of the bound, for the top class alone
    # How long the top class's peak demand counts towards its reserve (half-life);
    # 0: the reserve is top_reserve alone.
    top_peak_half_life_us: int = 0
    prefill_backlog_us: float = 0.0  # most predicted prefill ahead of an admission
    # The prefill clock runs at this share of real time (max_prefill_share): below the
    # top class, an admission needs the clock within prefill_backlog_us.
    prefill_share: float = 1.0
    # The servers' own load (PoolConfig): -1 / 0: not used.
    max_server_waiting: int = -1
    max_kv_cache_usage: float = 0.0
    server_load_max_age_us: int = 5_000_000
    # The servers serve the top class's prompts first (PoolConfig).
    servers_by_priority: bool = False
    # And chunk prefill under a cap on one prompt's tokens per pass, so the prompts in
    # prefill share every pass (vLLM V1 with --long-prefill-token-threshold): what each
    # costs a new top-class prompt beside it, times its own prefill
    # (SHARED_PASS_STRETCH); 0: prompts are prefilled one after another.
    shared_pass_stretch: float = 0.0
    # A request's cost per expected output token, before its class weight
    # (CostConfig; the rule itself is the scripts': formulas.lua formula.cost).
    output_weight: float = 0.0
    # Servers that prefill oldest first: the most of the time prompts below the top
    # class may keep its next prompt waiting past prefill_backlog_us (1.0: no limit).
    top_blocked_share: float = 1.0  # no limit, where no config says (tests' policies)
    top_blocked_burst_us: int = 0  # of blocked time, spent at once after a quiet spell
    # The servers the pool's prompts are spread over, each taking the next from the
    # earliest free (PoolConfig.servers): so many prefill clocks.
    servers: int = 1

    @property
    def gated(self) -> bool:
        return self.max_in_flight > 0 or self.max_in_flight_tokens > 0


def _prefill_backlog_ms(config: Config, pool: PoolConfig) -> float:
    """The pool's prefill-backlog bound (PoolConfig.max_prefill_backlog_ms); 0: none.

    By default the top class's base TTFT objective less its max wait (at least half
    the objective): a top-class request admitted at the end of its max wait, behind
    the whole backlog, still starts its prefill within its objective. (With the whole
    objective as the bound, on the bursty Azure replay at 1.5x, 21 % of the P0
    requests admitted were late, all by waiting for the backlog to drain to 500 ms
    and then waiting behind 500 ms of it; with 300 ms, 0.5 %, and 46.6 % of offered P0
    on time against 38.1 %.)"""
    if pool.max_prefill_backlog_ms is not None:
        return pool.max_prefill_backlog_ms
    top = min(config.classes.values(), key=lambda c: c.priority)
    ttft = top.slo.ttft_ms or 0.0
    return max(ttft - top.max_wait_ms, ttft / 2)


def resolve_pools(config: Config) -> dict[str, PoolPolicy]:
    """Precomputes every pool's policy so the hot path does dict lookups only."""
    ordered = sorted(config.classes.items(), key=lambda item: item[1].priority)
    shares = config.fairness
    fair = FairShares(
        idle_ms=math.ceil(shares.idle_s * 1000),
        input_weight=shares.input_weight,
        output_weight=shares.output_weight,
        default_weight=shares.default_weight,
        weights={tenant_digest(t): w for t, w in shares.tenant_weights.items()},
    )
    pools: dict[str, PoolPolicy] = {}
    for pool_name, pool in config.pools.items():
        classes: list[ClassPolicy] = []
        for rank, (class_name, cls) in enumerate(ordered):
            rate = cls.share * pool.capacity_tokens_s
            burst = cls.burst_tokens or cls.burst_s * rate
            tenant_rate = (cls.tenant_max_share or 0.0) * pool.capacity_tokens_s
            classes.append(
                ClassPolicy(
                    pool=pool_name,
                    name=class_name,
                    priority=cls.priority,
                    rank=rank,
                    weight=cls.weight,
                    rate=rate,
                    burst=burst,
                    max_cost=max(burst, cls.max_cost_tokens or burst),
                    max_wait_ms=cls.max_wait_ms,
                    can_borrow=cls.can_borrow,
                    max_queue=cls.max_queue,
                    aging_ms=cls.aging_ms,
                    tenant_rate=tenant_rate,
                    tenant_burst=tenant_rate * cls.burst_s,
                    floor_rate=cls.floor_share * pool.capacity_tokens_s,
                    burst_s=0.0 if cls.burst_tokens else cls.burst_s,
                    tenant_share=cls.tenant_max_share or 0.0,
                    fair=fair if cls.fairness == "vtc" else None,
                )
            )
        floors = sum(c.floor_rate for c in classes)
        control = config.control
        pools[pool_name] = PoolPolicy(
            name=pool_name,
            capacity=pool.capacity_tokens_s,
            classes=tuple(classes),
            burst_s=pool.burst_s,
            min_capacity=max(control.min_capacity * pool.capacity_tokens_s, floors),
            max_capacity=control.max_capacity * pool.capacity_tokens_s,
            max_in_flight=float(pool.max_in_flight or 0),
            max_in_flight_tokens=pool.max_in_flight_tokens or 0.0,
            top_reserve=pool.top_reserve,
            top_peak_half_life_us=int(pool.top_reserve_half_life_s * 1_000_000),
            prefill_backlog_us=_prefill_backlog_ms(config, pool) * 1000,
            prefill_share=pool.max_prefill_share,
            max_server_waiting=-1 if pool.max_server_waiting is None else pool.max_server_waiting,
            max_kv_cache_usage=pool.max_kv_cache_usage or 0.0,
            server_load_max_age_us=pool.server_load_max_age_ms * 1000,
            servers_by_priority=pool.servers_schedule_by_priority,
            shared_pass_stretch=(
                SHARED_PASS_STRETCH
                if pool.servers_schedule_by_priority and pool.chunked_prefill
                else 0.0
            ),
            output_weight=config.cost.output_weight,
            top_blocked_share=pool.max_top_blocked_share,
            top_blocked_burst_us=round(pool.top_blocked_burst_s * 1_000_000),
            servers=pool.servers or 1,
        )
    return pools


def class_in(pool: PoolPolicy, name: str) -> ClassPolicy:
    for cls in pool.classes:
        if cls.name == name:
            return cls
    raise KeyError(name)
