"""``qosd`` command line: ``serve``, ``proxy``, ``scrape`` (alias ``triton-scrape``),
``config check``, the operator commands of ``qosctl`` (``status``, ``watch``,
``leases``, ``pin``, ``unpin``, ``health``; qosd.ctl), and the commands other
distributions add through the ``qosd.commands`` entry points (the simulator's
``demo`` and ``sim-triton``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qosd import ctl
from qosd.doors.proxy.command import add_proxy
from qosd.scrape_command import add_scrape

if TYPE_CHECKING:
    from qosd.config import Config

# Only argparse and the parser's own modules at import: each command imports what it
# runs (grpc, the config schema, the server), so `qosd --help` is quick.

#: Entry points of this group add commands: each names a function that takes the
#: parser's subcommands and adds one, with ``set_defaults(run=...)`` (a function of
#: the parsed arguments that returns the exit status).
COMMAND_GROUP = "qosd.commands"
#: Commands that come with another distribution, and what to install for them.
ELSEWHERE = {
    "demo": "the simulator, the qosd-sim package in the source tree's sim/",
    "sim-triton": "the simulator, the qosd-sim package in the source tree's sim/",
}
ELSEWHERE_HINT = (
    "qosd {command} needs {what} (docs/simulator.md), which is not installed. Install "
    "it beside qosd: pip install ./clients . ./harness ./sim (from the source tree), or "
    "run make demo there"
)


def _add_plugin_commands(commands: Any) -> dict[str, Any]:
    """The commands of the ``qosd.commands`` entry points, and for each command of
    ``ELSEWHERE`` none provides, one that says how to install it (returned, by name, to
    run whatever its arguments). A plugin that cannot be imported (half installed) adds
    nothing: the daemon's own commands still work."""
    from importlib.metadata import entry_points

    broken: dict[str, str] = {}
    for point in entry_points(group=COMMAND_GROUP):
        try:
            register = point.load()
        except ImportError as exc:
            broken[point.name] = str(exc)
            continue
        register(commands)
    missing: dict[str, Any] = {}
    for command, what in ELSEWHERE.items():
        if command not in commands.choices:
            commands.add_parser(command, help=f"needs {what}")
            reason = broken.get(command, "")
            missing[command] = lambda c=command, w=what, r=reason: _not_installed(c, w, r)
    return missing


def _not_installed(command: str, what: str, reason: str) -> int:
    print(ELSEWHERE_HINT.format(command=command, what=what), file=sys.stderr)
    if reason:
        print(f"(importing it failed: {reason})", file=sys.stderr)
    return 2


def add_config_flags(parser: argparse.ArgumentParser, listen_flag: str = "--listen") -> None:
    """The config flags of `serve` (and of commands that run a daemon: `demo`, `proxy`).
    ``listen_flag``: the name of the gRPC listener's flag (`proxy` serves HTTP on
    `--listen` and names it `--grpc-listen`); its value is ``args.listen`` either way."""
    parser.add_argument("--config", "-c", help="YAML config file (default: built-in defaults)")
    parser.add_argument(
        listen_flag,
        dest="listen",
        action="append",
        metavar="ADDR",
        help="HOST:PORT or unix:PATH; repeat for several (overrides server.listen)",
    )
    parser.add_argument("--redis-url", help="redis://HOST:PORT/DB; omit for the embedded store")
    parser.add_argument("--redis-mode", choices=["standalone", "cluster", "sentinel"])
    parser.add_argument("--fail-mode", choices=["open", "closed"])
    parser.add_argument(
        "--http-listen", metavar="HOST:PORT", help="serve /healthz, /readyz, /metrics and JSON"
    )
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (overrides logging.level)")
    parser.add_argument("--log-format", choices=["text", "json"], help="overrides logging.format")


def configured(args: argparse.Namespace) -> Config | None:
    """The config the command line names, with logging set up from it; None after
    saying on stderr why it is invalid (the command then exits 2)."""
    from qosd import logs
    from qosd.config import ConfigError

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None
    logs.configure(config.logging.level, config.logging.format)
    return config


def config_from_args(args: argparse.Namespace) -> Config:
    from qosd.config import load_config

    overrides: dict[tuple[str, ...], Any] = {}
    if args.listen:
        overrides[("server", "listen")] = args.listen
    if args.redis_url:
        overrides[("redis", "url")] = args.redis_url
    if args.redis_mode:
        overrides[("redis", "mode")] = args.redis_mode
    if args.fail_mode:
        overrides[("fail_mode",)] = args.fail_mode
    if getattr(args, "http_listen", None):
        overrides[("server", "http_listen")] = args.http_listen
    if args.log_level:
        overrides[("logging", "level")] = args.log_level
    if args.log_format:
        overrides[("logging", "format")] = args.log_format
    if getattr(args, "workers", None):
        overrides[("server", "workers")] = args.workers
    if args.command == "serve":
        from qosd.workers import worker_role

        role = worker_role()
        if role is not None:  # a worker of `serve --workers N`: the supervisor's ports
            overrides.update(role.overrides())
    return load_config(args.config, overrides=overrides)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="qosd", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser("serve", help="run the admission daemon")
    add_config_flags(serve_cmd)
    serve_cmd.add_argument("--ready-file", help="write {pid, addresses} as JSON here once serving")
    serve_cmd.add_argument(
        "--workers",
        metavar="N|auto",
        help="worker processes sharing the listen ports (SO_REUSEPORT; needs Redis); auto: "
        "one per CPU this process may use (overrides server.workers)",
    )

    check = commands.add_parser("config", help="configuration tools").add_subparsers(
        dest="config_command", required=True
    )
    check_cmd = check.add_parser("check", help="validate a config file and print it resolved")
    check_cmd.add_argument("path")
    ctl.add_commands(commands)
    add_proxy(commands)
    add_scrape(commands)
    missing = _add_plugin_commands(commands)
    if argv and argv[0] in missing:
        return int(missing[argv[0]]())

    args = parser.parse_args(argv)
    if getattr(args, "run", None) is not None:
        return int(args.run(args))
    if args.command in ctl.COMMANDS:
        return ctl.run(args)
    if args.command == "config":
        return ctl.check_config(args.path)

    config = configured(args)
    if config is None:
        return 2
    return _serve(args, config, argv)


def _serve(args: argparse.Namespace, config: Config, argv: Sequence[str]) -> int:
    """One daemon; or, with ``server.workers`` above 1, the supervisor of that many
    (qosd.workers), each of which comes back here as a worker and serves."""
    from qosd.workers import die_with_supervisor, resolve_workers, supervise, worker_role

    role = worker_role()
    if role is None:
        count = resolve_workers(config.server.workers)
        if count > 1:
            return supervise(config, argv, count, args.ready_file)
    else:
        die_with_supervisor(role)

    import uvloop

    from qosd.server import StartupError, serve

    try:
        uvloop.run(
            serve(
                config,
                ready_file=role.ready_file if role else args.ready_file,
                reload=lambda: config_from_args(args),
                config_path=args.config,
                reuse_port=role is not None,
            )
        )
    except StartupError as exc:
        print(f"qosd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
