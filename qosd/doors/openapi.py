"""``GET /openapi.json``: the OpenAPI 3.1 document of qosd's HTTP surfaces (the JSON
API and probes on the daemon's listener, the proxy's OpenAI routes), on both listeners.

The document is generated from the protobuf descriptors and the doors' own constants by
scripts/gen_openapi.py and shipped in the package, so a gateway, a client generator or a
fuzzer can read from the daemon itself the contract it runs. It is read once, when
the route is added, and served as it is on disk: the bytes the check in ``make lint``
compared with what the generator writes.
"""

from __future__ import annotations

import functools
from importlib import resources

from aiohttp import web

PATH = "/openapi.json"


@functools.cache
def document() -> bytes:
    """The document's bytes, as shipped in qosd.doors."""
    return resources.files("qosd.doors").joinpath("openapi.json").read_bytes()


async def serve(_: web.Request) -> web.Response:
    return web.Response(body=document(), content_type="application/json")


def add_route(app: web.Application) -> None:
    """Adds the route, reading the document now: one missing from the package fails
    the start, not a request."""
    document()
    app.router.add_get(PATH, serve)
