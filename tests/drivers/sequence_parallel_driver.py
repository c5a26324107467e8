"""Runs many zerotune trainings (sequence-parallel or not) in one process group and writes what each recorded.

    python tests/drivers/sequence_parallel_driver.py OUT.json CASES.json     # (ranks started by tests/helpers.run_ranks)

Each case is {"name", "config", "deepspeed", "overrides"}; its result: the step records' losses, gradient norms,
tokens and target tokens, the eval losses, the world size the last checkpoint's zerotune.json names, and the
attention key the model ran with.
"""

from finetune import checkpoint
from finetune.train import prepare, train
from tests.helpers import driver_main


def one_case(case: dict) -> dict:
    run = prepare(case["config"], case["deepspeed"], case["overrides"])
    result = {"sequence_parallel": run.recipe.train.sequence_parallel}

    def on_end(engine):
        result["attention"] = engine.module.config._attn_implementation
        result["train_batch_size"] = engine.train_batch_size()

    records = train(run, on_end=on_end)
    steps = [r for r in records if "loss" in r]
    result.update(loss=[r["loss"] for r in steps], grad_norm=[r["grad_norm"] for r in steps],
                  tokens=[r["tokens"] for r in steps], target_tokens=[r["target_tokens"] for r in steps],
                  eval_loss=[r["eval_loss"] for r in records if "eval_loss" in r])
    saved = checkpoint.resolve_resume("auto", run.recipe.train.output_dir)
    result["saved_world_size"] = checkpoint.saved_world_size(saved) if saved else None
    return result


if __name__ == "__main__":
    driver_main(one_case)
