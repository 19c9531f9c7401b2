"""Operator commands against a running daemon: ``status``, ``watch``, ``leases``,
``pin`` and ``unpin``, as ``qosctl COMMAND`` (or ``qosd COMMAND``), plus ``qosctl
config check``.

They speak the Admin gRPC service, so they work against any replica: with the Redis
store, the state shown and the pins set are the fleet's. Tables are for people;
``--json`` is for scripts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qosd_client import ClassState, ClientTls, PoolState, Status, SyncQosdClient

# The parser is built from this module alone: grpc, the client and the config schema
# are imported by the commands that use them, so `qosd --help` starts in well under
# 0.3 s (it took 0.8 s; every import compiles from source on these machines).


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """TLS and bearer-token options for reaching a daemon (docs/security.md)."""
    parser.add_argument("--tls-ca", metavar="FILE", help="TLS: the CA of the daemon's certificate")
    parser.add_argument("--tls-cert", metavar="FILE", help="mTLS: this client's certificate")
    parser.add_argument("--tls-key", metavar="FILE", help="mTLS: this client's key")
    parser.add_argument(
        "--tls-server-name", metavar="NAME", help="check the daemon's certificate for this name"
    )
    parser.add_argument(
        "--tls", action="store_true", help="TLS with the system's CAs (implied by --tls-*)"
    )
    parser.add_argument(
        "--token-file", metavar="FILE", help="send 'authorization: Bearer' with this file's token"
    )


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The ``ClientTls`` that ``add_connection_options``'s flags ask for, if any."""
    named = (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    if not args.tls and not any(named):
        return None
    from qosd_client import ClientTls

    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def add_commands(commands: Any) -> None:
    """Adds the subcommands to ``qosd``'s parser (``commands`` from add_subparsers)."""

    def address(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--address", "-a", default="127.0.0.1:50051",
            help="a daemon's gRPC address (unix:PATH for its admin socket)",
        )  # fmt: skip
        parser.add_argument("--timeout", type=float, default=5.0, help="seconds")
        add_connection_options(parser)

    status = commands.add_parser(
        "status", help="admitted rates, pins, compliance and rate changes of a running fleet"
    )
    address(status)
    status.add_argument("--pool", default="", help="only this pool")
    status.add_argument("--history", type=int, default=5, help="rate changes to show per pool")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME",
        help="show this tenant's counter, tokens served and waiters in each class that "
        "shares by tokens (repeatable)",
    )

    watch = commands.add_parser("watch", help="status, redrawn every --interval seconds")
    address(watch)
    watch.add_argument("--pool", default="", help="only this pool")
    watch.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
    watch.add_argument("--count", type=int, default=0, help="stop after N redraws (0: never)")

    leases = commands.add_parser("leases", help="active leases per pool, fleet-wide")
    address(leases)
    leases.add_argument("--pool", default="", help="only this pool")
    leases.add_argument("--json", action="store_true", help="print JSON")

    pin = commands.add_parser("pin", help="fix a pool's admitted rate; the SLO loop waits")
    address(pin)
    pin.add_argument("pool")
    pin.add_argument("rate", type=float, help="tokens per second")

    unpin = commands.add_parser("unpin", help="hand a pool's rate back to the SLO loop")
    address(unpin)
    unpin.add_argument("pool")

    check = commands.add_parser(
        "health",
        help="exit 0 if the daemon's gRPC health is SERVING, else 1 (for container "
        "healthchecks and exec probes)",
    )
    address(check)
    check.add_argument("--service", default="", help="health service name ('' = the daemon)")


def run(args: argparse.Namespace) -> int:
    if args.command == "health":
        return _health(args)
    from qosd_client import QosdError, SyncQosdClient

    try:
        with SyncQosdClient(
            args.address, timeout_s=args.timeout, tls=client_tls(args), token_file=args.token_file
        ) as client:
            if args.command == "status":
                status = client.status(args.pool, history=args.history, tenants=args.tenant)
                if args.json:
                    print(json.dumps(dataclasses.asdict(status), indent=2))
                else:
                    print(render(status))
            elif args.command == "watch":
                _watch(client, args)
            elif args.command == "leases":
                pools = client.status(args.pool).pools
                if args.json:
                    print(json.dumps({p.name: p.active_leases for p in pools}))
                else:
                    print(f"{'pool':<24}{'active leases':>14}")
                    for pool in pools:
                        print(f"{pool.name:<24}{pool.active_leases:>14,}")
            elif args.command == "pin":
                print(render_pool(client.pin_rate(args.pool, args.rate)))
            else:
                print(render_pool(client.unpin_rate(args.pool)))
    except QosdError as exc:
        print(f"{getattr(args, 'prog', 'qosd')} {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `qosctl watch | head`: the reader left. Quietly, with nothing left to flush
        # into the closed pipe at exit (the way the Python docs advise).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def _watch(client: SyncQosdClient, args: argparse.Namespace) -> None:
    clear = "\033[2J\033[H" if sys.stdout.isatty() else ""
    drawn = 0
    while True:
        status = client.status(args.pool, history=3)
        print(f"{clear}{time.strftime('%H:%M:%S')}  {render(status)}", flush=True)
        drawn += 1
        if args.count and drawn >= args.count:
            return
        time.sleep(args.interval)


def _health(args: argparse.Namespace) -> int:
    """The standard gRPC health check, so an image needs no extra probe binary."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from qosd_client.channel import sync_channel

    with sync_channel(args.address, client_tls(args)) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as error:
            print(f"qosctl health: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    print(name)
    return 0 if answer.status == health_pb2.HealthCheckResponse.SERVING else 1


COMMANDS = ("status", "watch", "leases", "pin", "unpin", "health")


def main(argv: Sequence[str] | None = None) -> int:
    """``qosctl``: the operator CLI."""
    parser = argparse.ArgumentParser(prog="qosctl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_commands(commands)
    config = commands.add_parser("config", help="configuration tools").add_subparsers(
        dest="config_command", required=True
    )
    check = config.add_parser("check", help="validate a config file offline, print it resolved")
    check.add_argument("path")
    args = parser.parse_args(argv)
    args.prog = "qosctl"
    if args.command == "config":
        return check_config(args.path)
    try:
        return run(args)
    except KeyboardInterrupt:  # watch's way out
        return 0


def check_config(path: str) -> int:
    from qosd.config import ConfigError, load_config

    try:
        config = load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(config.model_dump_json(indent=2))
    return 0


def render(status: Status) -> str:
    lines = [
        f"daemon {status.daemon_id}, {status.store} store, "
        f"SLO loop led by {status.controller or '(disabled)'}"
    ]
    for pool in status.pools:
        lines.append("")
        lines.append(render_pool(pool))
    return "\n".join(lines)


def render_pool(pool: PoolState) -> str:
    share = pool.admitted_rate_tokens_s / pool.capacity_tokens_s if pool.capacity_tokens_s else 0.0
    lines = [
        f"pool {pool.name}: admitting {pool.admitted_rate_tokens_s:,.0f} tokens/s "
        f"({share:.0%} of the configured {pool.capacity_tokens_s:,.0f})"
        + (", PINNED" if pool.pinned else "")
        + f"; bounds {pool.min_rate_tokens_s:,.0f}..{pool.max_rate_tokens_s:,.0f}"
        + f"; {pool.active_leases:,} active leases",
    ]
    if pool.verdict:
        lines.append(f"  loop: {pool.verdict}")
    lines.append(
        f"  {'class':<6}{'rate/s':>10}{'of conf':>9}{'tokens':>10}{'waiting':>9}"
        f"{'samples':>9}{'comply':>8}  {'p50 / p99 (ms)':<28}objectives"
    )
    lines.extend(_class_line(cls) for cls in pool.classes)
    for cls in pool.classes:
        lines.extend(_tenant_lines(cls))
    changes = pool.history or ((pool.last_change,) if pool.last_change else ())
    for change in changes:
        lines.append(
            f"  {change.age_s:,.0f} s ago, {change.by}: {change.from_tokens_s:,.0f} -> "
            f"{change.to_tokens_s:,.0f} ({change.reason})"
        )
    return "\n".join(lines)


def _tenant_lines(cls: ClassState) -> list[str]:
    """The tenants asked for in a class that shares by tokens: a table under it."""
    if not cls.tenants:
        return []
    lines = [
        f"  {cls.name} tenants (fair shares by tokens):",
        f"    {'tenant':<24}{'weight':>8}{'counter':>14}{'served tokens':>15}{'waiting':>9}",
    ]
    for tenant in cls.tenants:
        counter = f"{tenant.counter:,.0f}" if tenant.live else "idle"
        lines.append(
            f"    {tenant.name:<24}{tenant.weight:>8g}{counter:>14}"
            f"{tenant.served_tokens:>15,.0f}{tenant.waiting:>9}"
        )
    return lines


def _class_line(cls: ClassState) -> str:
    latency = cls.latency
    compliance = "-" if latency.compliance is None else f"{latency.compliance:.1%}"
    shown = []
    for name, value in (("ttft", latency.ttft), ("tpot", latency.tpot), ("e2e", latency.e2e)):
        if value is not None:
            shown.append(f"{name} {value.p50_ms:.0f}/{value.p99_ms:.0f}")
    objectives = [
        f"{name}<={value:.0f}"
        for name, value in (
            ("ttft", latency.slo_ttft_ms),
            ("tpot", latency.slo_tpot_ms),
            ("e2e", latency.slo_e2e_ms),
        )
        if value
    ]
    of_configured = (
        cls.rate_tokens_s / cls.configured_rate_tokens_s if cls.configured_rate_tokens_s else 0
    )
    return (
        f"  {cls.name:<6}{cls.rate_tokens_s:>10,.0f}{of_configured:>9.0%}{cls.tokens:>10,.0f}"
        f"{cls.waiting:>9}{latency.samples:>9}{compliance:>8}  {', '.join(shown) or '-':<28}"
        f"{', '.join(objectives) or 'none'}"
    )
