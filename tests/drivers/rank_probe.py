"""What a rank sees of its own process, as JSON on stdout: for comparing a rank forked by tests/fixtures/zygote.py with
one started as a fresh interpreter (tests/integration/test_rank_starter.py).

    RANK=0 WORLD_SIZE=2 ... python tests/drivers/rank_probe.py --local_rank=0 [exit=CODE] [raise]

It imports what a zerotune rank imports, joins the process group (gloo on loopback) and all-reduces its rank + 1;
then, where asked, it ends with `exit=CODE` through finetune.dist.exit_process (os._exit, as every zerotune rank
ends) or raises.
"""

import json
import os
import random
import sys
import threading

THREADS_AT_START = threading.active_count()

import numpy  # noqa: E402
import peft  # noqa: E402, F401
import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402, F401

import finetune.train  # noqa: E402, F401
from finetune import dist  # noqa: E402


def main() -> None:
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("--"))
    torch_dist.init_process_group("gloo", init_method="env://")
    total = torch.tensor([float(torch_dist.get_rank() + 1)])
    torch_dist.all_reduce(total)
    facts = {
        "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "script_folder": sys.path[0],
        "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "all_reduce": total.item(),
        "session_leader": os.getsid(0) == os.getpid(), "threads_at_start": THREADS_AT_START,
        "torch_threads": torch.get_num_threads(), "torch_seed": torch.initial_seed(), "torch_rand": torch.rand(3).tolist(),
        "random": random.random(), "numpy_random": float(numpy.random.random()), "parent": os.getppid(),
    }
    print(json.dumps(facts), flush=True)
    print(f"stderr of rank {facts['rank']}", file=sys.stderr, flush=True)
    torch_dist.destroy_process_group()
    if "raise" in sys.argv:
        raise RuntimeError(f"rank {facts['rank']} raised on purpose")
    if "exit" in opts:
        dist.exit_process(int(opts["exit"]))


if __name__ == "__main__":
    main()
