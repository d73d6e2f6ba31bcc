#!/usr/bin/env bash
# Install the Debian packages the tests need: the union of [tool.kvhal] apt in pyproject.toml and
# backends/*/pyproject.toml (ci/apt_packages.py). Packages already installed are not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=$(python3 ci/apt_packages.py)
missing=$(for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
[ -z "$missing" ] && exit 0
echo "apt: installing $(echo $missing)"
SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
