"""``qosd proxy``: its command line. Heavy imports wait until the command runs, so
``qosd --help`` stays quick."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_proxy(commands: Any) -> None:
    proxy = commands.add_parser(
        "proxy",
        help="an OpenAI-compatible admission proxy in front of vLLM and other "
        "OpenAI-compatible servers (docs/proxy.md)",
    )
    proxy.add_argument(
        "--listen", dest="openai_listen", default="127.0.0.1:8080", metavar="HOST:PORT",
        help="where the OpenAI API is served (port 0: a free one)",
    )  # fmt: skip
    proxy.add_argument(
        "--upstream", action="append", default=[], metavar="MODEL=URL",
        help="a server of MODEL, e.g. llama=http://vllm:8000 (repeat: several servers of "
        "one model, or several models)",
    )  # fmt: skip
    proxy.add_argument(
        "--default-class", metavar="CLASS",
        help="the class of requests with no x-qos-class header (default: the configured "
        "class of lowest priority)",
    )  # fmt: skip
    proxy.add_argument(
        "--priority-upstreams", action="store_true",
        help="send each request's class rank as vLLM's priority field (for servers run "
        "with --scheduling-policy priority)",
    )  # fmt: skip
    proxy.add_argument(
        "--api-key", action="append", default=[], metavar="KEY=CLASS[:TENANT]",
        help="requests with this bearer key get this class and tenant (repeatable; only "
        "the key's SHA-256 is kept; prefix with sha256: to give the digest itself). With "
        "keys, a request without a known key is refused (401/403), and x-qos-class may "
        "lower a key's class, never raise it",
    )  # fmt: skip
    proxy.add_argument(
        "--route", choices=["predicted", "in-flight"], default="predicted",
        help="how a request picks among its model's servers: predicted (default), the "
        "soonest first token each server's learned model predicts for it; in-flight, "
        "the fewest requests in flight (docs/proxy.md)",
    )  # fmt: skip
    proxy.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    proxy.add_argument(
        "--upstream-key-file", metavar="FILE",
        help="a file holding the key to show the upstreams (Authorization: Bearer); re-read "
        "when it changes. Callers' own credentials are never forwarded",
    )  # fmt: skip
    proxy.add_argument(
        "--upstream-connect-timeout", type=float, default=10.0, metavar="SECONDS",
        help="the longest a connection to an upstream may take (default 10)",
    )  # fmt: skip
    proxy.add_argument(
        "--upstream-read-timeout", type=float, default=300.0, metavar="SECONDS",
        help="the longest an upstream may go silent: between two chunks of a stream, or "
        "for a whole answer that is not streamed (default 300, the lease TTL's default)",
    )  # fmt: skip
    proxy.add_argument(
        "--client-write-timeout", type=float, default=60.0, metavar="SECONDS",
        help="the longest one write to a client may wait for it to read; a client that "
        "stops reading is taken to have left (default 60)",
    )  # fmt: skip
    proxy.add_argument(
        "--max-answer-bytes", type=int, default=64 * 1024 * 1024, metavar="N",
        help="the largest upstream answer that is not streamed (beyond: 502; default 64 MiB)",
    )  # fmt: skip
    proxy.add_argument(
        "--tokenize-path", default="/tokenize", metavar="PATH",
        help="the upstreams' route that counts a prompt's tokens (vLLM's /tokenize), asked "
        "about the first prompts of each model so that its token estimate starts right; "
        "'' never asks (default /tokenize)",
    )  # fmt: skip
    from qosd.cli import add_config_flags  # noqa: PLC0415 - cli imports this module

    add_config_flags(proxy, listen_flag="--grpc-listen")
    proxy.add_argument("--ready-file", help="write {pid, address, grpc, http} as JSON once serving")
    proxy.set_defaults(run=run_proxy)


def api_keys(items: list[str], classes: list[str]) -> dict[str, tuple[str, str]]:
    """``KEY=CLASS[:TENANT]`` items as {SHA-256 of KEY: (class, tenant)}."""
    from qosd.doors.proxy.handler import key_digest  # noqa: PLC0415 - the command imports what it runs

    keys: dict[str, tuple[str, str]] = {}
    for item in items:
        key, sep, rest = item.rpartition("=")
        qos_class, _, tenant = rest.partition(":")
        if not sep or not key or qos_class not in classes:
            raise ValueError(
                f"--api-key takes KEY=CLASS[:TENANT] with a configured class "
                f"({', '.join(classes)}); got {item.split('=')[-1]!r} after the key"
            )
        digest = key.removeprefix("sha256:") if key.startswith("sha256:") else key_digest(key)
        keys[digest] = (qos_class, tenant)
    return keys


def run_proxy(args: argparse.Namespace) -> int:
    from qosd.cli import configured  # noqa: PLC0415 - the command imports what it runs
    from qosd.doors.proxy.handler import ProxySettings  # noqa: PLC0415
    from qosd.doors.proxy.upstreams import Route, Upstreams  # noqa: PLC0415

    config = configured(args)
    if config is None:
        return 2
    classes = list(config.classes)
    try:
        upstreams = Upstreams.parse(args.upstream, Route(args.route))
        if not upstreams.by_model:
            raise ValueError("name at least one --upstream MODEL=URL")
        default_class = args.default_class or max(
            classes, key=lambda name: config.classes[name].priority
        )
        if default_class not in classes:
            raise ValueError(f"--default-class {default_class!r} is not a configured class")
        for flag, size in (("--max-body-bytes", args.max_body_bytes),
                           ("--max-answer-bytes", args.max_answer_bytes)):  # fmt: skip
            if size < 1024:
                raise ValueError(f"{flag} must be at least 1024")
        for flag, value in (("--upstream-connect-timeout", args.upstream_connect_timeout),
                            ("--upstream-read-timeout", args.upstream_read_timeout),
                            ("--client-write-timeout", args.client_write_timeout)):  # fmt: skip
            if not 0 < value <= 86_400:
                raise ValueError(f"{flag} must be above 0 and at most 86400 seconds")
        keys = api_keys(args.api_key, classes)
    except ValueError as exc:
        print(f"qosd proxy: {exc}", file=sys.stderr)
        return 2
    settings = ProxySettings(
        upstreams=upstreams,
        default_class=default_class,
        priority_upstreams=args.priority_upstreams,
        max_body_bytes=args.max_body_bytes,
        api_keys=keys,
        upstream_key_file=args.upstream_key_file,
        upstream_connect_timeout_s=args.upstream_connect_timeout,
        upstream_read_timeout_s=args.upstream_read_timeout,
        client_write_timeout_s=args.client_write_timeout,
        max_answer_bytes=args.max_answer_bytes,
        tokenize_path=args.tokenize_path,
    )
    import uvloop  # noqa: PLC0415

    from qosd.doors.proxy.server import serve_proxy  # noqa: PLC0415
    from qosd.server import StartupError  # noqa: PLC0415

    try:
        uvloop.run(serve_proxy(config, args.openai_listen, settings, args.ready_file))
    except (StartupError, OSError) as exc:
        print(f"qosd proxy: {exc}", file=sys.stderr)
        return 1
    return 0
