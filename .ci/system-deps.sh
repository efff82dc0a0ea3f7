#!/usr/bin/env bash
# Installs the Debian packages that the test suite needs, only those that are missing.
# Idempotent: a second run installs nothing and never touches the network.
# SYSTEM_DEPS_DRY_RUN=1 only prints what it would install.
set -euo pipefail

# Each entry is "command:package": the package is installed when the command is not found.
NEEDED=(
    "prometheus:prometheus"
    "promtool:prometheus"
    "chromium:chromium" "chromedriver:chromium-driver"
)

missing=()
for entry in "${NEEDED[@]}"; do
    cmd="${entry%%:*}"
    pkg="${entry#*:}"
    if ! command -v "$cmd" >/dev/null 2>&1 && ! dpkg -s "$pkg" >/dev/null 2>&1; then
        missing+=("$pkg")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi

# De-duplicate while keeping order.
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | awk '!seen[$0]++')
if [ "${SYSTEM_DEPS_DRY_RUN:-0}" = "1" ]; then
    echo "system-deps: would install ${missing[*]}"
    exit 0
fi
echo "system-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}"
