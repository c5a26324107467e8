#!/usr/bin/env bash
# FP8 against the peer on one GPU, Mistral-7B's shape, 8 rows of 2,048 tokens a step, in one command: the FP8 kernels'
# GPU tests, then benchmarks/vs_peer.py: LoRA ZeRO-2 and ZeRO-3 and full ZeRO-3 at zerotune's defaults (which are FP8
# there: model.precision=auto), each beside HF Trainer + DeepSpeed's best settings. 16 steps, the first 6 untimed for
# both systems: ZeRO-3 LoRA takes about 5 steps to reach its speed.
#   bash benchmarks/gpu_fp8_vs_peer.sh            # carry .whl; a capped machine: the same command again continues
# Results: $OUT/${VP_NAME:-fp8}.tgz (vs_peer.json, logs) and the table.
export SKIP_KERNEL_TEST=1 VP_NAME=${VP_NAME:-fp8} GPUS=1 TOKENIZER=mistral-common
source benchmarks/gpu_setup.sh
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_fp8.py 2>&1 | tail -3 | tee "$OUT/gpu_fp8_tests.txt"
grep -q " passed" "$OUT/gpu_fp8_tests.txt" && ! grep -q "failed\|error" "$OUT/gpu_fp8_tests.txt" || { echo "FP8 GPU tests failed: no benchmark"; exit 1; }
common=(--steps 16 --skip 6 --timeout 240 --resume --target lora_zero2=22000 lora_zero3=20000 full_zero3=11000)
start=$SECONDS; budget=${STOP_AFTER:-420}  # start no run after this many seconds of the command
left() { echo $((budget - (SECONDS - start))); }
# zerotune's three rows first, then the peer's: a call cut short has the new figures
bash benchmarks/gpu_vs_peer.sh --configs lora_zero2 lora_zero3 full_zero3 --systems zerotune "${common[@]}" \
  --stop-after "$(left)" || exit
bash benchmarks/gpu_vs_peer.sh --configs lora_zero2 lora_zero3 full_zero3 --systems peer_best "${common[@]}" \
  --stop-after "$(left)"
