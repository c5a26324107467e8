#!/usr/bin/env bash
# On a 2-GPU machine: the tiny recipe, then Mistral-7B's shape (random init) for 10 steps, LoRA and full, under ZeRO-3.
# Usage: bash benchmarks/gpu_smoke.sh OUT_DIR [TOKENIZER_DIR]   (TOKENIZER_DIR: a folder with tokenizer.model;
# default "mistral-common", the tokenizer inside the mistral-common wheel)
set -uo pipefail
out=${1:?OUT_DIR}; tok=${2:-mistral-common}
mkdir -p "$out"
python benchmarks/synthetic_data.py "$out/synthetic.jsonl" --docs 400 --words 2200
run() {  # name, then finetune/main.py arguments
  local name=$1; shift
  local port; port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  echo "=== $name"
  deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port "$port" finetune/main.py "$@" \
    model.tokenizer="$tok" train.output_dir="$out/$name" train.overwrite=true > "$out/$name.log" 2>&1
  echo "exit $?"; grep -E "^(data|model|step|sample|eval)|Error|error" "$out/$name.log" | grep -v "^\[" | tail -25
}
run tiny --deepspeed ds_configs/zero3.json --config recipes/tiny.yaml
big=(model.path=recipes/mistral7b_shape model.random_init=true data.path="$out/synthetic.jsonl" data.format=text
     data.overlong=truncate train.max_steps=10 train.micro_batch_size=8 train.log_every=1 optim.warmup_steps=2)
run lora_zero3 --deepspeed ds_configs/zero3.json --config recipes/mistral7b_lora.yaml "${big[@]}"
run full_zero3 --deepspeed ds_configs/zero3.json --config recipes/mistral7b_full.yaml "${big[@]}"
