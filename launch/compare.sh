#!/usr/bin/env bash
# Train one recipe under several ZeRO stages, one after another, and write DIR/summary.md, summary.json and plots.
#   bash launch/compare.sh --config recipes/tiny.yaml --stages 0 1 2 3 --steps 10 --gpus 2 --out runs/compare
# Every rank runs on this machine with a 127.0.0.1 rendezvous; see `zerotune compare --help` for the options.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
exec "${PYTHON:-python}" -m finetune.commands.compare "$@"
