"""qosd-sim: the simulated Triton server (KServe v2 gRPC and HTTP, Triton /metrics),
the GPU cost model, the trace replayer, the gateway loop, ``qosd demo`` and the QoS
benchmark's parts (docs/simulator.md), and the process harness of the tests and
benchmarks (``qosd_sim.harness``).

A distribution of its own (``pip install ./sim``), not part of the daemon: the daemon
never imports it, and its image does not ship it. ``qosd demo`` and ``qosd sim-triton``
import it when they run, and say how to install it when it is missing.
"""
