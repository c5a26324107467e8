# A/B on 2xH200: the train loop before (ab_old/, e21cab9) and after cf20509 (one non-finite check per step), interleaved.
source benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -l 5 > runs_smi.csv 2>&1 &
A="--model /tmp/init --tokenizer $PWD/.gpu/tokenizer --data /tmp/syn.jsonl --gpus 2 --steps 10 --skip 3 --timeout 150"
mkdir -p $PWD/runs/ab
save() { cp runs_smi.csv runs/ab/smi.csv; find runs/ab -name .cache -prune -exec rm -rf {} +; tar czf $OUT/ab.tgz -C runs ab; }
new() { python benchmarks/vs_peer.py $A --out $PWD/runs/ab/new$1 --configs $2 --systems ${3:-zerotune} 2>&1 | tail -4; save; }
old() { python ab_old/benchmarks/vs_peer.py $A --out $PWD/runs/ab/old$1 --configs $2 --systems zerotune 2>&1 | tail -4; save; }
old 1 full_zero2; new 1 full_zero2; new 2 full_zero2 peer_best; new 3 lora_zero3; old 3 lora_zero3
new 4 full_zero2; old 4 full_zero2; new 5 full_zero3
