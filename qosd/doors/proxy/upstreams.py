"""The model servers behind the proxy: a list per model, the least busy first."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

#: How long a server that refused a connection is passed over.
DOWN_AFTER_REFUSAL_S = 5.0


@dataclass(slots=True)
class Upstream:
    url: str  # the base URL, without /v1
    in_flight: int = 0
    #: The server's own load, from its last ORCA header (requests waiting), if any.
    waiting: float = 0.0
    #: Until when (monotonic) it is passed over: it refused a connection. A server
    #: that refuses at once keeps no request in flight, so by load alone it would be
    #: picked first, again and again.
    down_until: float = 0.0

    def refused_connection(self) -> None:
        self.down_until = time.monotonic() + DOWN_AFTER_REFUSAL_S


@dataclass(slots=True)
class Upstreams:
    by_model: dict[str, list[Upstream]] = field(default_factory=dict)

    @classmethod
    def parse(cls, items: list[str]) -> Upstreams:
        """``NAME=URL`` items (repeat a name for several servers of one model)."""
        upstreams = cls()
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

    def pick(self, model: str, avoid: Sequence[Upstream] = ()) -> Upstream | None:
        """The server of ``model`` with the fewest requests in flight from here, then
        the fewest waiting as it last said, one that refused a connection lately
        last; None for a model no upstream serves, or none but those to ``avoid``."""
        servers = [s for s in self.by_model.get(model, ()) if all(s is not a for a in avoid)]
        if not servers:
            return None
        now = time.monotonic()
        return min(servers, key=lambda s: (s.down_until > now, s.in_flight, s.waiting))
