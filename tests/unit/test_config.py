"""Recipe and DeepSpeed JSON resolution: every shipped config loads, and each mistake gets a message saying what to do."""

import glob
import json
import os

import pytest
import torch

from finetune.config import ConfigError, Recipe, load_recipe
from finetune import ds_config
from finetune.ds_config import emulated_bf16_note, engine_config, resolve_ds_config
from finetune.model.optim import lr_lambda
from finetune.train import prepare
from tests.helpers import ROOT, TINY_RECIPE

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))
DS_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))


def test_defaults_are_the_mistral7b_lora_run():
    r = Recipe()
    assert r.lora.enabled and r.lora.rank == 16
    assert r.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert r.optim.betas == [0.9, 0.95] and r.data.max_seq_len == 2048
    assert load_recipe(None) == r  # recipes/mistral7b_lora.yaml spells out the defaults


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
@pytest.mark.parametrize("ds", DS_CONFIGS, ids=os.path.basename)
def test_every_shipped_config_resolves(recipe, ds, tmp_path):
    resolved = resolve_ds_config(ds, load_recipe(recipe, [f"train.nvme_path={tmp_path}"]), world_size=8, hidden_size=4096)
    assert '"auto"' not in json.dumps(resolved)
    assert resolved["train_batch_size"] == resolved["train_micro_batch_size_per_gpu"] * resolved["gradient_accumulation_steps"] * 8
    assert "optimizer" not in engine_config(resolved)


@pytest.mark.parametrize("ds, world_size, overlap", [("zero2.json", 1, False), ("zero2.json", 2, True),
                                                    ("zero3.json", 1, True)])
def test_overlap_comm_auto_is_off_for_one_rank_at_zero2(ds, world_size, overlap, tmp_path):
    """ZeRO-2's overlap only adds device-wide waits on one rank; ZeRO-3 keeps it (its weight prefetch uses it)."""
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", ds)))
    cfg["zero_optimization"]["overlap_comm"] = "auto"
    resolved = resolve_ds_config(_write(tmp_path, cfg), load_recipe(TINY_RECIPE), world_size, 128)
    assert resolved["zero_optimization"]["overlap_comm"] is overlap


def test_overrides_apply_with_types():
    r = load_recipe(TINY_RECIPE, ["train.max_steps=20", "lora.rank=8", "optim.lr=5e-3", "lora.target_modules=q_proj,v_proj"])
    assert (r.train.max_steps, r.lora.rank, r.optim.lr) == (20, 8, 5e-3)
    assert r.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("override, message", [
    (["train.max_step=3"], "unknown key 'train.max_step'. Did you mean 'train.max_steps'?"),
    (["trian.max_steps=3"], "unknown key 'trian'"),
    (["train.max_steps=ten"], "train.max_steps must be int, got str 'ten'"),
    (["lora.enabled=maybe"], "lora.enabled must be bool"),
    (["model.activation_checkpointing=some"], "is not one of: auto, none, selective, full"),
    (["data.overlong=cut"], "is not one of: drop, truncate"),
    (["train.max_steps=0"], "train.max_steps must be > 0"),
    (["max_steps=3"], "is not section.key=value"),
])
def test_recipe_errors_name_the_key_and_choices(override, message):
    with pytest.raises(ConfigError) as e:
        load_recipe(TINY_RECIPE, override)
    assert message in str(e.value)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match="Valid keys: train.output_dir, train.max_steps"):
        load_recipe(TINY_RECIPE, ["train.bogus=1"])


def _write(tmp_path, cfg, name="ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def test_leftover_auto_is_refused(tmp_path):
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "zero2.json")))
    cfg["zero_optimization"]["sub_group_size"] = "auto"
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"zero_optimization.sub_group_size still \"auto\".*write a number"):
        resolve_ds_config(path, load_recipe(TINY_RECIPE), 2, 128)


def test_conflicting_batch_sizes_name_both_files(tmp_path):
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "zero2.json")))
    cfg["train_micro_batch_size_per_gpu"] = 4
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError) as e:
        resolve_ds_config(path, load_recipe(TINY_RECIPE), 2, 128, recipe_path="recipes/tiny.yaml")
    msg = str(e.value)
    assert path in msg and "recipes/tiny.yaml" in msg and "train.micro_batch_size = 1" in msg and "= 4" in msg


def test_train_batch_size_contradiction(tmp_path):
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "zero3.json")))
    cfg["train_batch_size"] = 64
    with pytest.raises(ConfigError, match="train_batch_size = 64 but .* gives train.micro_batch_size x train.grad_accum x 2 ranks = 2"):
        resolve_ds_config(_write(tmp_path, cfg), load_recipe(TINY_RECIPE), 2, 128)


def test_equal_explicit_values_are_accepted(tmp_path):
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "zero3.json")))
    cfg["gradient_clipping"] = 1.0
    assert resolve_ds_config(_write(tmp_path, cfg), load_recipe(TINY_RECIPE), 2, 128)["gradient_clipping"] == 1.0


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(scheduler={"type": "WarmupLR"}), "remove the 'scheduler' block"),
    (lambda c: c.update(fp16={"enabled": True}), "fp16 is not supported"),
    (lambda c: c["optimizer"].update(type="Lamb"), "zerotune trains with AdamW"),
    (lambda c: c.update(bf16={"enabled": True}, zero_optimization={"stage": 0}), "accumulates gradients in bf16"),
])
def test_ds_config_refusals(tmp_path, mutate, message):
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "zero2.json")))
    mutate(cfg)
    with pytest.raises(ConfigError, match=message):
        resolve_ds_config(_write(tmp_path, cfg), load_recipe(TINY_RECIPE), 1, 128)


def test_malformed_and_missing_ds_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"bf16": {"enabled": true},\n  "x": }')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON at line 2"):
        resolve_ds_config(str(bad), load_recipe(TINY_RECIPE), 1, 128)
    with pytest.raises(ConfigError, match="pass --deepspeed ds_configs/zero3.json"):
        resolve_ds_config(str(tmp_path / "nope.json"), load_recipe(TINY_RECIPE), 1, 128)


def test_missing_model_dir_says_how_to_point_at_weights(tmp_path):
    with pytest.raises(ConfigError) as e:
        prepare(TINY_RECIPE, "ds_configs/zero3.json", [f"model.path={tmp_path}/absent", f"train.output_dir={tmp_path}/o"])
    assert "does not exist" in str(e.value) and "model.path=/path/to/Mistral-7B-v0.1" in str(e.value)


def test_non_empty_output_dir_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    args = (TINY_RECIPE, os.path.join(ROOT, "ds_configs", "zero2.json"))
    with pytest.raises(ConfigError, match="is not empty: choose a new one, pass train.resume=auto to continue it, or train.overwrite=true"):
        prepare(*args, [f"train.output_dir={out}"])
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    prepare(*args, [f"train.output_dir={out}", "train.overwrite=true"])


def test_schedule_warms_up_then_decays_to_min_ratio():
    values = [lr_lambda(s, 4, 20, 0.1) for s in range(20)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(values[3:], values[4:]))
    assert values[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + __import__("math").cos(__import__("math").pi * 15 / 16)))


def test_bf16_on_a_cpu_without_native_bf16_gets_a_note(monkeypatch):
    """Without native bf16 (an AVX2-only CPU) a bf16 run is told what it costs and which file runs fp32."""
    bf16 = json.load(open(os.path.join(ROOT, "ds_configs", "zero3.json")))
    fp32 = json.load(open(os.path.join(ROOT, "ds_configs", "zero3_fp32.json")))
    assert fp32 == dict(bf16, bf16={"enabled": False})  # the same ZeRO-3 file, in fp32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ds_config, "native_cpu_bf16", lambda: False)
    note = emulated_bf16_note(bf16)
    assert note and "has no native bf16" in note and note.endswith("ds_configs/zero3_fp32.json")
    assert emulated_bf16_note(fp32) is None
    monkeypatch.setattr(ds_config, "native_cpu_bf16", lambda: True)
    assert emulated_bf16_note(bf16) is None


@pytest.mark.parametrize("override, message", [
    ("train.max_step=10", "command-line override 'train.max_step=10': unknown key 'train.max_step'. "
                          "Did you mean 'train.max_steps'?"),
    ("trian.max_steps=3", "command-line override 'trian.max_steps=3': unknown key 'trian'. Did you mean 'train'?"),
    ("train.max_steps=ten", "command-line override 'train.max_steps=ten': train.max_steps must be int, got str 'ten'"),
    ("data.overlong=cut", "command-line override 'data.overlong=cut': data.overlong = 'cut' is not one of: drop, truncate"),
    ("lora.target_modules=[q_proj,", "command-line override 'lora.target_modules=[q_proj,': '[q_proj,' is not a "
                                     "YAML value"),
    ("train.max_steps=0", "tiny.yaml with command-line override 'train.max_steps=0': train.max_steps must be > 0"),
])
def test_an_override_error_names_the_override_not_the_recipe(override, message):
    with pytest.raises(ConfigError) as e:
        load_recipe(TINY_RECIPE, [override])
    assert message in str(e.value)
    assert not str(e.value).startswith(TINY_RECIPE + ":")


def test_a_recipe_file_error_names_the_file(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  max_step: 10\n  seed: forty\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(str(recipe), ["train.max_steps=5"])  # a good override beside the file's mistakes
    assert str(e.value).startswith(f"{recipe}: unknown key 'train.max_step'. Did you mean 'train.max_steps'?")
    recipe.write_text("train:\n  seed: forty\n")
    with pytest.raises(ConfigError, match=f"^{recipe}: train.seed must be int, got str 'forty'"):
        load_recipe(str(recipe), ["train.max_steps=5"])


def test_train_help_names_the_command_and_the_sections(capsys):
    from finetune.cli import main as zerotune
    from finetune.config import sections

    with pytest.raises(SystemExit) as e:
        zerotune(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: zerotune train [--config RECIPE] [--deepspeed DS_JSON] [--verbose]")
    assert "deepspeed --num_gpus N finetune/main.py [the same arguments]" in out
    assert "docs/configuration.md" in out and "--verbose" in out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.split()[0] in sections()}
    assert listed == {"model", "lora", "data", "optim", "train"}
    assert "max_steps" in out and "target_modules" in out  # each section's keys


def test_a_bare_on_or_off_is_the_word_not_a_boolean():
    """YAML 1.1 reads `on`/`off` as booleans; a key whose values are the words gets the words back."""
    assert load_recipe("tiny", ["model.tiled_mlp=on"]).model.tiled_mlp == "on"
    assert load_recipe("tiny", ["model.tiled_mlp=off"]).model.tiled_mlp == "off"
    with pytest.raises(ConfigError, match="model.fused_loss must be bool"):
        load_recipe("tiny", ["model.fused_loss=auto"])


@pytest.mark.parametrize("overrides, whole", [(["lora.enabled=true"], True),
                                              (["lora.enabled=true", "lora.zero3_layer_gather=false"], False),
                                              (["lora.enabled=false"], False)])
def test_zero3_prefetches_a_whole_layer_where_lora_gathers_layers_whole(overrides, whole):
    """lora.zero3_layer_gather gathers a decoder layer as one: the prefetch bucket then holds the next layer whole;
    elsewhere it keeps the width-based size."""
    from finetune.memory.shapes import layer_parameters
    from tests.fixtures.model_shapes import MISTRAL

    layer = layer_parameters(MISTRAL)
    assert layer == 218_112_000  # 4 attention projections (GQA: k and v 1,024 wide) + 3 MLP ones + 2 norms
    recipe = load_recipe(TINY_RECIPE, overrides)
    resolved = resolve_ds_config(os.path.join(ROOT, "ds_configs", "zero3.json"), recipe, 8, 4096, layer_parameters=layer)
    assert resolved["zero_optimization"]["stage3_prefetch_bucket_size"] == (layer if whole else int(0.9 * 4096 * 4096))
