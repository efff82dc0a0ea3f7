#!/usr/bin/env bash
# Installs the Debian packages that the test suite needs, only those that are missing.
# Idempotent: a second run installs nothing and never touches the network.
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
echo "system-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}"
