# qosd: the admission daemon. Build: docker build -t qosd .
# Multi-stage: the build stage installs qosd and qosd-client (clients/: the client
# library and the qosd.v1 stubs the daemon serves) into a virtual environment with
# docker/install.sh (the same script CI runs: scripts/check_docker.py); the runtime
# stage copies only that environment onto the same slim Python base, and runs as an
# unprivileged user. The simulator and the tests' harness (sim/) stay out.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY qosd ./qosd
COPY clients ./clients
COPY docker/constraints.txt ./docker/
COPY docker/install.sh /usr/local/bin/qosd-install
RUN ["/usr/local/bin/qosd-install", "/opt/qosd", "/src"]

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="qosd" \
      org.opencontainers.image.description="Request-level QoS admission control for LLM inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 qosd \
 && useradd --system --uid 10001 --gid qosd --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin qosd
COPY --from=build /opt/qosd /opt/qosd
ENV PATH=/opt/qosd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# gRPC (QoS, Admin, Envoy RLS, health, reflection) and HTTP (/healthz, /readyz, /metrics).
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["qosctl", "health", "--address", "127.0.0.1:50051", "--timeout", "2"]
ENTRYPOINT ["qosd"]
CMD ["serve", "--listen", "0.0.0.0:50051", "--http-listen", "0.0.0.0:9464"]
