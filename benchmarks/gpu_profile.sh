#!/usr/bin/env bash
# Profile one step of zerotune at its defaults on the GPU machine (train.profile_step): time per kind of kernel.
#   GPUS=2 bash benchmarks/gpu_profile.sh lora_zero2 full_zero2     (KIND_ZEROn; 8 rows of 2,048 tokens per GPU per step)
#   STEPS=8 TOKENIZER=mistral-common GPUS=1 bash benchmarks/gpu_profile.sh lora_zero2 -- model.precision=fp8
#     (recipe overrides after --; the last of STEPS steps is profiled, the steps before it give the unprofiled tok/s)
# Writes $OUT/profile_<config>.txt and .json (finetune/perf/profiling.py). Carry .whl and .gpu as for gpu_vs_peer.sh.
source benchmarks/gpu_setup.sh
configs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do configs+=("$1"); shift; done; shift
steps=${STEPS:-4}
for config in "${configs[@]}"; do
  kind=${config%_*}; zero=${config#*_}; out=/tmp/prof_$config
  timeout "${RUN_TIMEOUT:-150}" deepspeed --num_gpus "${GPUS:-2}" --master_addr 127.0.0.1 --master_port $((29500 + RANDOM % 1000)) \
    finetune/main.py --deepspeed ds_configs/$zero.json --config recipes/mistral7b_$kind.yaml model.path=/tmp/init \
    model.tokenizer=${TOKENIZER:-.gpu/tokenizer} data.path=/tmp/syn.jsonl data.format=text data.overlong=truncate \
    train.micro_batch_size=8 train.grad_accum=1 train.max_steps=$steps train.profile_step=$steps optim.warmup_steps=2 \
    train.output_dir=$out train.overwrite=true train.sample_prompt=null train.export=false train.save_every=0 \
    train.log_every=1 "$@" 2>&1 | grep -E "^(step|memory plan|speed-ups)|Error" | tail -$((steps + 2))
  cp $out/profile_step$steps.txt "$OUT/profile_$config.txt"; cp $out/profile_step$steps.json "$OUT/profile_$config.json"
  head -${HEAD:-12} "$OUT/profile_$config.txt"
done
