#!/usr/bin/env bash
# On one GPU machine: the tests/gpu tier in one pytest process, then the tiny recipe trained for a few steps with the
# default output, in one process (`zerotune train`) and through the DeepSpeed launcher as launch/quickstart.sh starts
# it; each output is kept whole under $OUT (or ./gpu_tier) and searched for warnings that zerotune did not write.
# Needs, where the machine lacks them, the wheels of shared/device/build-wheels.sh in .whl/ (with mistral-common, the
# tiny recipe's tokenizer). Extra arguments go to pytest. Usage: bash benchmarks/gpu_tier.sh [-rA]
set -uo pipefail
out=${OUT:-gpu_tier}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 TORCH_EXTENSIONS_DIR=/tmp/tex PYTHONUNBUFFERED=1 MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo
unset ZEROTUNE_LOG

{
  date -u '+%Y-%m-%d %H:%M UTC'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  python3 - <<'EOF'
import importlib.metadata as md
import platform

import torch

print(f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
print(", ".join(f"{name} {md.version(name)}" for name in ("triton", "transformers", "peft", "accelerate", "deepspeed",
                                                            "liger-kernel", "mistral-common", "pytest")))
EOF
} 2>&1 | tee "$out/versions.txt"

echo "== python3 -m pytest -q -p no:cacheprovider tests/gpu -rs --durations=20 $*"
timeout 450 python3 -m pytest -q -p no:cacheprovider tests/gpu -rs --durations=20 "$@" 2>&1 | tee "$out/gpu_tier.log"
echo "== tests/unit/test_liger_quiet.py (liger installed here)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_liger_quiet.py -rs 2>&1 | tail -3

steps="train.max_steps=20 train.log_every=10 train.overwrite=true"
echo "== python3 -m finetune.cli train --config tiny --deepspeed zero3 train.output_dir=/tmp/runs/one $steps"
timeout 240 python3 -m finetune.cli train --config tiny --deepspeed zero3 train.output_dir=/tmp/runs/one $steps \
  > "$out/train.log" 2>&1
echo "rc=$?" >> "$out/train.log"
cat "$out/train.log"
port=$(python3 -c 'from finetune.dist import free_port; print(free_port())')
echo "== deepspeed --log_level error --num_gpus 1 ... finetune/main.py --deepspeed zero3 --config tiny ... $steps"
timeout 240 deepspeed --log_level error --num_gpus 1 --master_addr 127.0.0.1 --master_port "$port" finetune/main.py \
  --deepspeed zero3 --config tiny train.output_dir=/tmp/runs/launcher $steps > "$out/launcher.log" 2>&1
echo "rc=$?" >> "$out/launcher.log"
cat "$out/launcher.log"
echo "== lines of the two runs that name a warning:"
grep -n -i -E "warn|deprecat" "$out/train.log" "$out/launcher.log" || echo "(none)"
