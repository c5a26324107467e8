"""Builds real DeepSpeed engines on the saved tiny model and reports the bytes each rank holds (run with 2 ranks).

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 tests/drivers/estimate_probe.py MODEL_DIR CASES.json OUT_PREFIX

For every case (a DeepSpeed JSON, LoRA or full) it takes one optimizer step, so Adam's states exist, then counts:
weights (ZeRO-3: each parameter's partition `ds_tensor`), the fp32 master (ZeRO-1/2 `single_partition_of_fp32_groups`,
ZeRO-3 `fp32_partitioned_groups_flat`) and Adam's `exp_avg`/`exp_avg_sq` in the wrapped torch optimizer's state.
A tensor sharing storage with one already counted (a master that is the weights themselves) is counted once.
"""

import json
import os
import sys

from tests.helpers import ROOT, skip_shm_build

skip_shm_build()

import deepspeed  # noqa: E402
import torch  # noqa: E402

from finetune import dist, perf  # noqa: E402
from finetune.config import load_recipe  # noqa: E402
from finetune.ds_config import engine_config, resolve_ds_config  # noqa: E402
from finetune.model.build import build_model  # noqa: E402
from finetune.model.optim import build_optimizer  # noqa: E402


def _bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0 or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def measure(engine) -> dict:
    seen = set()
    shards = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    trained = [getattr(p, "ds_tensor", p) for p in engine.module.parameters() if p.requires_grad]
    opt = engine.optimizer
    master = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", [])
    inner = getattr(opt, "optimizer", opt)  # ZeRO wraps the torch optimizer; ZeRO-0 hands it over as is
    adam = [v for state in inner.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    out = {"trained_params": _bytes(trained, set()), "params": _bytes(shards, seen)}
    out["master"] = _bytes(master, seen)
    out["adam"] = _bytes(adam, seen)
    out["adam_tensors"] = len(adam)
    return out


def run_case(model_dir: str, case: dict) -> dict:
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    recipe = load_recipe(os.path.join(ROOT, "recipes", "tiny.yaml"),
                         [f"model.path={model_dir}", f"lora.enabled={str(case['lora']).lower()}"])
    ds = resolve_ds_config(case["deepspeed"], recipe, dist.world_size(), 128)
    model, keepalive = build_model(recipe.model, recipe.lora, ds)
    perf.apply(model, recipe, ds)
    optimizer, scheduler = build_optimizer(model, recipe.optim, 10, ds)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=engine_config(ds))
    ids = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(dist.rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    result = measure(engine)
    engine.destroy()
    del keepalive
    unset_hf_deepspeed_config()  # the next case may be another stage
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    model_dir, cases_file, out_prefix = args
    dist.init()
    with open(cases_file) as f:
        cases = json.load(f)
    results = {case["name"]: run_case(model_dir, case) for case in cases}
    with open(f"{out_prefix}.{dist.rank()}.json", "w") as f:
        json.dump(results, f)
    dist.shutdown()
    dist.exit_process(0)
