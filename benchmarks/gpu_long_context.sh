#!/usr/bin/env bash
# benchmarks/long_context.py on one GPU machine, in calls that each end inside a per-command time limit: every call
# continues the results carried in (runs/lc/long_context.json, --resume) and starts no run after STOP_AFTER seconds.
#   bash benchmarks/gpu_long_context.sh [long_context.py options, e.g. --systems zerotune --lengths 32768]
#   SHAPE=v03 bash benchmarks/gpu_long_context.sh ...   # Mistral v0.3's shape: no sliding window, rope_theta 1e6
# Carry .whl (shared/device/build-wheels.sh: deepspeed, liger-kernel, mistral-common, ...) and runs/lc when it exists.
# Results: $OUT/lc.tgz (long_context.json, each run's log, metrics and resolved recipe), the table.
source benchmarks/gpu_setup.sh
model=/tmp/init; out=runs/lc
if [ "${SHAPE:-}" = v03 ]; then
  model=/tmp/init_v03; out=runs/lc_v03
  [ -f $model/config.json ] || python -c "
import torch; from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
with torch.device('cuda'): m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained('benchmarks/shapes/mistral7b_v03'), dtype=torch.bfloat16)
m.save_pretrained('$model')" 2>&1 | tail -1
fi
python benchmarks/long_context.py --model $model --out $out --resume --stop-after "${STOP_AFTER:-400}" "$@"
rc=$?
tar czf "$OUT/lc.tgz" --exclude='docs_*.jsonl' --exclude='.cache' --exclude='*.pt' --exclude='checkpoints' -C runs "$(basename $out)"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | head -1
exit $rc
