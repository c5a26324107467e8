"""Resume checks what changed (finetune/checkpoint/resume_check.py): which differences between a checkpoint's saved recipe and
this run's refuse the resume (they change the parameters) and which are listed and allowed. The same against a real
checkpoint of a trained run: tests/integration/test_run_folder.py."""

from __future__ import annotations

import json
import os

import pytest

from finetune.checkpoint import resume_check
from finetune.checkpoint import MARKER
from finetune.config import ConfigError, load_recipe
from finetune.prepare import Run
from tests.helpers import SMALL_VOCAB, TINY_RECIPE


def _config(*overrides: str, **shape) -> dict:
    """A resolved config as Run.resolved_config() saves it with a checkpoint."""
    with open(os.path.join(SMALL_VOCAB, "config.json")) as f:
        model_config = {**json.load(f), **shape}
    return Run(load_recipe(TINY_RECIPE, list(overrides)), {}, model_config).resolved_config()


def _keys(differences) -> list[str]:
    return [d.key for d in differences]


def test_the_checkpoint_keeps_the_model_shape():
    saved = _config()
    assert saved["model_config"]["num_hidden_layers"] == 2 and saved["model_config"]["vocab_size"] == 512
    assert set(saved["model_config"]) <= set(resume_check.SHAPE_KEYS)


def test_safe_changes_are_listed_and_nothing_refused():
    refused, listed = resume_check.compare(
        _config(), _config("optim.lr=1e-3", "train.max_steps=500", "train.save_every=50", "train.log_every=5",
                           "data.max_seq_len=128", "train.resume=auto", "lora.rank=4"))
    assert refused == []  # lora.rank: LoRA is off before and after, so the adapters do not exist
    assert _keys(listed) == ["data.max_seq_len", "lora.rank", "optim.lr", "train.log_every", "train.max_steps",
                             "train.save_every"]  # train.resume differs on every resume: not listed
    lr = next(d for d in listed if d.key == "optim.lr")
    assert (lr.saved, lr.now) == (5e-3, 1e-3)


def test_full_vs_lora_refuses_naming_only_that():
    refused, _ = resume_check.compare(_config(), _config("lora.enabled=true", "lora.rank=8"))
    assert _keys(refused) == ["lora.enabled"]


@pytest.mark.parametrize("override, key", [("lora.rank=8", "lora.rank"), ("lora.alpha=8", "lora.alpha"),
                                           ("lora.target_modules=[q_proj,v_proj]", "lora.target_modules")])
def test_adapter_changes_refuse_when_lora_is_on(override, key):
    refused, listed = resume_check.compare(_config("lora.enabled=true"), _config("lora.enabled=true", override))
    assert _keys(refused) == [key] and listed == []


def test_a_lora_bases_precision_refuses_below_zero3_only():
    """An FP8 LoRA base under ZeRO-0/1/2 is a copy that replaces the weight and is not saved: a checkpoint of either
    precision does not load into the other's module. ZeRO-3 keeps the 16-bit weight, saved either way; full
    fine-tuning's FP8 quantizes its trained weights at each use and keeps them too."""
    def at(stage, *overrides):
        config = _config("lora.enabled=true", *overrides)
        return {**config, "ds_config": {"zero_optimization": {"stage": stage}}}

    for stage in (0, 2):
        refused, _ = resume_check.compare(at(stage, "model.precision=fp8"), at(stage, "model.precision=bf16"))
        assert _keys(refused) == ["model.precision"]
    refused, listed = resume_check.compare(at(3, "model.precision=fp8"), at(3, "model.precision=auto"))
    assert refused == [] and _keys(listed) == ["model.precision"]
    full = [{**_config(p), "ds_config": {"zero_optimization": {"stage": 2}}} for p in ("model.precision=fp8",
                                                                                        "model.precision=bf16")]
    assert resume_check.compare(*full)[0] == []


def test_model_shape_refuses_and_a_moved_model_of_the_same_shape_is_listed():
    refused, listed = resume_check.compare(_config(), _config("model.path=/elsewhere", num_hidden_layers=3))
    assert _keys(refused) == ["model num_hidden_layers (config.json)"]
    assert (refused[0].saved, refused[0].now) == (2, 3)
    assert _keys(listed) == ["model.path"]
    refused, listed = resume_check.compare(_config(), _config("model.path=/elsewhere"))
    assert refused == [] and _keys(listed) == ["model.path"]


def test_without_a_saved_shape_the_model_path_decides():
    saved = _config()
    del saved["model_config"]  # a checkpoint saved before shapes were kept
    refused, _ = resume_check.compare(saved, _config("model.path=/elsewhere"))
    assert _keys(refused) == ["model.path"]
    refused, _ = resume_check.compare(saved, _config())
    assert refused == []


def _checkpoint(tmp_path, meta: dict) -> str:
    path = tmp_path / "checkpoints" / "step_00000004"
    path.mkdir(parents=True)
    (path / MARKER).write_text(json.dumps({"step": 4, "world_size": 1, **meta}))
    return str(path)


def test_refusal_is_a_table_and_says_what_to_do(tmp_path):
    path = _checkpoint(tmp_path, _config())
    with pytest.raises(ConfigError) as e:
        resume_check.check(path, _config("lora.enabled=true", num_hidden_layers=3))
    lines = str(e.value).splitlines()
    assert lines[0] == f"train.resume: {path} was trained with other parameters than this recipe builds:"
    assert lines[1].split() == ["key", "checkpoint", "now"]
    assert lines[2].split() == ["model", "num_hidden_layers", "(config.json)", "2", "3"]
    assert lines[3].split() == ["lora.enabled", "false", "true"]
    assert lines[1].index("checkpoint") == lines[2].index("2") == lines[3].index("false")  # aligned columns
    assert "To resume it, change these settings back; or start a new run in another train.output_dir" in lines[4]
    assert resume_check.check(path, _config("optim.lr=1e-3"))[0].key == "optim.lr"


def test_a_checkpoint_without_a_saved_recipe_is_not_compared(tmp_path):
    assert resume_check.check(_checkpoint(tmp_path, {}), _config("lora.enabled=true")) == []


def test_values_are_shown_as_json_and_long_ones_shortened():
    _, listed = resume_check.compare(_config(), _config("lora.target_modules=[q_proj]"))
    row = resume_check.table(listed).splitlines()[1].split(None, 1)
    assert row[0] == "lora.target_modules"
    assert row[1].startswith('["q_proj", "k_proj", ') and row[1].endswith('...  ["q_proj"]')
