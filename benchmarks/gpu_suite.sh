#!/usr/bin/env bash
# On one GPU machine: the whole test suite in ONE pytest process (no xdist), started by setsid so it
# outlives a shell whose commands are time-limited; `bash benchmarks/gpu_suite.sh poll` waits for it and prints where
# it is. Needs the repository as a tar (git archive HEAD -o .gpurun/src.tar) and, where the machine lacks them, the
# wheels of shared/device/build-wheels.sh in .whl/ and libaio (header + .so, for NVMe offload) in .gpurun/aio/.
# Usage: bash benchmarks/gpu_suite.sh start | poll
set -e
case "${1:-start}" in
start)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  if [ -d .gpurun/aio ]; then  # DeepSpeed's async I/O op links -laio: the standard search path is enough
    cp .gpurun/aio/libaio.h /usr/local/include/
    cp .gpurun/aio/libaio.so.1.0.2 /usr/local/lib/
    ln -sf libaio.so.1.0.2 /usr/local/lib/libaio.so.1; ln -sf libaio.so.1.0.2 /usr/local/lib/libaio.so; ldconfig
  fi
  rm -rf /root/zt /root/done && mkdir -p /root/zt && tar -xf .gpurun/src.tar -C /root/zt
  cp "$0" /root/gpu_suite.sh
  cd /root/zt
  export PYTHONPATH=/tmp/site:/root/zt PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, deepspeed, transformers, peft; print(torch.__version__, deepspeed.__version__, transformers.__version__, peft.__version__)"
  setsid nohup bash -c 'date +%s > /root/start; python3 -m pytest -q -p no:cacheprovider tests --durations=40 \
    --junitxml=/root/junit.xml > /root/suite.log 2>&1; echo $? > /root/done' < /dev/null > /dev/null 2>&1 &
  sleep 5
  WAIT=${WAIT:-500} bash /root/gpu_suite.sh poll
  ;;
poll)
  end=$(( $(date +%s) + ${WAIT:-570} ))
  while [ ! -f /root/done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  echo "elapsed: $(( $(date +%s) - $(cat /root/start) )) s"
  tail -c 3000 /root/suite.log
  if [ -f /root/done ]; then echo "DONE rc=$(cat /root/done)"; cp /root/suite.log /root/junit.xml "${OUT:-.}"/ 2>/dev/null || true; fi
  ;;
esac
