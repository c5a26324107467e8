"""Everything a run checks before any process group or model exists: the recipe, the DeepSpeed JSON, the model
folder, the tokenizer and data, the run folder (whose lock rank 0 takes: finetune/run/folder_lock.py) and the checkpoint to
resume (against the recipe it was trained with: finetune/checkpoint/resume_check.py). A mistake here is a ConfigError that says
what to fix, raised on every rank before any of them starts work.

    run = prepare("recipes/tiny.yaml", "ds_configs/zero2.json", ["train.max_steps=20"]); train(run)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import textwrap
from dataclasses import dataclass
from typing import Any

from finetune import checkpoint, dist, parallel
from finetune.checkpoint import resume_check
from finetune.config import ConfigError, Recipe, load_recipe, recipe_to_dict, sections
from finetune.data.registry import get_format, load_plugins
from finetune.data.sources import READABLE
from finetune.data.tokenizer import load_tokenizer
from finetune.ds_config import emulated_bf16_note, resolve_for_model
from finetune.memory import budget
from finetune.memory.host import check_host_fits
from finetune.model.build import check_model_dir
from finetune.perf import liger as kernels, lora_dropout
from finetune.run import folder_lock
from finetune.run.trackers import check_backends


@dataclass
class Run:
    """Everything resolved and validated before any process group or model exists."""

    recipe: Recipe
    ds: dict[str, Any]
    model_config: dict[str, Any]
    resume_from: str | None = None
    plan: Any = None
    """The memory plan (finetune.memory.budget.MemoryPlan) when train.gpu_memory_gib or --deepspeed auto chose the settings."""
    data_start: tuple[int, int, int] = (0, 0, 0)
    """(step, epoch, row): the step whose rows begin at that row of that epoch; set when the data is loaded (a run
    resumed with other rows per step than the saved run's starts at its row: finetune/data/loader.py)."""

    def resolved_config(self) -> dict[str, Any]:
        """The recipe, DeepSpeed JSON and model shape as resolved, as checkpoints and the metric back-ends keep them
        (a resume compares them: finetune/checkpoint/resume_check.py), and the data position a resume continues from."""
        t = self.recipe.train
        step, epoch, row = self.data_start
        return {"recipe": recipe_to_dict(self.recipe), "ds_config": self.ds,
                "model_config": resume_check.shape(self.model_config),
                "data_position": {"step": step, "epoch": epoch, "row": row,
                                  "rows_per_step": t.micro_batch_size * t.grad_accum
                                  * parallel.data_parallel_size(self.recipe, dist.world_size())}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """`zerotune train` / `deepspeed ... finetune/main.py` arguments; --help lists the recipe's sections and keys."""
    usage = ("zerotune train [--config RECIPE] [--deepspeed DS_JSON] [--verbose] [section.key=value ...]\n"
             "       deepspeed --num_gpus N finetune/main.py [the same arguments]")
    keys = "\n".join(textwrap.fill(", ".join(names), width=100, initial_indent=f"  {section:<7}",
                                   subsequent_indent=" " * 9) for section, names in sections().items())
    epilog = (f"recipe sections and their keys (each key, its default and what it does: docs/configuration.md):\n"
              f"{keys}\n\nexample: zerotune train --config tiny --deepspeed zero3 train.max_steps=20 lora.rank=8")
    p = argparse.ArgumentParser(prog="zerotune train", usage=usage, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Fine-tune Mistral with DeepSpeed ZeRO: the recipe says what to train, the "
                                            "DeepSpeed JSON how the engine shards it.")
    p.add_argument("--deepspeed", metavar="DS_JSON", default="ds_configs/zero3.json",
                   help="DeepSpeed JSON (a path, or a shipped name: zero2, zero3, ...), or `auto`: the fastest that fits "
                        "train.gpu_memory_gib (or this GPU) (default ds_configs/zero3.json)")
    p.add_argument("--config", metavar="RECIPE", default=None,
                   help="YAML recipe (a path, or a shipped name: tiny, ...) (default recipes/mistral7b_lora.yaml)")
    p.add_argument("--verbose", action="store_true",
                   help="also print DeepSpeed's INFO logging and library warnings (the same as ZEROTUNE_LOG=info)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="change one recipe key, e.g. train.max_steps=20 (values are YAML: 5e-3, true, [q_proj, v_proj])")
    return p.parse_args(argv)


def prepare(config: str | None, deepspeed_json: str, overrides: list[str]) -> Run:
    """Load and check everything a user can get wrong, before any rank starts work (raises ConfigError)."""
    recipe = load_recipe(config, overrides)
    check_backends(recipe.train.log_to)
    kernels.check(recipe.model.kernels)
    lora_dropout.check(recipe.lora)
    model_config = check_model_dir(recipe.model)
    _check_tokenizer_and_data(recipe)
    recipe_path = config or "recipes/mistral7b_lora.yaml"
    recipe, deepspeed_json, plan = budget.fit(recipe, model_config, deepspeed_json, dist.world_size(), recipe_path)
    # train.sequence_parallel as the run uses it (`auto`: the memory plan's choice, or 1), checked against the world
    # size and the model's heads. DeepSpeed's batch stays micro x accumulation x world: it sees every rank as
    # data-parallel, each with its slice of the rows (finetune/parallel/groups.py).
    degree = parallel.resolve_degree(recipe, dist.world_size(), planned=getattr(plan, "sequence_parallel", None),
                                     model_config=model_config)
    recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, sequence_parallel=degree))
    ds = resolve_for_model(deepspeed_json, recipe, dist.world_size(), model_config, recipe_path)
    budget.check_offload_fits_host(recipe, model_config, ds, dist.world_size())
    # Before any rank loads a model this host cannot hold, and before the run folder is made or locked: a failed start
    # leaves the folder as it found it.
    check_host_fits(recipe, model_config, ds, dist.world_size())
    if note := emulated_bf16_note(ds):
        dist.print0(note)
    out = recipe.train.output_dir
    # Global rank 0 holds the folder for the run's life, before anything is read from or written to it: a second run
    # into it (fresh or resumed) stops here, having touched nothing. A failed check below gives the lock back at once.
    lock = folder_lock.acquire(out) if dist.is_main() else None
    try:
        run = _check_output_and_resume(recipe, ds, model_config, plan)
    except Exception:
        if lock is not None:
            lock.release()
        raise
    return run


def _check_output_and_resume(recipe: Recipe, ds: dict[str, Any], model_config: dict[str, Any], plan: Any) -> Run:
    """The run folder's checks (not empty unless resumed or overwritten, writable, room for a checkpoint) and the
    checkpoint to resume, checked against this recipe."""
    out = recipe.train.output_dir
    # Not content: other ranks' probes of the folder (check_output_dir's .write-test-* files) and the run's lock.
    content = [f for f in os.listdir(out) if not f.startswith(checkpoint.WRITE_PROBE) and f != folder_lock.LOCK_FILE
               ] if os.path.isdir(out) else []
    if content and not (recipe.train.overwrite or recipe.train.resume):
        raise ConfigError(f"train.output_dir {out!r} is not empty: choose a new one, pass train.resume=auto to "
                          f"continue it, or train.overwrite=true")
    resume_from = checkpoint.resolve_resume(recipe.train.resume, out)
    run = Run(recipe, ds, model_config, resume_from, plan)
    changed = resume_check.check(resume_from, run.resolved_config()) if resume_from else []
    if resume_from:
        checkpoint.resume_route(resume_from, ds)  # ConfigError when it cannot resume on this layout
    lora_fraction = 0.01 if recipe.lora.enabled else None
    needed = (checkpoint.estimate_checkpoint_bytes(model_config, lora_fraction, recipe.train.portable_checkpoints)
              if recipe.train.save_every > 0 else 0)
    # Room for train.keep_last complete checkpoints beside the one being written (every checkpoint of the run when
    # keep_last=0), less those already there: checkpoint.new_checkpoints_at_once.
    checkpoint.check_output_dir(out, needed, *checkpoint.checkpoints_to_fit(recipe.train, resume_from))
    if changed:
        dist.print0(f"resuming {resume_from} with these settings changed (none alters the parameters):\n"
                    f"{resume_check.table(changed)}")
    return run


def _check_tokenizer_and_data(recipe: Recipe) -> None:
    """Fail before any rank starts work on a missing tokenizer, data file, format or plugin."""
    try:
        load_tokenizer(recipe.model.tokenizer or recipe.model.path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer: {e}") from None
    try:
        load_plugins(recipe.data.plugins)
        get_format(recipe.data.format)
    except (ImportError, ValueError) as e:
        raise ConfigError(str(e)) from None
    for key, path in (("data.path", recipe.data.path), ("data.eval_path", recipe.data.eval_path)):
        if path and not os.path.exists(path):
            raise ConfigError(f"{key} {path!r} not found: point it at a local file or folder; zerotune reads {READABLE}")
