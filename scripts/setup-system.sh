#!/usr/bin/env bash
# System packages the test suite needs beyond Python and Go: headless Chromium and its driver
# (for the synchronizer's status page test). Installed with apt-get when running as root on
# Debian/Ubuntu; otherwise prints what to install.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup-system] installing ${need[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "[setup-system] missing system packages: ${need[*]} — install them (e.g. sudo apt-get install ${need[*]})" >&2
fi
