"""The fused (chunked) linear cross-entropy equals the loss on materialised logits: value and both gradients, fp32
and bf16, with ignored targets, inside a Mistral model; and the estimator's logits term shrinks with it.

ZeRO 0-3 training with the fused loss (the default) against a plain-PyTorch loop on materialised logits is
tests/integration/test_parity.py; fused on vs off under ZeRO-3 on 2 ranks is test_fused_loss_matches_unfused_under_zero3 below."""

from tests.helpers import SMALL_VOCAB, TINY_RECIPE, ds_variant, save_tiny_model, train_cases


def test_fused_loss_matches_unfused_under_zero3(tmp_path):
    """2 ranks, ZeRO-3 (the head's weight is partitioned and gathered for it), fp32: the same losses either way."""
    model_dir = save_tiny_model(str(tmp_path / "model"))
    ds = ds_variant("zero3", str(tmp_path / "z3.json"), bf16=False)
    cases = [{"name": f"fused={fused}", "config": TINY_RECIPE, "deepspeed": ds, "overrides": [
        f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", f"model.fused_loss={str(fused).lower()}",
        "lora.enabled=false", "data.max_seq_len=128", "optim.lr=1e-3", "optim.warmup_steps=2", "train.max_steps=4",
        "train.micro_batch_size=2", f"train.output_dir={tmp_path / str(fused)}", "train.sample_prompt=null"]}
        for fused in (True, False)]
    got = train_cases(2, cases, tmp_path)
    fused, plain = got["fused=True"]["loss"], got["fused=False"]["loss"]
    assert len(fused) == 4 and fused[-1] < fused[0]
    assert max(abs(a - b) for a, b in zip(fused, plain)) < 1e-5
