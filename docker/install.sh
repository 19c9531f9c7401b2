#!/bin/sh
# Installs qosd into a new virtual environment at TARGET from the source tree SOURCE:
# the daemon (SOURCE) and the client library with the qosd.v1 stubs it serves
# (SOURCE/clients, the distribution qosd-client), in one pip call so that pip takes
# qosd-client from the tree, never from an index. Not the simulator nor the tests'
# harness (SOURCE/sim): the image has no use for them.
#
# This is the Dockerfile's build step, kept in a script of its own so that CI runs
# exactly these commands on a machine with no Docker engine
# (scripts/check_docker.py). Everything qosd needs ships as wheels: no compiler.
#
#   docker/install.sh TARGET [SOURCE]
set -eu
target=$1
source=${2:-.}
python3 -m venv "$target"
constraints=""
if [ -f "$source/docker/constraints.txt" ]; then
  constraints="--constraint $source/docker/constraints.txt"
fi
# shellcheck disable=SC2086  # $constraints is empty or two words
"$target/bin/pip" install --no-cache-dir --disable-pip-version-check $constraints \
  "$source/clients" "$source"
# The runtime image needs neither pip nor setuptools: fewer files, nothing to install with.
"$target/bin/pip" uninstall --yes --quiet pip setuptools
# Fail the build, not the pod, if the install is broken.
"$target/bin/qosd" config check /dev/null > /dev/null
"$target/bin/python" -c "import qosd.server, qosd_client.triton_metrics"
