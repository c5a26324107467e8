#!/usr/bin/env bash
# Train on this machine alone, one rank per GPU (or NUM_GPUS ranks on CPU), through zerotune's launcher.
#   launch/single_node.sh --deepspeed ds_configs/zero3.json --config recipes/tiny.yaml train.max_steps=10
# Every argument goes to finetune/main.py; a leading `--` (as `zerotune launch` and launch/multinode.sh take them) may be
# given or left out. NUM_GPUS overrides the count; launcher options (e.g. --dry-run) go in LAUNCH_ARGS.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NUM_GPUS" -gt 0 ]] || NUM_GPUS=1
fi
hostfile="$(mktemp "${TMPDIR:-/tmp}/zerotune-localhost.XXXXXX")"
trap 'rm -f "$hostfile"' EXIT
echo "localhost slots=${NUM_GPUS}" > "$hostfile"
[[ "${1:-}" == -- ]] && shift  # the script adds the launcher's own `--`: a second one would reach the recipe
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
# shellcheck disable=SC2086  # LAUNCH_ARGS is a list of options
"${PYTHON:-python}" -m finetune.multinode.launcher --hostfile "$hostfile" ${LAUNCH_ARGS:-} -- "$@"
