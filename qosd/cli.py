"""``qosd`` command line: ``serve``, ``demo``, ``sim-triton``, ``triton-scrape``,
``config check``, and the operator commands of ``qosctl`` (``status``, ``watch``,
``leases``, ``pin``, ``unpin``, ``health``; qosd.ctl)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qosd import ctl

if TYPE_CHECKING:
    from qosd.config import Config
    from qosd_client import ServerLoad

# Only argparse and the parser's own modules at import: each command imports what it
# runs (grpc, the config schema, the server), so `qosd --help` is quick. The simulator
# (`demo`, `sim-triton`) is another distribution, qosd-sim: imported by those commands
# alone, never by the daemon (tests/test_packages.py).
SIMULATOR_MODULES = frozenset({"qosd_sim", "tritonclient", "matplotlib", "numpy"})
SIMULATOR_HINT = (
    "qosd {command} needs the simulator, which is not installed ({missing}): it is the "
    "qosd-sim package in the source tree's sim/ (docs/simulator.md). Install it beside "
    "qosd: pip install ./clients . ./sim (from the source tree), or run make demo there"
)


def _simulator_missing(command: str, exc: ModuleNotFoundError) -> int:
    """Says how to install the simulator and returns 2, when ``exc`` is the simulator
    (or one of its own dependencies) missing; any other missing module is a bug, and is
    raised."""
    if (exc.name or "").partition(".")[0] not in SIMULATOR_MODULES:
        raise exc
    print(SIMULATOR_HINT.format(command=command, missing=exc.name), file=sys.stderr)
    return 2


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (default: built-in defaults)")
    parser.add_argument(
        "--listen",
        action="append",
        metavar="ADDR",
        help="HOST:PORT or unix:PATH; repeat for several (overrides server.listen)",
    )
    parser.add_argument("--redis-url", help="redis://HOST:PORT/DB; omit for the embedded store")
    parser.add_argument("--redis-mode", choices=["standalone", "cluster", "sentinel"])
    parser.add_argument("--fail-mode", choices=["open", "closed"])
    parser.add_argument("--http-listen", metavar="HOST:PORT", help="serve /healthz and /readyz")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (overrides logging.level)")
    parser.add_argument("--log-format", choices=["text", "json"], help="overrides logging.format")


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
    _add_config_flags(serve_cmd)
    serve_cmd.add_argument("--ready-file", help="write {pid, addresses} as JSON here once serving")
    serve_cmd.add_argument(
        "--workers",
        metavar="N|auto",
        help="worker processes sharing the listen ports (SO_REUSEPORT; needs Redis); auto: "
        "one per CPU this process may use (overrides server.workers)",
    )

    demo = commands.add_parser(
        "demo",
        help="qosd, a simulated Triton GPU and a trace replay: the seed's problem, fixed "
        "(needs the simulator, qosd-sim)",
    )
    _add_config_flags(demo)
    demo.add_argument(
        "--duration", "--seconds", type=float, default=60.0, help="seconds of arrivals"
    )
    demo.add_argument("--load", type=float, default=1.5, help="offered load / GPU capacity")
    demo.add_argument("--trace", help="arrival_s,input_tokens,output_tokens CSV (default: bundled)")
    demo.add_argument(
        "--inject-every", type=float, default=10.0, help="a 32K-token prompt every N s (0: none)"
    )
    demo.add_argument("--out", default="qosd-demo", help="directory for the plots")

    sim = commands.add_parser(
        "sim-triton",
        help="run a simulated Triton server (KServe v2 gRPC, Triton metrics) for demos "
        "and benchmarks; needs the simulator, qosd-sim",
    )
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8001, help="gRPC port (0: a free one)")
    sim.add_argument("--metrics-port", type=int, default=8002, help="HTTP /metrics port")
    sim.add_argument(
        "--http-port", type=int, default=8000, help="KServe v2 HTTP/REST port (-1: none)"
    )
    sim.add_argument("--model", default="llm", help="the model name it serves")
    sim.add_argument("--qosd", default="", metavar="ADDR", help="Report latencies to this qosd")
    sim.add_argument("--stream-every", type=int, default=0, help="stream a response every N tokens")
    sim.add_argument(
        "--gpu",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a cost model constant, e.g. prefill_chunk_tokens=2048 (docs/simulator.md)",
    )
    sim.add_argument("--ready-file", help="write {pid, port, metrics_port} as JSON once serving")
    sim.add_argument("--log-level", default="WARNING")

    scrape = commands.add_parser(
        "triton-scrape",
        help="report latencies read from a Triton server's /metrics to qosd, for gateways "
        "that cannot report (docs/integrations.md)",
    )
    scrape.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    scrape.add_argument("--qosd", default="127.0.0.1:50051", metavar="ADDR")
    ctl.add_connection_options(scrape)
    scrape.add_argument(
        "--class", dest="classes", action="append", default=[], metavar="MODEL=CLASS",
        help="the QoS class of a model's requests (repeatable)",
    )  # fmt: skip
    scrape.add_argument("--default-class", help="class of models not named by --class")
    scrape.add_argument("--interval", type=float, default=5.0, help="seconds between reads")
    scrape.add_argument("--max-samples", type=int, default=200, help="per model and read")
    scrape.add_argument(
        "--server", default="",
        help="the name the server's load is reported under (default: --metrics-url); "
        "qosd keeps each server's latest read",
    )  # fmt: skip
    scrape.add_argument(
        "--no-load", action="store_true",
        help="report latencies only, not the server's pending requests, waiting requests "
        "and KV cache usage",
    )  # fmt: skip
    scrape.add_argument(
        "--ready-file", metavar="PATH",
        help="once the first read (the baseline) has succeeded, write {pid, metrics_url, "
        "qosd} as JSON here; requests that finish after it are reported. The same moment "
        "is logged at INFO as 'baseline read from URL'",
    )  # fmt: skip
    scrape.add_argument("--log-level", default="INFO")

    check = commands.add_parser("config", help="configuration tools").add_subparsers(
        dest="config_command", required=True
    )
    check_cmd = check.add_parser("check", help="validate a config file and print it resolved")
    check_cmd.add_argument("path")
    ctl.add_commands(commands)

    args = parser.parse_args(argv)
    if args.command in ctl.COMMANDS:
        return ctl.run(args)
    if args.command == "config":
        return ctl.check_config(args.path)

    from qosd import logs
    from qosd.config import ConfigError

    if args.command == "sim-triton":
        logs.configure(args.log_level)
        return _sim_triton(args)
    if args.command == "triton-scrape":
        logs.configure(args.log_level)
        return _triton_scrape(args)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    logs.configure(config.logging.level, config.logging.format)

    if args.command == "serve":
        return _serve(args, config, argv)

    try:
        from qosd_sim.demo import run_demo
    except ModuleNotFoundError as exc:
        return _simulator_missing("demo", exc)
    return run_demo(
        config,
        duration_s=args.duration,
        load=args.load,
        out_dir=args.out,
        trace=args.trace,
        inject_every_s=args.inject_every,
    )


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


def _sim_triton(args: argparse.Namespace) -> int:
    try:
        from qosd_sim.gpu import GpuModel
        from qosd_sim.server import SimulatorSettings, serve_until_signalled
    except ModuleNotFoundError as exc:
        return _simulator_missing("sim-triton", exc)
    try:
        gpu = GpuModel.from_options(dict(_parse_option(item) for item in args.gpu))
    except ValueError as exc:
        print(f"qosd sim-triton: {exc}", file=sys.stderr)
        return 2
    settings = SimulatorSettings(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        http_port=None if args.http_port < 0 else args.http_port,
        model_name=args.model,
        gpu=gpu,
        qosd_target=args.qosd,
        stream_every=args.stream_every,
    )
    return serve_until_signalled(settings, args.ready_file)


def _triton_scrape(args: argparse.Namespace) -> int:
    """Runs the scraper until SIGINT or SIGTERM."""
    classes: dict[str, str] = {}
    for item in args.classes:
        model, sep, qos_class = item.partition("=")
        if not sep or not model or not qos_class:
            print(f"qosd triton-scrape: --class wants MODEL=CLASS (got {item!r})", file=sys.stderr)
            return 2
        classes[model] = qos_class
    if not classes and args.default_class is None:
        print("qosd triton-scrape: name classes with --class or --default-class", file=sys.stderr)
        return 2
    if args.interval <= 0 or args.max_samples < 1:
        print("qosd triton-scrape: --interval > 0 and --max-samples >= 1", file=sys.stderr)
        return 2

    import uvloop

    from qosd.server import write_ready_file
    from qosd_client import QosdClient
    from qosd_client.reporter import LatencyReporter
    from qosd_client.triton_metrics import TritonMetricsScraper

    def baseline_read() -> None:
        """Tells a supervisor (or a test) that requests finishing from now on count."""
        if args.ready_file:
            write_ready_file(args.ready_file, {"metrics_url": args.metrics_url, "qosd": args.qosd})

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        qos_client = QosdClient(args.qosd, tls=ctl.client_tls(args), token_file=args.token_file)
        async with qos_client as qos, LatencyReporter(qos) as reporter:

            async def report_loads(loads: list[ServerLoad]) -> None:
                await qos.report([], loads=loads)

            scraper = TritonMetricsScraper(
                args.metrics_url, reporter, classes, default_class=args.default_class,
                interval_s=args.interval, max_samples=args.max_samples, server=args.server,
                on_loads=None if args.no_load else report_loads,
            )  # fmt: skip
            await scraper.run(stop, on_baseline=baseline_read)

    uvloop.run(main())
    return 0


def _parse_option(item: str) -> tuple[str, int | float | None]:
    key, sep, text = item.partition("=")
    if not sep:
        raise ValueError(f"--gpu takes KEY=VALUE, got {item!r}")
    if text.lower() in ("", "none", "null"):
        return key, None
    try:
        return key, int(text)
    except ValueError:
        try:
            return key, float(text)
        except ValueError:
            raise ValueError(f"--gpu {key}: not a number: {text!r}") from None


if __name__ == "__main__":
    raise SystemExit(main())
