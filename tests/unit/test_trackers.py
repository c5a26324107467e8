"""Metric back-ends without a run: neither TensorBoard nor W&B is needed to train, and asking for a missing or unknown
one is a clear error before training starts. The records they receive from a real run: tests/integration/test_trackers.py."""

import json
import sys

import pytest

from finetune.config import ConfigError, load_recipe
from finetune.run.trackers import check_backends
from finetune.run.metrics import MetricsLog
from tests.helpers import TINY_RECIPE


@pytest.fixture
def no_backends(monkeypatch):
    """Make `import tensorboard` / `import wandb` fail, as on a machine where neither is installed."""
    for name in ("tensorboard", "torch.utils.tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)


def test_training_needs_neither_package(no_backends, tmp_path):
    log = MetricsLog(str(tmp_path), max_steps=2, enabled=True)  # what train.py builds when train.log_to is empty
    log.write({"step": 1, "loss": 2.0})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.0}
    check_backends([])
    assert load_recipe(TINY_RECIPE).train.log_to == []


def test_asking_for_a_missing_backend_names_the_package(no_backends, tmp_path):
    with pytest.raises(ConfigError, match=r"`pip install tensorboard`, or remove 'tensorboard' from train.log_to"):
        MetricsLog(str(tmp_path), max_steps=2, enabled=True, log_to=["tensorboard"])
    with pytest.raises(ConfigError, match=r"`pip install wandb`"):
        check_backends(["wandb"])
    MetricsLog(str(tmp_path), max_steps=2, enabled=False, log_to=["wandb"])  # ranks other than 0 never import it


def test_missing_backend_stops_the_run_before_training(no_backends, tmp_path, capsys):
    from finetune.train import main

    rc = main(["--deepspeed", "ds_configs/zero2.json", "--config", TINY_RECIPE, "train.log_to=[wandb]",
               f"train.output_dir={tmp_path / 'run'}"])
    assert rc == 2
    assert "`pip install wandb`" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ConfigError, match="is not one of: tensorboard, wandb"):
        load_recipe(TINY_RECIPE, ["train.log_to=[tensorbord]"])
