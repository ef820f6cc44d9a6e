#!/usr/bin/env bash
# Copies the single sources of truth into the Helm chart, which must carry identical copies
# (tests/charts checks byte-identity):
#   crds/dilocojobs.diloco.dev.yaml -> charts/diloco/crds/dilocojobs.diloco.dev.yaml
#   crds/kopfpeerings.kopf.dev.yaml -> charts/diloco/crds/kopfpeerings.kopf.dev.yaml (kopf peering)
#   operator/rbac.yaml              -> charts/diloco/files/operator-rbac.yaml
# Run it after changing either source:  scripts/sync-chart-crd.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
chart="$root/charts/diloco"

copy() {
  local src="$root/$1" dst="$chart/$2"
  if [ ! -f "$src" ]; then
    echo "error: $1 does not exist; nothing to copy into the chart" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$dst")"
  if cmp -s "$src" "$dst"; then
    echo "unchanged: charts/diloco/$2"
  else
    cp "$src" "$dst"
    echo "copied:    $1 -> charts/diloco/$2"
  fi
}

copy crds/dilocojobs.diloco.dev.yaml crds/dilocojobs.diloco.dev.yaml
copy crds/kopfpeerings.kopf.dev.yaml crds/kopfpeerings.kopf.dev.yaml
copy operator/rbac.yaml files/operator-rbac.yaml
