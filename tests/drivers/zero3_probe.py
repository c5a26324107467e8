"""Loads a saved model under ZeRO-3 on every rank and reports what each rank holds (run with 2 ranks).

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 tests/drivers/zero3_probe.py MODEL_DIR OUT_PREFIX
"""

import json
import os
import sys

from tests.helpers import ROOT, skip_shm_build

skip_shm_build()

from finetune import dist, perf  # noqa: E402
from finetune.config import load_recipe  # noqa: E402
from finetune.ds_config import resolve_ds_config  # noqa: E402
from finetune.model.build import build_model, resident_parameter_elements, trainable_parameters  # noqa: E402

if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    model_dir, out_prefix = args
    dist.init()
    recipe = load_recipe(os.path.join(ROOT, "recipes", "tiny.yaml"), [f"model.path={model_dir}", "lora.enabled=false"])
    ds = resolve_ds_config(os.path.join(ROOT, "ds_configs", "zero3.json"), recipe, dist.world_size(), 128)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every tensor, even the norms
    model, keepalive = build_model(recipe.model, recipe.lora, ds)
    perf.apply(model, recipe, ds)
    _, total = trainable_parameters(model)
    with open(f"{out_prefix}.{dist.rank()}.json", "w") as f:
        json.dump({"resident": resident_parameter_elements(model), "total": total, "world": dist.world_size()}, f)
    dist.shutdown()
    dist.exit_process(0)
