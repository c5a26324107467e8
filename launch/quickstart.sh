#!/usr/bin/env bash
# Install zerotune and train the tiny recipe under ZeRO-3 with 2 processes (2 CPU processes, or 2 GPUs when present),
# then print a sample generation from the trained model. Run from the repository root: bash launch/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1; then
  pip install -q --no-build-isolation -e .                      # GPU machines keep the torch they have
else
  pip install -q torch==2.13.0                                  # the CPU build, alone first: deepspeed builds against it
  pip install -q --no-build-isolation -c .ci/constraints.txt -e .   # the versions CI tests
fi
port=$(python -c 'from finetune.dist import free_port; print(free_port())')
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
# bf16 on GPUs; fp32 on a CPU, where bf16 rounds differently with and without native support (and is slow if emulated)
ds=$(python -c 'from finetune.ds_config import quickstart_ds_config; print(quickstart_ds_config())')
deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port "$port" \
  finetune/main.py --deepspeed "$ds" --config recipes/tiny.yaml train.overwrite=true "$@"
