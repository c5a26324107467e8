"""The tiled MLP (finetune/perf/tiled_mlp.py) with real engines: 2 ranks, ZeRO-2 and ZeRO-3, fp32, tiles of 48 tokens
over micro-batches of up to 2 x 128: tiled and untiled trainings give the same losses and gradient norms. Each trained
MLP parameter gets one gradient per backward (the tiles' sum), so ZeRO's reduction hooks fire once, as untiled; ZeRO-3
gathers the MLP's parameters for the tiles through the MLP's own hooks.

Tiled against untiled module by module (full, LoRA, fused MLP, dropout) is tests/unit/test_tiled_mlp.py."""

import os

import pytest

from tests.helpers import ROOT, SMALL_VOCAB, SMALL_VOCAB_LAYERS, TINY_RECIPE, ds_variant, run_ranks, save_tiny_model

STEPS = 3
CASES = (("zero2", "full", "none"), ("zero3", "full", "full"), ("zero3", "lora", "full"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import json

    tmp = tmp_path_factory.mktemp("tiled")
    model_dir = save_tiny_model(str(tmp / "model"))
    cases = []
    for stage, tuning, ckpt in CASES:
        ds = ds_variant(stage, str(tmp / f"{stage}.json"), bf16=False)
        for tiled in ("on", "off"):
            name = f"{stage}-{tuning}-{tiled}"
            cases.append({"name": name, "config": TINY_RECIPE, "deepspeed": ds, "tile_tokens": 48, "overrides": [
                f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", f"model.tiled_mlp='{tiled}'",
                f"lora.enabled={str(tuning == 'lora').lower()}", "lora.dropout=0.0",
                f"model.activation_checkpointing={ckpt}", "data.max_seq_len=128", "optim.lr=1e-3",
                "optim.warmup_steps=1", f"train.max_steps={STEPS}", "train.micro_batch_size=2",
                f"train.output_dir={tmp / name}", "train.sample_prompt=null"]})
    cases_file, out = str(tmp / "cases.json"), str(tmp / "out.json")
    with open(cases_file, "w") as f:
        json.dump(cases, f)
    run_ranks(2, os.path.join(ROOT, "tests", "drivers", "tiled_mlp_driver.py"), [out, cases_file])
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("stage,tuning,ckpt", CASES)
def test_tiled_and_untiled_train_alike_on_two_ranks(results, stage, tuning, ckpt):
    tiled, plain = results[f"{stage}-{tuning}-on"], results[f"{stage}-{tuning}-off"]
    # layers x micro-batches x (forward, and the layer's recomputation under full checkpointing)
    assert tiled["tiled_mlp_calls"] >= SMALL_VOCAB_LAYERS * STEPS and plain["tiled_mlp_calls"] == 0
    assert len(tiled["loss"]) == STEPS
    assert tiled["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=1e-6), (tiled["loss"], plain["loss"])
    assert tiled["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5), (tiled["grad_norm"], plain["grad_norm"])
    if tuning == "lora":
        assert tiled["base_identical"] and tiled["adapters_changed"]
