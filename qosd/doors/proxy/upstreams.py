"""The model servers behind the proxy: a list per model, and which one a request goes to.

The proxy routes, so it predicts per server (docs/adr/0015). Each server's time to a
request's first token is learned from the requests the proxy sent it: about
``base + per_token·(prompt tokens ahead + its own) + per_stream·streams``, where the
tokens ahead are those of the requests sent there whose first token has not come
(their prefill, as far as the proxy knows), and the streams those in flight there.
A request goes to the server predicted to give it its first token soonest: one
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
        """The least-squares model of ``(tokens, streams, ms)`` samples; with the
        streams left out where they would take a negative coefficient (they only slow
        a server), and None where the tokens would (too little spread to tell)."""
        full = weighted_least_squares((1.0, (1.0, t, s), ms) for t, s, ms in samples)
        if full is not None and full[1] > 0 and full[2] >= 0:
            return cls(max(0.0, full[0]), full[1], full[2])
        tokens_only = weighted_least_squares((1.0, (1.0, t), ms) for t, _, ms in samples)
        if tokens_only is not None and tokens_only[1] > 0:
            return cls(max(0.0, tokens_only[0]), tokens_only[1])
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
    #: Its own model of the time to a first token (None: not learned yet).
    model: FirstTokenModel | None = None
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
        self._new_samples += 1
        if len(self.samples) >= MIN_SAMPLES and (
            self.model is None or self._new_samples >= REFIT_EVERY
        ):
            self._new_samples = 0
            self.model = FirstTokenModel.fitted(self.samples) or self.model


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
        """How many servers serve any of ``models``."""
        return sum(len(self.by_model.get(model, ())) for model in set(models))

    def predicted_first_token_ms(self, server: Upstream, tokens: int) -> float:
        """When a request of ``tokens`` prompt tokens sent to ``server`` now would see
        its first token, ms: by the server's own model, else by the mean of its
        model's other servers' (or prompt tokens alone, while none has one)."""
        model = server.model or self._fleet_model(server)
        return model.predict_ms(server.prefilling_tokens + tokens, server.in_flight)

    def _fleet_model(self, server: Upstream) -> FirstTokenModel:
        for servers in self.by_model.values():
            if any(s is server for s in servers):
                learned = [s.model for s in servers if s.model is not None]
                if learned:
                    n = len(learned)
                    return FirstTokenModel(sum(m.base_ms for m in learned) / n,
                                           sum(m.per_token_ms for m in learned) / n,
                                           sum(m.per_stream_ms for m in learned) / n)  # fmt: skip
        return TOKENS_ONLY

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
        return min(servers, key=lambda s: (s.down_until > now,
                                           self.predicted_first_token_ms(s, tokens),
                                           s.in_flight, s.waiting))  # fmt: skip
