#!/usr/bin/env bash
# The 2xH200 benchmark, one command: the liger-kernel parity test on the GPU, then zerotune at its defaults
# against HF Trainer + DeepSpeed (defaults and best hand-tuned) on Mistral-7B's shape (benchmarks/vs_peer.py).
#   GPUS=2 bash benchmarks/gpu_vs_peer.sh [vs_peer.py options, e.g. --configs full_zero2 --systems zerotune]
# Carry .whl (deepspeed, liger-kernel, pytest wheels) and .gpu/tokenizer. Results: $OUT/$VP_NAME.tgz (vs_peer.json, logs), the table.
source benchmarks/gpu_setup.sh
if [ -z "${SKIP_KERNEL_TEST:-}" ]; then
  python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_fused_lora.py tests/gpu/test_gpu_lora_dropout.py tests/gpu/test_gpu_fp8.py > /tmp/gpu_kernels.txt 2>&1
  kernels_rc=$?
  grep -v "^\[" /tmp/gpu_kernels.txt | tail -40 | tee "$OUT/gpu_kernels.txt"
  # zerotune's defaults use these kernels and functions: a failed parity test means the table would time wrong maths
  [ $kernels_rc -eq 0 ] || { echo "GPU kernel tests failed: no benchmark"; exit 1; }
fi
name=${VP_NAME:-vp}  # several runs on one machine: VP_NAME=a ..., VP_NAME=b ...
# runs/$name/vs_peer.json carried back in (with --resume) continues a benchmark that a capped call cut short.
python benchmarks/vs_peer.py --model /tmp/init --tokenizer "${TOKENIZER:-.gpu/tokenizer}" --data /tmp/syn.jsonl --gpus "${GPUS:-2}" \
  --out "runs/$name" "$@"
rc=$?  # 3: --stop-after left runs for --resume
# The device returns at most 8 files: one archive per call (vs_peer.json, logs, each zerotune run's metrics and plan).
rm -rf runs/"$name"/*/.cache && tar czf "$OUT/$name.tgz" -C runs "$name"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | head -1
exit $rc
