"""The fused MLP (finetune/perf/fused_mlp.py) computes what transformers' Mistral MLP computes, bit for bit, while keeping
two [tokens, intermediate] tensors per layer where transformers keeps four; it is installed only where down_proj is a
plain linear layer; under ZeRO-3 on 2 ranks it trains as the unfused model does, with and without recomputation.

Its saved bytes against the estimator are in tests/integration/test_estimate.py; ZeRO 0-3 training with it (the default) against
a plain-PyTorch loop over transformers' model is tests/integration/test_parity.py."""

import pytest
from tests.helpers import SMALL_VOCAB, SMALL_VOCAB_LAYERS, TINY_RECIPE, ds_variant, save_tiny_model, train_cases


def test_zero3_two_ranks_with_and_without_recomputation(tmp_path):
    """2 ranks, ZeRO-3 (down_proj's weight gathered by the MLP's hooks, for forward, backward and recomputation), fp32,
    full fine-tune: the fused and the unfused model give the same loss curve."""
    model_dir = save_tiny_model(str(tmp_path / "model"))
    ds = ds_variant("zero3", str(tmp_path / "z3.json"), bf16=False)
    cases = [{"name": f"{ckpt}-fused={fused}", "config": TINY_RECIPE, "deepspeed": ds, "overrides": [
        f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", f"model.fused_mlp={str(fused).lower()}",
        "lora.enabled=false", f"model.activation_checkpointing={ckpt}", "data.max_seq_len=128",
        "optim.lr=1e-3", "optim.warmup_steps=2", "train.max_steps=4", "train.micro_batch_size=2",
        f"train.output_dir={tmp_path / f'{ckpt}{fused}'}", "train.sample_prompt=null"]}
        for ckpt in ("none", "full") for fused in (True, False)]
    got = train_cases(2, cases, tmp_path)
    for ckpt in ("none", "full"):
        fused, plain = got[f"{ckpt}-fused=True"], got[f"{ckpt}-fused=False"]
        assert (fused["fused_mlps"], plain["fused_mlps"]) == (SMALL_VOCAB_LAYERS, 0)
        assert len(fused["loss"]) == 4 and fused["loss"][-1] < fused["loss"][0] - 0.05
        assert fused["loss"] == pytest.approx(plain["loss"], abs=1e-6), (ckpt, fused["loss"], plain["loss"])
        assert fused["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5), ckpt
