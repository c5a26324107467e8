"""A tiny entry point for launcher tests whose ranks must misbehave on purpose: all-reduce a number per step, log it.

    zerotune launch --hostfile H --script tests/drivers/launch_probe.py -- steps=5 train.output_dir=DIR [fail_rank=1]

Each step rank 0 appends {"step", "loss", "world"} to DIR/metrics.jsonl, "loss" being an all-reduced number that
depends on every rank. `fail_rank` exits with code 3 at `fail_step`; `survivor=hang` makes the other ranks stop
calling collectives and sleep, as a rank stuck in NCCL would.
"""

import importlib
import json
import os
import socket
import sys
import time

from finetune import dist


def main() -> int:
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("--"))
    steps, pause = int(opts.get("steps", "5")), float(opts.get("pause", "0"))
    fail_rank, fail_step = int(opts.get("fail_rank", "-1")), int(opts.get("fail_step", "0"))
    out = opts["train.output_dir"]
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # the JIT build costs 30-70 s
    dist.init(timeout_minutes=float(opts.get("timeout_minutes", "5")))
    print(f"PROBE rank={dist.rank()} world={dist.world_size()} pid={os.getpid()} host={socket.gethostname()} "
          f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    os.makedirs(out, exist_ok=True)
    for step in range(1, steps + 1):
        if dist.rank() == fail_rank and step == fail_step:
            print(f"PROBE rank={dist.rank()} failing on purpose at step {step}", flush=True)
            return 3
        if fail_rank >= 0 and step == fail_step and opts.get("survivor") == "hang":
            while True:  # a rank stuck in a collective that never completes
                time.sleep(1)
        loss = float(dist.all_reduce_sum((dist.rank() + 1) * 0.5 / step)) / dist.world_size()
        if dist.is_main():
            with open(os.path.join(out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "world": dist.world_size()}) + "\n")
        time.sleep(pause)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
