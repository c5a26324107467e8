#!/usr/bin/env bash
# The quality gate of model.precision=fp8 on one GPU machine (benchmarks/precision.py): bf16 and fp8 runs from the
# same saved init of Mistral-7B's shape (/tmp/init) on the same synthetic text, compared step by step.
#   PR_NAME=lora bash benchmarks/gpu_precision.sh --runs lora [precision.py options, e.g. --precisions fp8 --steps 200]
# A call is capped at 10 minutes: run each kind (or each precision) as its own call with its own PR_NAME, then
#   python benchmarks/precision.py --table runs/a/precision.json runs/b/precision.json --out runs/precision.json
# Carry .whl (deepspeed, liger-kernel, mistral-common for the tokenizer).
# Results: $OUT/$PR_NAME.tgz (precision.json, its plot, each run's log, metrics.jsonl, speedups.json), the table.
source benchmarks/gpu_setup.sh
name=${PR_NAME:-precision}
python benchmarks/precision.py --model /tmp/init --tokenizer mistral-common --data /tmp/syn.jsonl \
  --out "runs/$name/precision.json" "$@"
rc=$?
# The device returns a few files only: one archive per call, without the runs' tokenized-data caches.
tar czf "$OUT/$name.tgz" --exclude=.cache -C runs "$name"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | head -1
exit $rc
