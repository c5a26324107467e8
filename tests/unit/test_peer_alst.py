"""benchmarks/peer_alst.py, the long-sequence peer built from DeepSpeed's ALST parts, trains what zerotune trains:
on a tiny Mistral its TiledFusedLogitsLoss over the TiledMLP, offloaded-checkpoint model gives the loss and every
LoRA gradient of the plain peft model (fp32), so its tok/s in benchmarks/long_context.py are for the same work."""

import os
import sys

import pytest
import torch

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import peer_alst  # noqa: E402


def _tiny():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return MistralForCausalLM(cfg)


def _perturb_and_quiet(model):
    """Non-zero adapters (B starts at zero) and no dropout, so both sides draw the same."""
    torch.manual_seed(3)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def test_the_alst_peer_gives_the_plain_models_loss_and_lora_gradients():
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(1))  # 200 tokens: 4 MLP tiles
    plain = get_peft_model(_tiny(), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=peer_alst.TARGETS,
                                               task_type="CAUSAL_LM"))
    _perturb_and_quiet(plain)
    plain.train()
    ref = plain(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}

    model, base = peer_alst.prepare(_tiny(), lora=True, tiled=True, offload=True, liger=False)
    _perturb_and_quiet(model)
    model.train()
    offloads = []
    original = peer_alst.OffloadedCheckpoint.forward

    def counting(ctx, function, hidden, *args):
        offloads.append(hidden.shape)
        return original(ctx, function, hidden, *args)

    peer_alst.OffloadedCheckpoint.forward = staticmethod(counting)
    try:
        total, targets = peer_alst.loss_sum(base, ids)
    finally:
        peer_alst.OffloadedCheckpoint.forward = staticmethod(original)
    (total / targets).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(layer.mlp.forward.__func__ is peer_alst.tiled_mlp_forward for layer in base.model.layers)
    assert targets == 199 and offloads == [torch.Size([1, 200, 64])] * 3
    assert (total / targets).item() == pytest.approx(ref.item(), rel=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 3
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
