#!/usr/bin/env bash
# Install the Debian packages the tests start for real (listed in scripts/system-packages.txt, one per line).
# Runs apt-get only where it exists and only for packages not yet installed; elsewhere it says what is
# missing and the tests that need a package skip with that reason (in CI, where apt-get exists, none do).
set -euo pipefail
list="$(dirname "$0")/system-packages.txt"
mapfile -t wanted < <(grep -v '^\s*#' "$list" | awk 'NF {print $1}')
missing=()
for pkg in "${wanted[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: no apt-get here; install ${missing[*]} yourself, or the tests that need them skip" >&2
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "system-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
