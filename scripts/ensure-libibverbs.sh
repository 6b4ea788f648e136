#!/usr/bin/env bash
# Mooncake's engine.so links libibverbs.so.1 even for TCP; install Debian's libibverbs1 when missing.
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "libibverbs1 is missing and this user cannot install it: run 'apt-get install libibverbs1' as root" >&2
    exit 1
  fi
fi
echo "installing libibverbs1 (needed by the Mooncake transfer engine)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq libibverbs1 >/dev/null
