#!/usr/bin/env bash
# Train on the nodes of a hostfile (`HOST slots=N` lines; passwordless ssh to each; the repo and the venv at the
# same path on every node). Checks every node first, then runs DeepSpeed's runner over pdsh (or --launcher openmpi).
#   launch/multinode.sh hostfiles/my_nodes [--launcher openmpi] [--dry-run] -- --deepspeed ds_configs/zero3.json --config recipes/x.yaml
# NCCL_*/GLOO_*/HF_* variables exported here reach every rank (through .deepspeed_env); see docs/multinode.md.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 HOSTFILE [launcher options] -- [finetune/main.py arguments]" >&2
  exit 2
fi
hostfile="$1"
shift
repo="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" -m finetune.multinode.launcher --hostfile "$hostfile" "$@"
