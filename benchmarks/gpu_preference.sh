#!/usr/bin/env bash
# benchmarks/preference.py on one GPU machine, in one command: zerotune's LoRA DPO, TRL's DPOTrainer on the same
# pairs, and zerotune's full DPO under ZeRO-3, one after another (each a `deepspeed --num_gpus 1` launch).
#   PYTHONUNBUFFERED=1 bash benchmarks/gpu_preference.sh [preference.py options, e.g. --saved-init /tmp/init]
# Carry .whl: shared/device/build-wheels.sh trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 (with
# deepspeed, liger-kernel and mistral-common, the tokenizer). Results under $OUT: preference.json, log.txt (the whole
# output), versions.txt and runs.tgz (each launch's log, metrics.jsonl, resolved recipe and memory plan).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 TORCH_EXTENSIONS_DIR=/tmp/tex TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  date -u '+%Y-%m-%d %H:%M UTC'
  nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader
  nproc
  python3 -c "
import importlib.metadata as md, platform, torch
print(f'Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})')
print(', '.join(f'{n} {md.version(n)}' for n in ('transformers', 'peft', 'accelerate', 'deepspeed', 'liger-kernel',
                                                'trl', 'datasets', 'triton')))"
} 2>&1 | tee "$OUT/versions.txt"
python3 benchmarks/preference.py --out runs/preference/preference.json "$@" 2>&1 | tee "$OUT/log.txt"
rc=$?
cp runs/preference/preference.json "$OUT/" 2>/dev/null
tar czf "$OUT/runs.tgz" --exclude=.cache --exclude='*.pt' --exclude=tokenizer --exclude='pairs*.jsonl' \
  -C runs preference 2>/dev/null
exit $rc
