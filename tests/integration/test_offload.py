"""Offloading moves the optimizer (and parameters) to CPU memory or NVMe; it must not change what is learned. Each
offload configuration trains the tiny model on 2 ranks (fp32, real engines, DeepSpeedCPUAdam, real NVMe swap files)
with the losses of the same ZeRO stage without offload, LoRA and full. `--deepspeed auto` with a memory budget runs
what its plan chose, and learns exactly what the same settings given by hand learn."""

import json
import os

import pytest

from finetune.memory.budget import plan_memory
from finetune.config import load_recipe
from safetensors.torch import load_file

from tests.helpers import ROOT, TINY_CONFIG, TINY_RECIPE, ds_variant, run_ranks, save_tiny_model
from tests.fixtures.parity_cases import STEPS, overrides

OFFLOADED = {"zero2_offload": "zero2", "zero3_offload_optimizer": "zero3", "zero3_offload": "zero3",
             "zero3_nvme": "zero3"}
BUDGET_GIB = 0.01  # for the small-vocabulary tiny model's full fine-tune on 2 ranks only offloading fits
FULL_LAYERS = 4  # the full fine-tunes' model


def _name(config: str, lora: bool) -> str:
    return f"{config}-{'lora' if lora else 'full'}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    # 4 layers: the budget below and DeepSpeed's minimum swap size are set for this size (the default has 2)
    model_dir = save_tiny_model(str(tmp / "model"), num_hidden_layers=FULL_LAYERS)
    # LoRA trains adapters only: what reaches the NVMe files is the frozen weights' partitions, and DeepSpeed swaps
    # none under 1 MiB (its minimum AIO size), which the small model's tensors all are. The LoRA cases train the
    # 32,000-token tiny model, whose embedding and output partitions are over it.
    lora_model_dir = save_tiny_model(str(tmp / "model32k"), config_dir=os.path.dirname(TINY_CONFIG))
    nvme = tmp / "nvme"
    nvme.mkdir()
    cases = []
    for config in sorted(set(OFFLOADED) | set(OFFLOADED.values())):
        ds = ds_variant(config, str(tmp / f"{config}.json"), bf16=False)
        for lora in (False, True):
            name = _name(config, lora)
            extra = [f"train.nvme_path={nvme}"] if "nvme" in config else []
            cases.append({"name": name, "config": TINY_RECIPE, "deepspeed": ds,
                          "overrides": (overrides(lora_model_dir, str(tmp / name), lora, 2, "mistral-common") if lora
                                        else overrides(model_dir, str(tmp / name), lora, 2)) + extra})
    budget = overrides(model_dir, str(tmp / "budget"), False, 2) + [f"train.gpu_memory_gib={BUDGET_GIB}"]
    cases.append({"name": "auto", "config": TINY_RECIPE, "deepspeed": "auto", "overrides": budget})
    plan = plan_memory(load_recipe(TINY_RECIPE, budget), json.load(open(os.path.join(model_dir, "config.json"))), "auto", 2, BUDGET_GIB, None, 2)
    by_hand = overrides(model_dir, str(tmp / "by_hand"), False, 2) + [
        f"model.activation_checkpointing={plan.activation_checkpointing}",
        f"model.recompute_layers={'null' if plan.recompute_layers is None else plan.recompute_layers}",
        f"train.micro_batch_size={plan.micro_batch_size}", f"train.grad_accum={plan.grad_accum}"]
    cases.append({"name": "by_hand", "config": TINY_RECIPE, "deepspeed": os.path.join(ROOT, plan.deepspeed),
                  "overrides": by_hand})
    cases_file = tmp / "cases.json"
    cases_file.write_text(json.dumps(cases))
    run_ranks(2, os.path.join(ROOT, "tests", "drivers", "parity_driver.py"), [str(tmp / "results.json"), str(cases_file)], timeout=2400)
    params = sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())
    return json.loads((tmp / "results.json").read_text()), plan, tmp, params


@pytest.mark.parametrize("config", OFFLOADED)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_offloaded_losses_equal_the_same_stage_on_gpu_memory(runs, config, lora):
    results = runs[0]
    got, want = results[_name(config, lora)], results[_name(OFFLOADED[config], lora)]
    zero = got["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == ("nvme" if "nvme" in config else "cpu")
    assert ("offload_param" in zero) == (config in ("zero3_offload", "zero3_nvme"))
    assert len(got["loss"]) == len(want["loss"]) == STEPS
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5, rel=0), config
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert want["loss"][-1] < want["loss"][0] - 0.05  # it learns, or equality proves little
    if lora:
        assert got["base_identical"] and got["adapters_changed"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_nvme_offload_swaps_to_disk_and_cleans_up(runs, lora):
    got = runs[0][_name("zero3_nvme", lora)]
    assert got["swap_dirs"] and all(os.path.basename(d).startswith("zerotune-swap-") for d in got["swap_dirs"])
    # Adam's states (and, for a full fine-tune, the weights) of every parameter were on disk during the run
    assert got["swap_bytes"] > (8 * runs[3] / 2 if not lora else 0)
    assert not any(os.path.exists(d) for d in got["swap_dirs"])  # removed at the end of the run


def test_auto_runs_its_plan_and_learns_what_the_same_settings_by_hand_learn(runs):
    results, plan, tmp, _ = runs
    got = results["auto"]
    assert (got["activation_checkpointing"], got["micro_batch_size"], got["grad_accum"]) == \
        (plan.activation_checkpointing, plan.micro_batch_size, plan.grad_accum)
    assert (plan.micro_batch_size, plan.grad_accum) == (2, 1)  # the recipe's 2 rows per GPU per step, kept
    assert plan.deepspeed == "ds_configs/zero2_offload.json"  # the budget rules out everything without offload
    assert got["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    saved = json.load(open(tmp / "budget" / "memory_plan.json"))
    assert saved["deepspeed"] == plan.deepspeed and saved["estimated_gib"] <= 0.9 * BUDGET_GIB
    assert got["loss"] == results["by_hand"]["loss"]  # the same run, bit for bit
    assert got["loss"][-1] < got["loss"][0] - 0.05
