#!/usr/bin/env bash
# Install zerotune into a virtual environment (the active one, else .venv in this checkout, created when missing) and
# train the tiny recipe under ZeRO-3 with 2 processes (2 CPU processes, or 2 GPUs when present), then print a sample
# generation from the trained model. Run from the repository root: bash launch/quickstart.sh
# Extra arguments are recipe overrides (train.max_steps=50); --verbose also prints DeepSpeed's own logging.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's output only when it fails: even with -q, an editable install passes on its build backend's notices.
quietly() {
  local log; log=$(mktemp)
  if "$@" >"$log" 2>&1; then rm -f "$log"; else local rc=$?; cat "$log" >&2; rm -f "$log"; return $rc; fi
}
# Never into the system's Python: the active virtual environment, else .venv here (the README's install makes the same).
if [[ -n "${VIRTUAL_ENV:-}" ]]; then
  echo "installing zerotune into the active virtual environment, $VIRTUAL_ENV"
else
  if [[ -d .venv ]]; then made="the virtual environment here"; else quietly python3 -m venv .venv; made="a new virtual environment here"; fi
  # shellcheck disable=SC1091  # created above
  . .venv/bin/activate
  echo "installing zerotune into .venv, $made (for the commands after this one: . .venv/bin/activate)"
fi
# The README's install lines (tests/unit/test_docs.py checks that they are the same), with pip's -q.
quietly pip install -q --upgrade pip setuptools wheel
if command -v nvidia-smi >/dev/null 2>&1; then
  quietly pip install -q --no-build-isolation -e '.[plot]'                         # keeps the CUDA torch the environment has
else
  quietly pip install -q torch==2.13.0                                             # the CPU build, alone first: deepspeed builds against it
  quietly pip install -q --no-build-isolation -c .ci/constraints.txt -e '.[plot]'  # the versions CI tests
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}                                     # no GPU to look for, and no notice that none was found
fi
port=${MASTER_PORT:-$(python -c 'from finetune.dist import free_port; print(free_port())')}  # MASTER_PORT: choose it
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
# bf16 on GPUs; fp32 on a CPU, where bf16 rounds differently with and without native support (and is slow if emulated)
ds=$(python -c 'from finetune.ds_config import quickstart_ds_config; print(quickstart_ds_config())')
# The launcher's own INFO lines only with --verbose (the ranks read it from their arguments).
log_level=error
for arg in "$@"; do if [[ $arg == --verbose ]]; then log_level=info; fi; done
# 20 warmup steps: the tiny model then answers the sample prompt with its training text word for word within the
# recipe's 120 steps, by a wide margin (after the recipe's 5 it can still mix up two of its training answers there).
deepspeed --log_level "$log_level" --num_gpus 2 --master_addr 127.0.0.1 --master_port "$port" \
  finetune/main.py --deepspeed "$ds" --config recipes/tiny.yaml train.overwrite=true \
  optim.warmup_steps=20 train.log_every=40 train.sample_max_new_tokens=24 "$@"
