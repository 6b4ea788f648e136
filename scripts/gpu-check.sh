#!/usr/bin/env bash
# `make gpu-check`: the check on a GPU host that has torch and no package index, run from the repository root with
# .gpu/wheels carried there (`make gpu-wheels` fills it on a machine with an index). The host's own python3, never
# .venv; without a GPU it prints {"gpu": false, ...} and exits 0. See workers/gpu_check.py and docs/testing.md.
set -euo pipefail
cd "${0%/*}/.."  # no external program before python3: the test runs this with a PATH of python3 alone
exec python3 -m workers.gpu_check check "${GPU_WHEELS:-.gpu/wheels}"
