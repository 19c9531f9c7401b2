#!/usr/bin/env bash
# Regenerates the committed Python code for proto/ (qosd/v1/*_pb2*.py and .pyi).
# Generated code is committed so that `pip install .` needs no protoc; CI runs this
# script with --check and fails when the committed files drift from proto/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.
if [[ "${1:-}" == "--check" ]]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
python -m grpc_tools.protoc -Iproto \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" --mypy_grpc_out="$out" \
  proto/qosd/v1/qosd.proto proto/qosd/v1/envoy_rls.proto
if [[ "${1:-}" == "--check" ]]; then
  for f in "$out"/qosd/v1/*; do
    name=qosd/v1/$(basename "$f")
    if ! cmp -s "$f" "$name"; then
      echo "generated code is stale: $name differs from proto/ (run scripts/gen_proto.sh)" >&2
      exit 1
    fi
  done
  echo "generated code matches proto/"
fi
