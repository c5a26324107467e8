"""Optional metric back-ends (TensorBoard, W&B) fed exactly the records that go to metrics.jsonl, on rank 0 only.

    backends = build_backends(["tensorboard", "wandb"], "runs/x", run_config={...}); backends[0].log(record)

Neither package is needed to train: each is imported only when the recipe asks for it (`train.log_to`), and a
missing one is a ConfigError naming the pip package. Tags: `train/<key>` for step records, `eval/loss` for eval ones.
"""

from __future__ import annotations

import json
import os
from typing import Any

from finetune.config import ConfigError

BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # back-end name -> pip package


def check_backends(names: list[str]) -> None:
    """Fail before training starts if an asked-for back-end is unknown or its package is missing."""
    for name in names:
        _import(name)


def _import(name: str):
    if name not in BACKENDS:
        raise ConfigError(f"train.log_to: unknown back-end {name!r}; choose from {', '.join(BACKENDS)}")
    # Lazy: both packages are optional, imported only when train.log_to names them.
    try:
        if name == "tensorboard":
            # torch ships this module, but it raises ImportError without the tensorboard package.
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        import wandb

        return wandb
    except ImportError as e:
        raise ConfigError(f"train.log_to has {name!r} but the {name} package cannot be imported ({e}): "
                          f"`pip install {BACKENDS[name]}`, or remove {name!r} from train.log_to") from None


def _tag(key: str) -> str:
    return "eval/loss" if key == "eval_loss" else f"train/{key}"


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers under their tags; None (e.g. MFU on CPU) is left out, as a plot has no point for it."""
    return {_tag(k): v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardBackend:
    """Event files in <output_dir>/tensorboard (`tensorboard --logdir runs/x/tensorboard`)."""

    def __init__(self, output_dir: str, run_config: dict[str, Any] | None, start_step: int = 0):
        SummaryWriter = _import("tensorboard")
        # A resumed run rewrites the steps after its checkpoint (as metrics.jsonl does): purge_step hides the
        # events the killed process had written for them. flush_secs bounds what a crash loses.
        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"), flush_secs=10,
                                    purge_step=start_step + 1 if start_step else None)
        if run_config:
            self.writer.add_text("config", f"```\n{json.dumps(run_config, indent=2)}\n```", global_step=start_step)

    def log(self, record: dict[str, Any]) -> None:
        for tag, value in _scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A W&B run named after the run folder; WANDB_MODE=offline keeps it local (`wandb sync` uploads it later)."""

    def __init__(self, output_dir: str, run_config: dict[str, Any] | None, project: str = "zerotune"):
        wandb = _import("wandb")
        try:
            # Without WANDB_DIR the W&B files go into the run folder, next to metrics.jsonl, not the launch directory.
            self.run = wandb.init(project=project, name=os.path.basename(os.path.normpath(output_dir)),
                                  dir=None if os.environ.get("WANDB_DIR") else output_dir, config=run_config or {})
        except wandb.errors.UsageError as e:  # e.g. no API key, and no terminal to ask for one on
            raise RuntimeError(f"W&B could not start a run ({e}): log in with `wandb login`, or set WANDB_MODE=offline "
                               f"to keep the run local (`wandb sync` uploads it later)") from None

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def build_backends(names: list[str] | None, output_dir: str, run_config: dict[str, Any] | None = None,
                   start_step: int = 0, wandb_project: str = "zerotune") -> list:
    """One back-end object per name in `names` (each has log(record) and close())."""
    backends = []
    for name in dict.fromkeys(names or []):  # a name given twice would log every point twice
        if name == "tensorboard":
            backends.append(TensorBoardBackend(output_dir, run_config, start_step))
        elif name == "wandb":
            backends.append(WandbBackend(output_dir, run_config, wandb_project))
        else:
            _import(name)  # raises the error listing the known back-ends
    return backends
