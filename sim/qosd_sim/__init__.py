"""qosd-sim: the simulated Triton server (KServe v2 gRPC and HTTP, Triton /metrics),
the GPU cost model, the trace replayer, the gateway loop, ``qosd demo`` and the QoS
benchmark's parts (docs/simulator.md).

A distribution of its own (``pip install ./sim``), not part of the daemon: the daemon
never imports it, and its image does not ship it. It adds ``qosd demo`` and ``qosd
sim-triton`` to the ``qosd`` command through the ``qosd.commands`` entry points
(``qosd_sim.commands``).
"""
