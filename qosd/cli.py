"""``qosd`` command line: ``serve``, ``demo``, ``config check``, and the operator
commands ``status``, ``pin`` and ``unpin`` (qosd.ctl)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

import uvloop

from qosd import ctl
from qosd.config import Config, ConfigError, load_config
from qosd.demo import run_demo
from qosd.server import StartupError, serve


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (default: built-in defaults)")
    parser.add_argument(
        "--listen",
        action="append",
        metavar="ADDR",
        help="HOST:PORT or unix:PATH; repeat for several (overrides server.listen)",
    )
    parser.add_argument("--redis-url", help="redis://HOST:PORT/DB; omit for the embedded store")
    parser.add_argument("--redis-mode", choices=["standalone", "cluster"])
    parser.add_argument("--fail-mode", choices=["open", "closed"])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[tuple[str, ...], Any] = {}
    if args.listen:
        overrides[("server", "listen")] = args.listen
    if args.redis_url:
        overrides[("redis", "url")] = args.redis_url
    if args.redis_mode:
        overrides[("redis", "mode")] = args.redis_mode
    if args.fail_mode:
        overrides[("fail_mode",)] = args.fail_mode
    return load_config(args.config, overrides=overrides)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qosd", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser("serve", help="run the admission daemon")
    _add_config_flags(serve_cmd)
    serve_cmd.add_argument("--ready-file", help="write {pid, addresses} as JSON here once serving")

    demo = commands.add_parser(
        "demo", help="start a daemon and replay a trace sample against it, printing decisions"
    )
    _add_config_flags(demo)
    demo.add_argument("--seconds", type=float, default=14.0, help="how long to replay")
    demo.add_argument("--speedup", type=float, default=30.0, help="trace time compression")

    check = commands.add_parser("config", help="configuration tools").add_subparsers(
        dest="config_command", required=True
    )
    check_cmd = check.add_parser("check", help="validate a config file and print it resolved")
    check_cmd.add_argument("path")
    ctl.add_commands(commands)

    args = parser.parse_args(argv)
    if args.command in ("status", "pin", "unpin"):
        return ctl.run(args)
    if args.command == "config":
        try:
            config = load_config(args.path)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(config.model_dump_json(indent=2))
        return 0

    _configure_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2

    if args.command == "serve":
        try:
            uvloop.run(serve(config, ready_file=args.ready_file))
        except StartupError as exc:
            print(f"qosd: {exc}", file=sys.stderr)
            return 1
        return 0

    return run_demo(config, seconds=args.seconds, speedup=args.speedup)


if __name__ == "__main__":
    raise SystemExit(main())
