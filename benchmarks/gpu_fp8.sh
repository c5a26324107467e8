#!/usr/bin/env bash
# model.precision=fp8 on one GPU machine, beside benchmarks/gpu_precision.sh's quality gate: (1) Mistral-7B LoRA in a
# 16 GiB budget, the planner choosing (--deepspeed auto train.gpu_memory_gib=16, the allocator capped there), 6 steps;
# (2) LoRA ZeRO-2 speed at 8 rows of 2,048 tokens per step, bf16 against fp8 (benchmarks/precision.py, 12 steps).
#   bash benchmarks/gpu_fp8.sh      # carry .whl (deepspeed, liger-kernel, mistral-common)
# Results: $OUT/fp8.tgz (the budget run's log, memory plan and metrics; the speed runs' precision.json and logs).
source benchmarks/gpu_setup.sh
mkdir -p runs/fp8
deepspeed --num_gpus 1 --master_addr 127.0.0.1 --master_port 29511 finetune/main.py --deepspeed auto \
  --config recipes/mistral7b_lora.yaml model.path=/tmp/init model.tokenizer=mistral-common data.path=/tmp/syn.jsonl \
  data.format=text data.overlong=truncate model.precision=fp8 train.gpu_memory_gib=16 train.cpu_memory_gib=120 \
  train.max_steps=6 train.output_dir=runs/fp8/budget16 train.overwrite=true train.sample_prompt=null \
  train.export=false > runs/fp8/budget16.log 2>&1
grep -v "^\[20" runs/fp8/budget16.log | grep -i "memory plan\|plan:\|fits\|speed-ups\|step 6/6\|error" | tail -8
python benchmarks/precision.py --model /tmp/init --tokenizer mistral-common --data /tmp/syn.jsonl --runs lora \
  --rows 8 --steps 12 --warmup-skip 2 --timeout 200 --out runs/fp8/speed8/precision.json | grep -v "^step"
tar czf "$OUT/fp8.tgz" --exclude=.cache -C runs fp8
