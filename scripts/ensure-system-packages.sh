#!/usr/bin/env bash
# Debian packages the project needs, installed when missing:
# - libibverbs1: Mooncake's engine.so links libibverbs.so.1 even for TCP (required);
# - iptables: the two-host tests inject packet loss and partitions with it inside network namespaces (optional:
#   without it, or without root, those tests skip and say why).
set -euo pipefail
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
PATH="$PATH:/usr/sbin:/sbin" command -v iptables >/dev/null 2>&1 || missing+=(iptables)
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo"; else
    if [[ " ${missing[*]} " == *" libibverbs1 "* ]]; then
      echo "libibverbs1 is missing and this user cannot install it: run 'apt-get install libibverbs1' as root" >&2
      exit 1
    fi
    echo "iptables is missing and this user cannot install it: the two-host tests will skip" >&2
    exit 0
  fi
fi
echo "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
