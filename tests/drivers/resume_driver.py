"""Straight vs interrupted-and-resumed trainings in one process group, plus the engine's logits for export checks.

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 tests/drivers/resume_driver.py OUT.json CASES.json

Each case is {"name", "deepspeed", "overrides", "kind"}: kind "straight" also records the engine's logits on a fixed
prompt (and writes a merged export for LoRA) after its last step; "stop" and "resume" are the two halves.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from finetune import dist  # noqa: E402
from finetune.export import export_engine  # noqa: E402
from finetune.data.tokenizer import load_tokenizer  # noqa: E402
from finetune.train import prepare, train  # noqa: E402
from tests.helpers import SMALL_VOCAB, TINY_RECIPE, driver_main  # noqa: E402

TOKENIZER = load_tokenizer(SMALL_VOCAB)  # the cases train the small-vocabulary tiny model
PROMPT_IDS = [TOKENIZER.bos_id] + TOKENIZER.encode("[INST] What does ZeRO stage 3 partition? [/INST]")


def record_logits(out_dir: str, lora: bool):
    def on_end(engine):
        engine.module.eval()
        with torch.no_grad():
            logits = engine.module(input_ids=torch.tensor([PROMPT_IDS])).logits.float()
        if dist.is_main():
            torch.save(logits, os.path.join(out_dir, "engine_logits.pt"))
        if lora:
            export_engine(engine, os.path.join(out_dir, "merged"), TOKENIZER, lora=True, merge=True)
    return on_end


def one_case(case: dict) -> list[float]:
    run = prepare(TINY_RECIPE, case["deepspeed"], case["overrides"])
    on_end = record_logits(run.recipe.train.output_dir, run.recipe.lora.enabled) if case["kind"] == "straight" else None
    return [r["loss"] for r in train(run, on_end=on_end) if "loss" in r]


if __name__ == "__main__":
    driver_main(one_case)
