"""Shipped names for --config and --deepspeed (finetune/shipped.py), `zerotune recipes`, and an estimate without weights."""

import glob
import os

import pytest

from finetune import cli, shipped
from finetune.commands import estimate, recipes
from finetune.config import ConfigError, load_recipe
from finetune.ds_config import ds_json_path, load_ds_json
from finetune.memory.budget import candidate_configs
from tests.helpers import ROOT


def _shipped(*parts: str) -> str:
    return os.path.join(shipped.ROOT, *parts)


def test_names_resolve_to_the_shipped_files_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped.recipe_path("tiny") == shipped.recipe_path("tiny.yaml") == _shipped("recipes", "tiny.yaml")
    assert shipped.recipe_path(None) == _shipped("recipes", "mistral7b_lora.yaml")
    assert shipped.ds_config_path("zero3") == shipped.ds_config_path("zero3.json") == _shipped("ds_configs", "zero3.json")
    # The paths the docs and defaults spell (`--deepspeed ds_configs/zero3.json`) find the shipped files too.
    assert shipped.ds_config_path("ds_configs/zero3.json") == _shipped("ds_configs", "zero3.json")
    assert load_recipe("mistral7b_full").lora.enabled is False
    assert load_ds_json("zero2_offload")["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_an_existing_path_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zero3.json").write_text('{"zero_optimization": {"stage": 1}}')
    assert ds_json_path("zero3.json") == "zero3.json"
    assert load_ds_json("zero3.json")["zero_optimization"]["stage"] == 1
    assert ds_json_path("zero3") == _shipped("ds_configs", "zero3.json")  # no file named `zero3` here: the name
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "tiny.yaml").write_text("train:\n  max_steps: 7\n")
    assert load_recipe("recipes/tiny.yaml").train.max_steps == 7
    assert load_recipe("tiny").train.max_steps == 120


def test_unknown_names_list_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_recipe("tinyy")
    assert "recipe 'tinyy' not found" in str(e.value)
    assert all(name in str(e.value) for name in ["mistral7b_full", "mistral7b_lora", "tiny"])
    with pytest.raises(ConfigError) as e:
        ds_json_path("zero4")
    assert "DeepSpeed config 'zero4' not found" in str(e.value) and "pass --deepspeed ds_configs/zero3.json" in str(e.value)
    assert all(name in str(e.value) for name in shipped.ds_config_names()) and "zero3_offload_optimizer" in str(e.value)
    with pytest.raises(ConfigError, match="'sub/zero3.json' not found"):
        ds_json_path("sub/zero3.json")  # a path is not looked up as a name


@pytest.mark.parametrize("value,meant", [
    ("zero3.jsn", "zero3.json"), ("zer3", "zero3"), ("zero2_ofload", "zero2_offload"),
    ("ds_configs/zer3.json", "ds_configs/zero3.json"), ("ds_configs/zero3.jsn", "ds_configs/zero3.json"),
    ("ds_configs/zero3_offload_optimiser", "ds_configs/zero3_offload_optimizer.json"),
])
def test_a_near_miss_deepspeed_name_gets_a_did_you_mean(tmp_path, monkeypatch, value, meant):
    """From any folder (ds_configs/ is found as the shipped one), and the suggestion passed back is found."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        ds_json_path(value)
    assert str(e.value).startswith(f"DeepSpeed config {value!r} not found (did you mean {meant!r}?): pass --deepspeed ")
    assert ds_json_path(meant) in {_shipped("ds_configs", os.path.basename(meant)),
                                   _shipped("ds_configs", os.path.basename(meant) + ".json")}


def test_a_near_miss_of_ones_own_file_or_a_recipe_gets_a_did_you_mean(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "my_zero3.json").write_text("{}")
    (tmp_path / "mine.json").write_text("{}")
    for value, meant in (("configs/my_zer3.json", "configs/my_zero3.json"), ("mine.jsn", "mine.json")):
        with pytest.raises(ConfigError, match=f"^DeepSpeed config {value!r} not found \\(did you mean {meant!r}\\?\\)"):
            ds_json_path(value)
        assert ds_json_path(meant) == meant
    with pytest.raises(ConfigError, match=r"^recipe 'mistral7b_ful' not found \(did you mean 'mistral7b_full'\?\): "):
        load_recipe("mistral7b_ful")
    with pytest.raises(ConfigError, match=r"^recipe 'recipes/tiny.yml' not found \(did you mean 'recipes/tiny.yaml'\?\)"):
        load_recipe("recipes/tiny.yml")


@pytest.mark.parametrize("value", ["fsdp", "nothing_alike.json", "ds_configs/qqq.json", "/no/such/zer3.json"])
def test_a_name_near_nothing_gets_no_guess(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        ds_json_path(value)
    assert str(e.value).startswith(f"DeepSpeed config {value!r} not found: pass --deepspeed ")
    assert "did you mean" not in str(e.value)


def test_recipe_keys_and_file_names_share_one_did_you_mean(monkeypatch):
    """config.py's unknown-key hint goes through shipped.closest, the helper the file names use."""
    seen = []
    monkeypatch.setattr(shipped, "closest", lambda word, names: seen.append(word) or "lr")
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr'. Did you mean 'optim.lr'\?"):
        load_recipe("tiny", ["optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"not found \(did you mean 'lr'\?\)"):
        ds_json_path("zer3")
    assert seen == ["lrr", "zer3"]


def test_a_shipped_recipes_relative_paths_work_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    r = load_recipe("tiny")
    assert (r.model.path, r.data.path) == ("recipes/tiny_model", "recipes/data/tiny_instruct.jsonl")  # as written
    monkeypatch.chdir(tmp_path)
    for r in (load_recipe("tiny"), load_recipe(os.path.join(ROOT, "recipes", "tiny.yaml"))):
        assert r.model.path == _shipped("recipes", "tiny_model") and r.data.path == _shipped("recipes", "data", "tiny_instruct.jsonl")
    assert load_recipe("tiny", ["data.path=mine.jsonl"]).data.path == "mine.jsonl"  # not shipped: left to the checks
    assert load_recipe(None).model.path == "models/Mistral-7B-v0.1"


def test_the_package_finds_its_entry_point_and_the_planners_configs():
    from finetune.multinode import launcher

    assert os.path.isfile(launcher.DEFAULT_SCRIPT) and launcher.DEFAULT_SCRIPT == os.path.join(shipped.PACKAGE, "main.py")
    assert os.path.isdir(os.path.join(launcher.REPO, "finetune"))
    assert all(os.path.isfile(path) for path in candidate_configs("auto"))  # --deepspeed auto's candidates


def test_recipes_lists_every_shipped_file(capsys):
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out
    files = os.listdir(os.path.join(ROOT, "ds_configs")) + [os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "recipes", "*.yaml"))]
    assert len(files) >= 12
    for name in files:
        assert name in out, name
    assert "ZeRO-3, bf16, optimizer states and parameters offloaded to CPU" in out  # zero3_offload.json
    assert "Mistral-7B, full fine-tuning (every weight)." in out  # the first sentence of the recipe's comment


def test_recipes_cp_copies_bytes_and_refuses_to_overwrite(tmp_path, capsys):
    dest = tmp_path / "mine.yaml"
    assert recipes.main(["cp", "tiny", str(dest)]) == 0
    with open(os.path.join(ROOT, "recipes", "tiny.yaml"), "rb") as f:
        assert dest.read_bytes() == f.read()
    dest.write_text("edited\n")
    assert recipes.main(["cp", "tiny", str(dest)]) == 2
    err = capsys.readouterr().err
    assert f"{dest} already exists: not overwriting it" in err and dest.read_text() == "edited\n"
    assert recipes.main(["cp", "zero3.json", str(tmp_path)]) == 0  # into a folder, under its own name
    with open(os.path.join(ROOT, "ds_configs", "zero3.json"), "rb") as f:
        assert (tmp_path / "zero3.json").read_bytes() == f.read()
    assert recipes.main(["cp", "nope", str(tmp_path / "x")]) == 2
    assert "no shipped recipe or DeepSpeed config named 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_estimate_without_weights_uses_the_shipped_mistral_shape(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # models/Mistral-7B-v0.1 (the recipe's model.path) does not exist here
    assert estimate.main(["--config", "mistral7b_full", "--deepspeed", "zero3", "--gpus", "8", "--gpu-memory-gib", "80",
                          "--cpu-memory-gib", "256"]) == 0
    out, err = capsys.readouterr()
    assert "model.path 'models/Mistral-7B-v0.1' has no config.json" in err
    assert "using the shipped Mistral-7B shape" in err
    assert "7,241,732,096 parameters" in out and "| ZeRO-3 * |" in out
    assert len([line for line in out.splitlines() if line.startswith("| ZeRO")]) == 7
    assert "recommendation: ZeRO-" in out
