#!/usr/bin/env bash
# Memory budgets on the GPU machine: Mistral-7B's shape (one saved random init), seq 2048, the recipes' batch,
# `--deepspeed auto train.gpu_memory_gib=B` (enforced with set_per_process_memory_fraction), 10 steps per run.
#   GPUS=2 CPU_GIB=250 bash benchmarks/gpu_budget.sh full:24 full:40 lora:24 ...   (KIND:GIB, run in this order)
# Each KIND:GIB is one `zerotune compare --budgets GIB` (launch/compare.sh) in /tmp/r/KINDGIB; its summary, logs and
# metrics go to $OUT/KINDGIB.tgz as soon as it ends. CPU_GIB is train.cpu_memory_gib: the device VMs report a small
# MemTotal that grows on demand. Wheels (.whl) and the tokenizer (.gpu/tokenizer) are carried (benchmarks/gpu_setup.sh).
source benchmarks/gpu_setup.sh
mkdir -p /tmp/r
C="model.path=/tmp/init model.tokenizer=.gpu/tokenizer data.path=/tmp/syn.jsonl data.format=text data.overlong=truncate
   optim.warmup_steps=2 train.cpu_memory_gib=${CPU_GIB:-120}"
one() {  # KIND GIB
  date
  bash launch/compare.sh --config recipes/mistral7b_$1.yaml --budgets $2 --steps 10 --skip-steps 2 --gpus ${GPUS:-1} \
    --out /tmp/r/$1$2 $C > /tmp/r/$1$2.txt 2>&1
  (cd /tmp/r && tar czf $OUT/$1$2.tgz $1$2.txt $1$2/summary.* $1$2/logs $1$2/*/metrics.jsonl $1$2/*/memory_plan.json 2>/dev/null)
  grep -h "memory plan\|step 10/10\|Error" /tmp/r/$1$2/logs/*.log | grep -v "^\[" | tail -3; free -g | sed -n 2p
}
for kind_gib in "$@"; do one "${kind_gib%:*}" "${kind_gib#*:}"; done
