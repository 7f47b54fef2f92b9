#!/usr/bin/env bash
# Installs what building and testing tansy needs on Debian 12 / Ubuntu (apt). Skips apt when all is present.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config git xz-utils curl python3-venv python3-pip
      nlohmann-json3-dev libpcre2-dev libutf8proc-dev libasio-dev libedit-dev
      libgtest-dev libgmock-dev clang libclang-rt-14-dev libomp-dev
      chromium chromium-driver)  # the last two: tests/server/test_webui.py (the chat page in a browser)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#pkgs[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
