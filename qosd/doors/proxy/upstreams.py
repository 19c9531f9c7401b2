"""The model servers behind the proxy: a list per model, and which one a request goes to.

The proxy routes, so it predicts per server (docs/adr/0015). Each server's time to a
request's first token is learned from the requests the proxy sent it: about
``base + per_token·(prompt tokens ahead + its own) + per_stream·streams``, where the
tokens ahead are those of the requests sent there whose first token has not come
(their prefill, as far as the proxy knows), and the streams those in flight there.
A request that is not streamed shows no first token: it counts in prefill until its
answer. A request goes to the server predicted to give it its first token soonest: one
32K-token prompt in prefill on a server (about 2 s on an A100) sends the requests
after it to the others, where counting requests in flight sent every other one
behind it. Servers of different speeds each get their own coefficients.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from qosd.control.fit import weighted_least_squares

#: How long a server that refused a connection is passed over.
DOWN_AFTER_REFUSAL_S = 5.0
#: First tokens a server's own model needs; before, it is predicted with the others'.
MIN_SAMPLES = 16
#: The latest first tokens a server's model is fitted to (a few minutes of traffic).
SAMPLE_WINDOW = 256
#: The model is fitted again after this many new first tokens.
REFIT_EVERY = 16
#: A server's own model is trusted this long after its last first token. A model
#: that predicts a server slow sends it no traffic, so no first token would ever
#: correct it: once stale, the server is predicted with the fleet's again.
MODEL_STALE_S = 30.0
#: The least spread of prompt tokens in prefill (the largest over the smallest) a
#: fit needs: 16 first tokens at 1,000 ± 3 tokens fitted 7.4 ms a token where 0.08
#: was true.
MIN_TOKEN_SPREAD = 2.0


class Route(enum.Enum):
    """How the proxy picks among a model's servers (``qosd proxy --route``)."""

    #: The soonest predicted first token, then the fewest requests in flight.
    PREDICTED = "predicted"
    #: The fewest requests in flight, then the fewest waiting as the server last said.
    IN_FLIGHT = "in-flight"


@dataclass(frozen=True, slots=True)
class FirstTokenModel:
    """A server's time to a first token, ms: ``base + per_token·tokens + per_stream·streams``
    for ``tokens`` prompt tokens in prefill there with the request's own, and
    ``streams`` requests in flight there when it was sent."""

    base_ms: float
    per_token_ms: float
    per_stream_ms: float = 0.0

    def predict_ms(self, tokens: float, streams: float) -> float:
        return self.base_ms + self.per_token_ms * tokens + self.per_stream_ms * streams

    @classmethod
    def fitted(cls, samples: Sequence[tuple[float, float, float]]) -> FirstTokenModel | None:
        """The least-squares model of ``(tokens, streams, ms)`` samples. Every
        coefficient is a cost, never negative: the first of these fits whose are all
        at least 0 (and the tokens' above 0) is taken: with the streams, without them,
        then through the origin. None where the tokens in prefill spread too little
        to tell their cost (:data:`MIN_TOKEN_SPREAD`)."""
        tokens = [t for t, _, _ in samples]
        if not tokens or min(tokens) <= 0 or max(tokens) < MIN_TOKEN_SPREAD * min(tokens):
            return None
        for terms in ((1, 1, 1), (1, 1, 0), (0, 1, 0)):
            coefficients = weighted_least_squares(
                (1.0, [x for x, used in zip((1.0, t, s), terms, strict=True) if used], ms)
                for t, s, ms in samples
            )
            if coefficients is None:
                continue
            values = iter(coefficients)
            base, per_token, per_stream = (next(values) if used else 0.0 for used in terms)
            if base >= 0 and per_token > 0 and per_stream >= 0:
                return cls(base, per_token, per_stream)
        return None


#: Before any server has its own model: prompt tokens ahead alone order the servers.
TOKENS_ONLY = FirstTokenModel(0.0, 1.0)


@dataclass(slots=True, eq=False)
class Upstream:
    url: str  # the base URL, without /v1
    in_flight: int = 0
    #: The server's own load, from its last ORCA header (requests waiting), if any.
    waiting: float = 0.0
    #: Until when (monotonic) it is passed over: it refused a connection. A server
    #: that refuses at once keeps no request in flight, so by load alone it would be
    #: picked first, again and again.
    down_until: float = 0.0
    #: Prompt tokens of the requests sent here whose first token has not come.
    prefilling_tokens: int = 0
    #: Its own model of the time to a first token (None: not learned yet), and when
    #: (monotonic) its last first token came.
    model: FirstTokenModel | None = None
    learned_at: float = 0.0
    samples: deque[tuple[float, float, float]] = field(
        default_factory=lambda: deque(maxlen=SAMPLE_WINDOW)
    )
    _new_samples: int = 0

    def refused_connection(self) -> None:
        self.down_until = time.monotonic() + DOWN_AFTER_REFUSAL_S

    def send(self, tokens: int) -> Sent:
        """A request of ``tokens`` prompt tokens goes here: counted in flight and in
        prefill until :meth:`Sent.first_token` or :meth:`Sent.ended`."""
        sent = Sent(self, tokens, self.prefilling_tokens + tokens, self.in_flight,
                    time.monotonic())  # fmt: skip
        self.in_flight += 1
        self.prefilling_tokens += tokens
        return sent

    def learn(self, tokens: float, streams: float, ms: float) -> None:
        """One first token: ``ms`` after it was sent with ``tokens`` in prefill here
        (its own included) and ``streams`` in flight."""
        self.samples.append((tokens, streams, ms))
        self.learned_at = time.monotonic()
        self._new_samples += 1
        if len(self.samples) >= MIN_SAMPLES and (
            self.model is None or self._new_samples >= REFIT_EVERY
        ):
            self._new_samples = 0
            self.model = FirstTokenModel.fitted(self.samples) or self.model


def _fresh(server: Upstream, now: float) -> bool:
    return now - server.learned_at <= MODEL_STALE_S


def _predicted_ms(server: Upstream, tokens: int, fleet: FirstTokenModel, now: float) -> float:
    """By the server's own model while fresh, else by its fleet's (``fleet``)."""
    model = server.model if server.model is not None and _fresh(server, now) else fleet
    return model.predict_ms(server.prefilling_tokens + tokens, server.in_flight)


@dataclass(slots=True, eq=False)
class Sent:
    """One request on its way to an upstream, and what it found there."""

    upstream: Upstream
    tokens: int  # its prompt, as estimated
    tokens_in_prefill: int  # there when it went, its own included
    streams: int  # in flight there when it went
    at: float  # monotonic
    prefilled: bool = False
    done: bool = False

    def first_token(self, at: float) -> None:
        """Its first token came at ``at`` (monotonic): its prefill is over, and the
        server's model learns how long it took. Only the first call counts."""
        if self.prefilled:
            return
        self.prefilled = True
        self.upstream.prefilling_tokens -= self.tokens
        self.upstream.learn(self.tokens_in_prefill, self.streams, (at - self.at) * 1000)

    def ended(self) -> None:
        """It is over, however it ended: no longer in flight, nor in prefill (a
        request that ended with no first token teaches nothing). Only the first
        call counts."""
        if self.done:
            return
        self.done = True
        if not self.prefilled:
            self.prefilled = True
            self.upstream.prefilling_tokens -= self.tokens
        self.upstream.in_flight -= 1


@dataclass(slots=True)
class Upstreams:
    by_model: dict[str, list[Upstream]] = field(default_factory=dict)
    route: Route = Route.PREDICTED

    @classmethod
    def parse(cls, items: list[str], route: Route = Route.PREDICTED) -> Upstreams:
        """``NAME=URL`` items (repeat a name for several servers of one model)."""
        upstreams = cls(route=route)
        for item in items:
            name, sep, url = item.partition("=")
            parts = urlsplit(url)
            if not sep or not name or parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"--upstream takes NAME=http(s)://HOST:PORT, got {item!r}")
            base = url.rstrip("/").removesuffix("/v1")
            upstreams.by_model.setdefault(name, []).append(Upstream(base))
        return upstreams

    def models(self) -> list[str]:
        return list(self.by_model)

    def count(self, models: Sequence[str]) -> int:
        """How many servers each of ``models`` is spread over, the fewest of them (0:
        none is served): a prompt of one model never goes to another's servers, so
        a pool of two models counts as the smaller fleet. A URL named twice is one
        server."""
        counts = [len({s.url for s in self.by_model[model]})
                  for model in set(models) if model in self.by_model]  # fmt: skip
        return min(counts, default=0)

    def predicted_first_token_ms(self, model: str, server: Upstream, tokens: int) -> float:
        """When a request of ``tokens`` prompt tokens sent to ``server`` (of ``model``)
        now would see its first token, ms."""
        now = time.monotonic()
        return _predicted_ms(server, tokens, self._fleet_model(model, now), now)

    def _fleet_model(self, model: str, now: float) -> FirstTokenModel:
        """The mean of ``model``'s servers' fresh models; prompt tokens alone while
        none has one."""
        learned = [s.model for s in self.by_model.get(model, ())
                   if s.model is not None and _fresh(s, now)]  # fmt: skip
        if not learned:
            return TOKENS_ONLY
        n = len(learned)
        return FirstTokenModel(sum(m.base_ms for m in learned) / n,
                               sum(m.per_token_ms for m in learned) / n,
                               sum(m.per_stream_ms for m in learned) / n)  # fmt: skip

    def pick(self, model: str, avoid: Sequence[Upstream] = (), tokens: int = 0) -> Upstream | None:
        """The server of ``model`` to send a request of ``tokens`` prompt tokens to, by
        the route; one that refused a connection lately last; None for a model no
        upstream serves, or none but those to ``avoid``."""
        servers = [s for s in self.by_model.get(model, ()) if all(s is not a for a in avoid)]
        if not servers:
            return None
        now = time.monotonic()
        if len(servers) == 1 or self.route is Route.IN_FLIGHT:
            return min(servers, key=lambda s: (s.down_until > now, s.in_flight, s.waiting))
        fleet = self._fleet_model(model, now)
        return min(servers, key=lambda s: (s.down_until > now,
                                           _predicted_ms(s, tokens, fleet, now),
                                           s.in_flight, s.waiting))  # fmt: skip
