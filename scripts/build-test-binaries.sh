#!/usr/bin/env bash
# Builds the real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler), a real node's components (kubelet, kube-proxy, CoreDNS, the pause program),
# kubectl, kwok, helm and Kueue (with its CRDs and webhook manifests) from the Go module proxy (pause from scripts/node/pause.c), version-pinned,
# into a cache outside the checkout. Each binary is skipped when it is already cached.
#
#   scripts/build-test-binaries.sh            # builds what is missing, prints the folder
#   scripts/build-test-binaries.sh pause      # the pause program alone (what the images need), prints the folder
#   DILOCO_BIN_CACHE=/some/dir scripts/...    # choose the cache folder
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.34.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.7.0}"
HELM_VERSION="${HELM_VERSION:-v3.19.5}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.12.4}"
KUEUE_VERSION="${KUEUE_VERSION:-v0.17.0}"

CACHE="${DILOCO_BIN_CACHE:-$HOME/.cache/diloco/bin/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}-kwok-${KWOK_VERSION}-helm-${HELM_VERSION}}"
mkdir -p "$CACHE"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
# Go's module and build caches are only needed while building (several GB when cold): the binaries are
# what is kept, so caches this script chose itself are removed once every binary is built.
own_go_caches=()
[ -n "${GOMODCACHE:-}" ] || own_go_caches+=(-modcache)
[ -n "${GOCACHE:-}" ] || own_go_caches+=(-cache)
export GOMODCACHE="${GOMODCACHE:-$HOME/.cache/diloco/gomod}"
export GOCACHE="${GOCACHE:-$HOME/.cache/diloco/gobuild}"

command -v go >/dev/null || { echo "error: Go (>= 1.24) is needed to build the test control plane; install it from https://go.dev/dl or your package manager" >&2; exit 1; }

log() { echo "[build-test-binaries] $*" >&2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
have() { [ -x "$CACHE/$1" ]; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# binary -> the package of k8s.io/kubernetes/cmd/<binary>/app and how its main builds the command
K8S_BINARIES="${K8S_BINARIES:-kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl}"
k8s_main() {
  case "$1" in
    kube-apiserver) echo 'k8s.io/kubernetes/cmd/kube-apiserver/app|os.Exit(cli.Run(app.NewAPIServerCommand()))' ;;
    kube-controller-manager) echo 'k8s.io/kubernetes/cmd/kube-controller-manager/app|os.Exit(cli.Run(app.NewControllerManagerCommand()))' ;;
    kube-scheduler) echo 'k8s.io/kubernetes/cmd/kube-scheduler/app|os.Exit(cli.Run(app.NewSchedulerCommand()))' ;;
    kubelet) echo 'k8s.io/kubernetes/cmd/kubelet/app|os.Exit(cli.Run(app.NewKubeletCommand(context.Background())))' ;;
    kube-proxy) echo 'k8s.io/kubernetes/cmd/kube-proxy/app|os.Exit(cli.Run(app.NewProxyCommand()))' ;;
    kubectl) echo 'k8s.io/kubectl/pkg/cmd|if err := cli.RunNoErrOutput(app.NewDefaultKubectlCommand()); err != nil { fmt.Fprintln(os.Stderr, "error:", err); os.Exit(1) }' ;;
  esac
}

build_k8s() {
  local missing=()
  for b in $K8S_BINARIES; do have "$b" || missing+=("$b"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "building ${missing[*]} ${K8S_VERSION} (cold: 10-25 minutes for the control plane, a few more for the rest)"
  local mod="$work/k8s"
  mkdir -p "$mod"
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local staging="v0.${K8S_VERSION#v1.}"
  (cd "$mod" && cat > go.mod <<GOMOD
module diloco.local/k8sbins

go 1.24

godebug default=go1.24
GOMOD
  go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" > "$work/k8s.json"
  local kdir; kdir="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["Dir"])' "$work/k8s.json")"
  go mod edit -require="k8s.io/kubernetes@${K8S_VERSION}"
  for s in $(grep -oE '^\s*k8s.io/[a-z0-9-]+ => ./staging/src/' "$kdir/go.mod" | awk '{print $1}'); do
    go mod edit -replace="$s=$s@${staging}"
  done
  for b in $K8S_BINARIES; do
    local spec pkg call
    spec="$(k8s_main "$b")"; pkg="${spec%%|*}"; call="${spec#*|}"
    mkdir -p "cmd/$b"
    cat > "cmd/$b/main.go" <<GO
package main

import (
	"context"
	"fmt"
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/client-go/plugin/pkg/client/auth"
	app "$pkg"
)

var _ = context.Background
var _ = fmt.Sprint

func main() { $call }
GO
  done
  go mod tidy >/dev/null 2>&1 || go mod tidy
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor} -X k8s.io/client-go/pkg/version.gitVersion=${K8S_VERSION} -X k8s.io/component-base/version.gitTreeState=clean"
  for b in "${missing[@]}"; do
    log "go build $b"
    go build -p 2 -trimpath -ldflags "$ld" -o "$CACHE/$b.tmp" "./cmd/$b" && mv "$CACHE/$b.tmp" "$CACHE/$b"
  done)
}

build_coredns() {
  [ -x "$CACHE/coredns" ] && [ "$(cat "$CACHE/coredns.version" 2>/dev/null)" = "$COREDNS_VERSION" ] && return 0
  log "building coredns ${COREDNS_VERSION}"
  GOBIN="$work/corednsbin" go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@${COREDNS_VERSION}"
  mv "$work/corednsbin/coredns" "$CACHE/coredns"
  echo "$COREDNS_VERSION" > "$CACHE/coredns.version"
}

build_pause() {
  # the sandbox process of every pod: a static program, so the pause image needs no base
  local src="$root/scripts/node/pause.c" sum
  sum="$(sha256sum "$src" | cut -c1-16)"
  [ -x "$CACHE/pause" ] && [ "$(cat "$CACHE/pause.version" 2>/dev/null)" = "$sum" ] && return 0
  command -v cc >/dev/null || { echo "error: a C compiler (cc) is needed to build the pause program" >&2; exit 1; }
  log "building pause"
  local tmp="$CACHE/pause.tmp.$$"  # its own name: `pause` alone may be building it beside a full build
  cc -Os -static -Wall -Werror -o "$tmp" "$src" && strip "$tmp" && mv "$tmp" "$CACHE/pause"
  echo "$sum" > "$CACHE/pause.version"
}

build_etcd() {
  have etcd && return 0
  log "building etcd ${ETCD_VERSION}"
  local mod="$work/etcd"
  mkdir -p "$mod"
  (cd "$mod" && cat > go.mod <<GOMOD
module diloco.local/etcdbin

go 1.24
GOMOD
  cat > main.go <<GO
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go mod edit -require="go.etcd.io/etcd/server/v3@${ETCD_VERSION}"
  go mod tidy >/dev/null 2>&1 || go mod tidy
  go build -trimpath -ldflags "-s -w" -o "$CACHE/etcd.tmp" . && mv "$CACHE/etcd.tmp" "$CACHE/etcd")
}

build_kwok() {
  have kwok && return 0
  log "building kwok ${KWOK_VERSION}"
  GOBIN="$work/kwokbin" go install -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION}" "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}"
  mv "$work/kwokbin/kwok" "$CACHE/kwok"
  # the stock stage files (pod/node defaults and chaos stages) live in the module
  local kdir; kdir="$(go mod download -json "sigs.k8s.io/kwok@${KWOK_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  rm -rf "$CACHE/kwok-stages"; cp -r "$kdir/kustomize/stage" "$CACHE/kwok-stages"; chmod -R u+w "$CACHE/kwok-stages"
}

build_helm() {
  have helm && return 0
  log "building helm ${HELM_VERSION}"
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  GOBIN="$work/helmbin" go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${minor}" "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}"
  mv "$work/helmbin/helm" "$CACHE/helm"
}

build_kueue() {
  # Kueue's manager, and its CRDs and webhook configurations (diloco_testbed.kueue installs them)
  [ -x "$CACHE/kueue" ] && [ "$(cat "$CACHE/kueue.version" 2>/dev/null)" = "$KUEUE_VERSION" ] && return 0
  log "building kueue ${KUEUE_VERSION}"
  GOBIN="$work/kueuebin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kueue/cmd/kueue@${KUEUE_VERSION}"
  local kdir; kdir="$(go mod download -json "sigs.k8s.io/kueue@${KUEUE_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  rm -rf "$CACHE/kueue-manifests"; mkdir -p "$CACHE/kueue-manifests"
  cp "$kdir"/config/components/crd/bases/*.yaml "$CACHE/kueue-manifests/"
  cp "$kdir/config/components/webhook/manifests.yaml" "$CACHE/kueue-manifests/webhooks.yaml"
  chmod -R u+w "$CACHE/kueue-manifests"
  mv "$work/kueuebin/kueue" "$CACHE/kueue"
  echo "$KUEUE_VERSION" > "$CACHE/kueue.version"
}

if [ "${1:-}" = pause ]; then  # nothing else is built or touched (a full build may be running beside it)
  build_pause
  echo "$CACHE"
  exit 0
fi
build_etcd
build_kwok
build_helm
build_pause
build_coredns
build_kueue
build_k8s
ln -sfn "$CACHE" "$HOME/.cache/diloco/bin/current"
if [ ${#own_go_caches[@]} -gt 0 ] && [ -d "$GOMODCACHE" ]; then  # a build ran: it downloaded modules
  log "removing Go's caches (${own_go_caches[*]})"
  go clean "${own_go_caches[@]}"
fi
log "binaries ready in $CACHE"
echo "$CACHE"
