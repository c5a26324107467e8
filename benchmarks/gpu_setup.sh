# Sourced by the GPU benchmark scripts (benchmarks/gpu_budget.sh, gpu_vs_peer.sh) on the device machine: installs the
# carried wheels (.whl: deepspeed, liger-kernel, pytest, from shared/device/build-wheels.sh and `pip download`) into
# /tmp/site, sets the environment (NVLink multicast off, Hopper arch for JIT builds), writes the synthetic text data
# (/tmp/syn.jsonl) and one saved bf16 random init of Mistral-7B's shape (/tmp/init) that every run loads.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_EXTENSIONS_DIR=/tmp/tex TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 || exit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f /tmp/syn.jsonl ] || python benchmarks/synthetic_data.py /tmp/syn.jsonl --docs 400 --words 2200 >/dev/null
[ -f /tmp/init/config.json ] || python -c "
import torch; from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
with torch.device('cuda'): m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained('recipes/mistral7b_shape'), dtype=torch.bfloat16)
m.save_pretrained('/tmp/init')" 2>&1 | tail -1
