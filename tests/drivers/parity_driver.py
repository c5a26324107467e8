"""Runs many zerotune trainings in one process group (real engines, real collectives) and writes their losses.

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 tests/drivers/parity_driver.py OUT.json CASES.json

Starting Python, torch and DeepSpeed once per world size instead of once per configuration keeps the
oracle matrix (4 stages x LoRA/full x fp32/bf16 x 1/2 ranks) within CI's time.
"""

import os

import torch

from finetune.train import prepare, train
from tests.helpers import driver_main


def lora_check(model_dir: str, result: dict):
    """After training: is every base weight bit-identical to the saved model, and did every adapter change?"""
    import deepspeed
    from safetensors.torch import load_file

    original = load_file(os.path.join(model_dir, "model.safetensors"))

    def check(engine):
        identical, changed, n_base, n_adapter = True, True, 0, 0
        for name, p in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                value = p.detach().float().cpu().clone()
            if "lora_B" in name:
                n_adapter += 1
                changed &= bool(value.abs().sum() > 0)  # lora_B starts at zero
            elif "lora_" not in name:
                n_base += 1
                key = name.replace("base_model.model.", "").replace(".base_layer", "")
                expected = original[key].to(p.dtype).float()
                identical &= torch.equal(value, expected)
        result.update(base_identical=identical, adapters_changed=changed, n_base=n_base, n_adapter=n_adapter)

    return check


def swap_files(ds: dict, result: dict):
    """After training, before the run ends: the bytes in this run's NVMe swap folders (removed at the end)."""
    from finetune.ds_config import nvme_swap_dirs

    def check(engine):
        dirs = nvme_swap_dirs(ds)
        result["swap_dirs"] = dirs
        result["swap_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for p in dirs for d, _, fs in os.walk(p) for f in fs)

    return check


def fused_mlps(result: dict):
    """After training: how many decoder MLPs ran finetune/perf/fused_mlp.py's forward."""
    def check(engine):
        result["fused_mlps"] = sum(hasattr(m, "_fused_mlp_liger") for m in engine.module.modules())

    return check


def one_case(case: dict) -> dict:
    run = prepare(case["config"], case["deepspeed"], case["overrides"])
    result = {"zero_optimization": run.ds["zero_optimization"], "micro_batch_size": run.recipe.train.micro_batch_size,
              "grad_accum": run.recipe.train.grad_accum,
              "activation_checkpointing": run.recipe.model.activation_checkpointing,
              "sequence_parallel": run.recipe.train.sequence_parallel}
    checks = [swap_files(run.ds, result), fused_mlps(result)]
    if run.recipe.lora.enabled:
        checks.append(lora_check(run.recipe.model.path, result))
    records = train(run, on_end=lambda engine: [check(engine) for check in checks])
    steps = [r for r in records if "loss" in r]
    result.update(loss=[r["loss"] for r in steps], target_tokens=[r["target_tokens"] for r in steps],
                  grad_norm=[r["grad_norm"] for r in steps],
                  eval_loss=[r["eval_loss"] for r in records if "eval_loss" in r])
    return result


if __name__ == "__main__":
    driver_main(one_case)
