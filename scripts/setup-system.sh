#!/usr/bin/env bash
# System packages the test suite needs beyond Python and Go: headless Chromium and its driver (the
# synchronizer's status page test), OpenSSL (the test control plane's certificates), a C compiler
# (the pod sandbox's pause program), and for the real node of the end-to-end tests containerd, runc,
# the CNI plugins, iptables and nsenter, with podman and mmdebstrap to build the images. Installed
# with apt-get when running as root on Debian/Ubuntu; otherwise prints what to install.
set -euo pipefail
need=()
want() { command -v "$1" >/dev/null 2>&1 || need+=("$2"); }
want chromium chromium
want chromedriver chromium-driver
want openssl openssl
want cc gcc
want containerd containerd
want runc runc
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
want iptables iptables
want nsenter util-linux
want podman podman
want mmdebstrap mmdebstrap
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup-system] installing ${need[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "[setup-system] missing system packages: ${need[*]} — install them (e.g. sudo apt-get install ${need[*]})" >&2
fi
