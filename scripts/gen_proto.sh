#!/usr/bin/env bash
# Regenerates the committed Python code for proto/ (and its .pyi):
#
#   proto/qosd/v1/qosd.proto      -> clients/qosd_client/v1/qosd_pb2*.py (distribution
#                                    qosd-client: the gateway's client and the daemon
#                                    share one copy of these descriptors)
#   proto/qosd/v1/envoy_rls.proto -> qosd/v1/envoy_rls_pb2*.py (the daemon alone serves it)
#
# qosd.proto is compiled under the virtual path qosd_client/v1/qosd.proto
# (protoc's -IVIRTUAL=DISK), which is what makes the Python modules
# qosd_client.v1.qosd_pb2 and their imports; its package, and so every wire name
# (/qosd.v1.QoS/Acquire), stays qosd.v1. Generated code is committed so that
# `pip install` needs no protoc; CI runs this script with --check and fails when the
# committed files drift from proto/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.
if [[ "${1:-}" == "--check" ]]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out/clients"
gen() {  # OUTPUT_DIR PROTOC_ARGS...
  local dir=$1
  shift
  python -m grpc_tools.protoc \
    --python_out="$dir" --grpc_python_out="$dir" \
    --mypy_out="$dir" --mypy_grpc_out="$dir" "$@"
}
gen "$out/clients" -Iqosd_client/v1=proto/qosd/v1 qosd_client/v1/qosd.proto
gen "$out" -Iproto proto/qosd/v1/envoy_rls.proto
if [[ "${1:-}" == "--check" ]]; then
  stale=0
  for f in "$out"/clients/qosd_client/v1/* "$out"/qosd/v1/*; do
    name=${f#"$out"/}
    if ! cmp -s "$f" "$name"; then
      echo "generated code is stale: $name differs from proto/ (run scripts/gen_proto.sh)" >&2
      stale=1
    fi
  done
  # A module left behind by a moved or deleted .proto is stale too.
  for name in clients/qosd_client/v1/*_pb2*.py* qosd/v1/*_pb2*.py*; do
    if [[ ! -e "$out/$name" ]]; then
      echo "generated code is stale: $name has no .proto (delete it)" >&2
      stale=1
    fi
  done
  if [[ $stale != 0 ]]; then exit 1; fi
  echo "generated code matches proto/"
fi
