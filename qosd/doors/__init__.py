"""The doors: where requests come into qosd, each in its own protocol.

- ``grpc_api``: the ``qosd.v1`` gRPC services (Acquire, Release, Report, Admin);
- ``envoy_rls``: Envoy's rate limit service, ``ShouldRateLimit`` as one Acquire;
- ``json_api``: the same methods as JSON over HTTP, through the gRPC handlers;
- ``proxy``: the OpenAI-compatible proxy, which admits, forwards and settles.

Each reads its input, builds one ``request.AdmissionRequest`` (validated once, there),
and calls ``Admission.acquire`` through ``decisions.Decisions``, which records what
follows every decision. ``auth`` holds the identity rules every door applies.
"""
