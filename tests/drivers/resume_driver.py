"""Straight vs interrupted-and-resumed trainings in one process group, plus the engine's logits for export checks.

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 tests/drivers/resume_driver.py OUT.json CASES.json

Each case is {"name", "deepspeed", "overrides", "kind"}: kind "straight" also records the engine's logits on a fixed
prompt (and, for LoRA with train.export on, a merged export) after its last step; "stop" and "resume" are the two
halves, their result the losses. Kind "reshard" resumes a checkpoint on another layout and, right after loading it, compares per
trained parameter the engine's fp32 master, training-precision weight and Adam moments with the checkpoint's
portable files: its result holds the losses, the names that differ, the optimizer's steps and DeepSpeed's counters.
"""

import contextlib
import json
import os

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from finetune import checkpoint, dist
from finetune.checkpoint import portable
from finetune.export.weights import export_engine
from finetune.data.tokenizer import load_tokenizer
from finetune.train import prepare, train
from tests.helpers import SMALL_VOCAB, TINY_RECIPE, driver_main

TOKENIZER = load_tokenizer(SMALL_VOCAB)  # the cases train the small-vocabulary tiny model
PROMPT_IDS = [TOKENIZER.bos_id] + TOKENIZER.encode("[INST] What does ZeRO stage 3 partition? [/INST]")


def record_logits(out_dir: str, merged: bool):
    def on_end(engine):
        engine.module.eval()
        with torch.no_grad():
            logits = engine.module(input_ids=torch.tensor([PROMPT_IDS])).logits.float()
        if dist.is_main():
            torch.save(logits, os.path.join(out_dir, "engine_logits.pt"))
        if merged:
            export_engine(engine, os.path.join(out_dir, "merged"), TOKENIZER, lora=True, merge=True)
    return on_end


def compare_with_portable(engine, checkpoint: str) -> dict:
    """Every trained parameter's state in the engine against the checkpoint's portable files, exactly: its fp32
    master, training-precision weight (the master, cast) and Adam moments; and the optimizer's steps, DeepSpeed's
    counters and the schedule's step. All ranks call this (the gathers are collectives)."""
    folder = os.path.join(checkpoint, portable.FOLDER)
    with open(os.path.join(folder, portable.INDEX)) as f:
        index = json.load(f)
    differ = []
    for name, p in portable.trained(engine):
        def saved(key):
            return torch.load(os.path.join(folder, f"{index['params'][name]['file']}.{key}.pt"), weights_only=True)
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            weight = p.detach().cpu().clone()
        got = {"fp32": safe_get_full_fp32_param(p).cpu(), "weight": weight,
               **{key: safe_get_full_optimizer_state(p, key).cpu() for key in portable.MOMENTS}}
        want = {"fp32": saved("fp32"), "weight": saved("fp32").to(weight.dtype), **{k: saved(k) for k in portable.MOMENTS}}
        differ += [f"{name}:{key}" for key in got if not torch.equal(got[key].view(-1), want[key].view(-1))]
    return {"checked": len(portable.trained(engine)), "differ": differ, "steps": portable.optimizer_steps(engine),
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "schedule_step": engine.lr_scheduler.last_epoch}


@contextlib.contextmanager
def compared_on_load(result: dict):
    """Within it, the checkpoint a run resumes is compared with the engine right after loading it, into `result`."""
    load = checkpoint.load

    def load_and_compare(engine, path):
        step = load(engine, path)
        result.update(compare_with_portable(engine, path))
        return step

    checkpoint.load = load_and_compare
    try:
        yield
    finally:
        checkpoint.load = load


def one_case(case: dict):
    run = prepare(TINY_RECIPE, case["deepspeed"], case["overrides"])
    if case["kind"] == "reshard":
        result: dict = {}
        with compared_on_load(result):
            losses = [r["loss"] for r in train(run) if "loss" in r]
        return {"losses": losses, **result}
    # the merged model beside the run's own export, where it writes one
    merged = run.recipe.lora.enabled and run.recipe.train.export
    on_end = record_logits(run.recipe.train.output_dir, merged) if case["kind"] == "straight" else None
    return [r["loss"] for r in train(run, on_end=on_end) if "loss" in r]


if __name__ == "__main__":
    driver_main(one_case)
