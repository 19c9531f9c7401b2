#!/usr/bin/env bash
# A seeded change to one rule in one Lua file, and the conformance tests it fails on
# every backend (embedded store, standalone Redis, Redis Cluster): the waiting room's
# order between two heads of different rank is reversed in lua/pool/waiters.lua,
# the tests run, and the file is restored whatever happens (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
rules=qosd/store/lua/pool/waiters.lua
cp "$rules" "$rules.orig"
trap 'mv "$rules.orig" "$rules"' EXIT
sed -i 's/      return x.rank < y.rank/      return x.rank > y.rank/' "$rules"
if cmp -s "$rules" "$rules.orig"; then
  echo "the seeded change no longer applies to $rules" >&2
  exit 2
fi
diff -u "$rules.orig" "$rules" || true
# Expected to fail: the exit status is pytest's, and the summary lists each backend.
.venv/bin/pytest -p no:cacheprovider -q -rf --no-header \
  tests/test_waiting_room.py tests/test_rules.py tests/test_order.py -k "aging or higher_class" "$@"
