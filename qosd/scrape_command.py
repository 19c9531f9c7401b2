"""``qosd scrape``: latencies and load read from a model server's ``/metrics``, reported
to qosd, for gateways that cannot report (docs/integrations.md). ``qosd
triton-scrape`` is the same command for Triton. Heavy imports wait until the command
runs, so ``qosd --help`` stays quick."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import textwrap
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from qosd import ctl

if TYPE_CHECKING:
    from qosd_client import LatencySample, ServerLoad
    from qosd_client.scraping import MetricsScraper

#: The engines ``--engine`` takes: Triton's sums and counters, and the histogram
#: profiles of qosd_client.engine_metrics (a test holds the two in step).
ENGINES = ("triton", "vllm", "sglang", "trtllm")
#: Where each engine serves its metrics by default.
DEFAULT_URLS = {
    "triton": "http://127.0.0.1:8002/metrics",
    "vllm": "http://127.0.0.1:8000/metrics",
    "sglang": "http://127.0.0.1:30000/metrics",
    "trtllm": "http://127.0.0.1:8000/prometheus/metrics",
}
_ENGINES_EPILOG = "(engine profiles)"


def engines_help() -> str:
    """What each engine profile reads, for ``--help``."""
    from qosd_client.engine_metrics import PROFILES
    from qosd_client.server_load import load_gauges

    lines = ["engine profiles (--engine):"]
    latencies = {name: profile.description for name, profile in PROFILES.items()}
    latencies["triton"] = (
        "Triton: nv_inference_request_success / _failure / _duration_us and "
        "nv_inference_first_response_histogram_ms, by model"
    )
    for engine in ENGINES:
        gauges = sorted({gauge.name for gauge in load_gauges(engine)})
        lines.append(f"  {engine}:")
        for text in (f"latencies from {latencies[engine]}", f"load from {', '.join(gauges)}"):
            lines += textwrap.wrap(text, 78, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


class _ProfilesFormatter(argparse.RawDescriptionHelpFormatter):
    """Lists the profiles only when help is asked for: they live in the client package."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text == _ENGINES_EPILOG:
            text = engines_help()
        return super()._fill_text(text, width, indent)


def add_scrape(commands: Any) -> None:
    """Adds ``scrape`` and its alias ``triton-scrape`` (engine triton)."""
    scrape = commands.add_parser(
        "scrape", aliases=["triton-scrape"],
        help="report latencies and load read from a model server's /metrics (vLLM, "
        "SGLang, TensorRT-LLM, Triton) to qosd, for gateways that cannot report "
        "(docs/integrations.md)",
        epilog=_ENGINES_EPILOG, formatter_class=_ProfilesFormatter,
    )  # fmt: skip
    scrape.add_argument(
        "--engine", choices=ENGINES,
        help="the server's engine (required with scrape; triton-scrape: triton)",
    )  # fmt: skip
    scrape.add_argument("--metrics-url", help="default: the engine's usual address")
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
        help="report latencies only, not the server's waiting requests and KV cache usage",
    )  # fmt: skip
    scrape.add_argument(
        "--print", dest="print_only", action="store_true",
        help="print each read's samples and loads as a JSON line instead of reporting "
        "them (no qosd needed): to see what a profile makes of a server",
    )  # fmt: skip
    scrape.add_argument(
        "--reads", type=int, default=0, metavar="N",
        help="stop after N successful reads, the baseline included (0: run until stopped)",
    )  # fmt: skip
    scrape.add_argument(
        "--ready-file", metavar="PATH",
        help="once the first read (the baseline) has succeeded, write {pid, metrics_url, "
        "qosd} as JSON here; requests that finish after it are reported. The same moment "
        "is logged at INFO as 'baseline read from URL'",
    )  # fmt: skip
    scrape.add_argument("--log-level", default="INFO")
    scrape.set_defaults(run=run_scrape)


def _fail(command: str, message: str) -> int:
    print(f"qosd {command}: {message}", file=sys.stderr)
    return 2


def run_scrape(args: argparse.Namespace) -> int:
    """Runs the scraper until SIGINT or SIGTERM, or ``--reads``."""
    command = args.command
    engine = args.engine or ("triton" if command == "triton-scrape" else None)
    if engine is None:
        return _fail(command, f"name the server's engine with --engine ({', '.join(ENGINES)})")
    classes: dict[str, str] = {}
    for item in args.classes:
        model, sep, qos_class = item.partition("=")
        if not sep or not model or not qos_class:
            return _fail(command, f"--class wants MODEL=CLASS (got {item!r})")
        classes[model] = qos_class
    if not classes and args.default_class is None:
        return _fail(command, "name classes with --class or --default-class")
    if args.interval <= 0 or args.max_samples < 1 or args.reads < 0:
        return _fail(command, "--interval > 0, --max-samples >= 1 and --reads >= 0")
    args.metrics_url = args.metrics_url or DEFAULT_URLS[engine]

    import uvloop

    from qosd import logs

    logs.configure(args.log_level)
    uvloop.run(_scrape(args, engine, classes))
    return 0


def _make_scraper(
    engine: str, args: argparse.Namespace, sink: Any, classes: dict[str, str], on_loads: Any
) -> MetricsScraper[Any]:
    from qosd_client.engine_metrics import PROFILES, EngineMetricsScraper
    from qosd_client.triton_metrics import TritonMetricsScraper

    options: dict[str, Any] = {
        "default_class": args.default_class, "interval_s": args.interval,
        "max_samples": args.max_samples, "server": args.server,
        "on_loads": None if args.no_load else on_loads,
    }  # fmt: skip
    if engine == "triton":
        return TritonMetricsScraper(args.metrics_url, sink, classes, **options)
    return EngineMetricsScraper(PROFILES[engine], args.metrics_url, sink, classes, **options)


class _Printed:
    """``--print``: a read's samples, and the server's gauges per model (running
    requests included), as one JSON line."""

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []

    def record(self, sample: LatencySample) -> None:
        self.samples.append({k: v for k, v in asdict(sample).items() if v not in (None, "")})

    def flush(self, scraper: MetricsScraper[Any]) -> None:
        loads = {model: asdict(load) for model, load in sorted(scraper.last_loads.items())}
        line = {"read": scraper.stats.reads, "samples": self.samples, "loads": loads}
        print(json.dumps(line, default=str), flush=True)
        self.samples = []


async def _scrape(args: argparse.Namespace, engine: str, classes: dict[str, str]) -> None:
    from qosd.server import write_ready_file
    from qosd_client import QosdClient
    from qosd_client.reporter import LatencyReporter

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    reads = 0

    def after_read(scraper: MetricsScraper[Any]) -> None:
        nonlocal reads
        if scraper.stats.reads > reads:
            reads = scraper.stats.reads
            if reads == 1 and args.ready_file:
                write_ready_file(args.ready_file, {"metrics_url": args.metrics_url,
                                                   "qosd": args.qosd})  # fmt: skip
            if args.reads and reads >= args.reads:
                stop.set()

    if args.print_only:
        printed = _Printed()
        scraper = _make_scraper(engine, args, printed, classes, None)

        def print_read(scraper: MetricsScraper[Any]) -> None:
            if scraper.stats.reads > reads:
                printed.flush(scraper)
            after_read(scraper)

        await scraper.run(stop, after_read=print_read)
        return
    qos_client = QosdClient(args.qosd, tls=ctl.client_tls(args), token_file=args.token_file)
    async with qos_client as qos, LatencyReporter(qos) as reporter:

        async def report_loads(loads: list[ServerLoad]) -> None:
            await qos.report([], loads=loads)

        scraper = _make_scraper(engine, args, reporter, classes, report_loads)
        await scraper.run(stop, after_read=after_read)
