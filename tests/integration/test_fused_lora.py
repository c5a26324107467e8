"""The fused LoRA projection (finetune/perf/fused_lora.py) computes what peft computes: loss and every gradient inside a
Mistral (fp32 to 1e-5; bf16 within the error of peft's own bf16 path), one dropout mask used consistently by forward,
backward and recomputation, and peft's forward wherever it does not apply.

ZeRO 0-3 training with it (the default) against a plain-PyTorch loop over peft is tests/integration/test_parity.py; ZeRO-3 on 2
ranks with dropout and recomputation, fused against peft's forward, is the last test here; its saved bytes against the
estimator are in tests/integration/test_estimate.py."""

import json

from tests.helpers import SMALL_VOCAB, TINY_RECIPE, ds_variant, save_tiny_model, train_cases


def test_zero3_two_ranks_with_dropout_and_recomputation(tmp_path):
    """2 ranks, ZeRO-3 (base and adapters gathered by the fused layer's hooks), fp32, lora.dropout 0.1, no and full
    recomputation: fused trains as peft's forward does (on CPU both draw the same dropout masks). Each run's
    speedups.json says whether the fused layers were installed, so equal losses cannot come from two plain runs."""
    model_dir = save_tiny_model(str(tmp_path / "model"))
    ds = ds_variant("zero3", str(tmp_path / "z3.json"), bf16=False)
    cases = [{"name": f"{ckpt}-fused={fused}", "config": TINY_RECIPE, "deepspeed": ds, "overrides": [
        f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", f"lora.fused={str(fused).lower()}",
        "lora.enabled=true", "lora.rank=8", "lora.dropout=0.1", "lora.alpha=24", f"model.activation_checkpointing={ckpt}", "data.max_seq_len=128",
        "optim.lr=1e-3", "optim.warmup_steps=2", "train.max_steps=5", "train.micro_batch_size=2",
        f"train.output_dir={tmp_path / f'{ckpt}{fused}'}", "train.sample_prompt=null"]}
        for ckpt in ("none", "full") for fused in (True, False)]
    got = train_cases(2, cases, tmp_path)
    for ckpt in ("none", "full"):
        for fused in (True, False):
            with open(tmp_path / f"{ckpt}{fused}" / "speedups.json") as f:
                applied = {s["name"]: s["on"] for s in json.load(f)}
            assert applied["fused_lora"] is fused, (ckpt, fused, applied)
        fused, plain = got[f"{ckpt}-fused=True"]["loss"], got[f"{ckpt}-fused=False"]["loss"]
        assert len(fused) == 5 and fused[-1] < fused[0] - 0.05
        assert max(abs(a - b) for a, b in zip(fused, plain)) < 1e-4, (ckpt, fused, plain)
