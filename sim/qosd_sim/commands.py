"""The commands the simulator adds to ``qosd``: ``qosd demo``, ``qosd sim-triton`` and
``qosd sim-vllm``.

Registered through the ``qosd.commands`` entry points (sim/pyproject.toml): the daemon's
command line loads them when this distribution is installed, and never imports the
simulator otherwise. Each function adds one subcommand; the heavy imports (the server,
tritonclient, matplotlib) happen only when the command runs, so ``qosd --help`` stays
quick.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qosd.cli import add_config_flags, configured


def add_demo(commands: Any) -> None:
    demo = commands.add_parser(
        "demo",
        help="the same trace replayed with no QoS and with qosd, on a simulated Triton GPU: "
        "the seed's problem beside its fix",
    )
    add_config_flags(demo)
    demo.add_argument(
        "--duration",
        "--seconds",
        type=float,
        default=40.0,
        help="seconds of arrivals, for each of the two runs",
    )
    demo.add_argument(
        "--engine",
        choices=["unchunked", "chunked"],
        default="unchunked",
        help="the simulated server's prefill: unchunked (vLLM V0, the seed's stall) or "
        "chunked (vLLM V1's default)",
    )
    demo.add_argument("--load", type=float, default=1.5, help="offered load / GPU capacity")
    demo.add_argument("--trace", help="arrival_s,input_tokens,output_tokens CSV (default: bundled)")
    demo.add_argument(
        "--inject-every", type=float, default=10.0, help="a 32K-token prompt every N s (0: none)"
    )
    demo.add_argument("--out", default="qosd-demo", help="directory for the plots")
    demo.set_defaults(run=_demo)


def _demo(args: argparse.Namespace) -> int:
    from qosd_sim.demo import run_demo  # noqa: PLC0415 - the command imports what it runs

    config = configured(args)
    if config is None:
        return 2
    return run_demo(
        config,
        duration_s=args.duration,
        load=args.load,
        out_dir=args.out,
        trace=args.trace,
        inject_every_s=args.inject_every,
        engine=args.engine,
    )


def add_sim_triton(commands: Any) -> None:
    sim = commands.add_parser(
        "sim-triton",
        help="run a simulated Triton server (KServe v2 gRPC, Triton metrics) for demos "
        "and benchmarks",
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
        "--max-num-queued-reqs",
        dest="max_queued",
        type=int,
        metavar="N",
        help="refuse a request (UNAVAILABLE, 'queue full') that arrives while N are in "
        "flight, waiting or running, as vLLM's flag of that name does (default: no cap)",
    )
    add_gpu_options(sim)
    sim.add_argument("--ready-file", help="write {pid, port, metrics_port} as JSON once serving")
    sim.add_argument("--log-level", default="WARNING")
    sim.set_defaults(run=_sim_triton)


def _sim_triton(args: argparse.Namespace) -> int:
    from qosd import logs  # noqa: PLC0415 - the command imports what it runs
    from qosd_sim.gpu import GpuModel  # noqa: PLC0415
    from qosd_sim.server import SimulatorSettings, serve_until_signalled  # noqa: PLC0415

    logs.configure(args.log_level)
    try:
        if args.max_queued is not None and args.max_queued < 1:
            raise ValueError("--max-num-queued-reqs must be at least 1")
        gpu = GpuModel.from_options(dict(gpu_option(item) for item in args.gpu))
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
        max_queued=args.max_queued,
    )
    return serve_until_signalled(settings, args.ready_file)


def add_sim_vllm(commands: Any) -> None:
    sim = commands.add_parser(
        "sim-vllm",
        help="run a simulated vLLM server (OpenAI-compatible HTTP, vLLM's metrics) for "
        "demos, tests and benchmarks",
    )
    sim.add_argument(
        "--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="port 0: a free one"
    )
    sim.add_argument("--model", default="llm", help="the model name it serves")
    sim.add_argument(
        "--default-max-tokens", type=int, default=16, help="answer length without max_tokens"
    )
    sim.add_argument(
        "--max-waiting", type=int, default=4096, help="refuse with 503 beyond this many waiting"
    )
    sim.add_argument("--stream-every", type=int, default=1, help="a chunk every N tokens")
    sim.add_argument(
        "--cut-after-tokens",
        type=int,
        metavar="N",
        help="fault injection: break the connection once an answer has N tokens",
    )
    sim.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="priority: waiting requests go by their priority field (lower first), as vLLM's",
    )
    add_gpu_options(sim)
    sim.add_argument("--ready-file", help="write {pid, port} as JSON once serving")
    sim.add_argument("--log-level", default="WARNING")
    sim.set_defaults(run=_sim_vllm)


def _sim_vllm(args: argparse.Namespace) -> int:
    from qosd import logs  # noqa: PLC0415 - the command imports what it runs
    from qosd_sim.gpu import GpuModel  # noqa: PLC0415
    from qosd_sim.vllm import VllmSettings, serve_vllm_until_signalled  # noqa: PLC0415

    logs.configure(args.log_level)
    host, sep, port = args.listen.rpartition(":")
    options = dict(gpu_option(item) for item in args.gpu)
    if args.scheduling_policy == "priority":
        options["priority_scheduling"] = True
    try:
        if not sep or not port.isdigit():
            raise ValueError(f"--listen takes HOST:PORT, got {args.listen!r}")
        for name in ("default_max_tokens", "max_waiting", "stream_every", "cut_after_tokens"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        gpu = GpuModel.from_options(options)
    except ValueError as exc:
        print(f"qosd sim-vllm: {exc}", file=sys.stderr)
        return 2
    settings = VllmSettings(
        host=host.strip("[]"),
        port=int(port),
        model_name=args.model,
        gpu=gpu,
        default_max_tokens=args.default_max_tokens,
        max_waiting=args.max_waiting,
        stream_every=args.stream_every,
        cut_after_tokens=args.cut_after_tokens,
    )
    return serve_vllm_until_signalled(settings, args.ready_file)


def add_gpu_options(parser: argparse.ArgumentParser) -> None:
    """``--gpu KEY=VALUE``, repeatable: the simulated servers' cost model constants."""
    parser.add_argument(
        "--gpu",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a cost model constant, e.g. prefill_chunk_tokens=None (docs/simulator.md)",
    )


def gpu_option(item: str) -> tuple[str, int | float | None]:
    """``--gpu KEY=VALUE``: a number, a boolean (``true`` / ``false``), or None for
    ``none`` / ``null`` / empty."""
    key, sep, text = item.partition("=")
    if not sep:
        raise ValueError(f"--gpu takes KEY=VALUE, got {item!r}")
    if text.lower() in ("", "none", "null"):
        return key, None
    if text.lower() in ("true", "false"):
        return key, text.lower() == "true"
    try:
        return key, int(text)
    except ValueError:
        try:
            return key, float(text)
        except ValueError:
            raise ValueError(f"--gpu {key}: not a number: {text!r}") from None
