"""The activation estimate (finetune/memory/activations.py) of zerotune's CUDA-only paths against torch's saved-tensor
hooks: compiled FlexAttention over its block mask, alone and with the tiled MLP, full fine-tune and fused LoRA with
the Triton dropout. On a CPU flex runs a dense sdpa path, so tests/unit/test_estimate.py cannot check these; CPU CI
skips this file. A mismatch here is what finetune/memory/calibration.py's ATTENTION_OUTPUT_COPIES and
FLEX_BLOCK_MASK_TENSORS stand for.
"""

import json
import os

import pytest
import torch

from finetune.config import LoraConfig
from finetune.memory.activations import estimate_activations
from finetune.perf import attention
from tests.helpers import SMALL_VOCAB

pytestmark = pytest.mark.skipif(attention.available() is not None, reason=str(attention.available()))


def _saved_bytes(lora: LoraConfig | None, tiled: bool, seq: int, rows: int = 2) -> tuple[int, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(SMALL_VOCAB)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    if lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        from finetune.perf.fused_lora import install_fused_lora

        model = get_peft_model(model, PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=lora.target_modules, task_type="CAUSAL_LM"))
        model.to(torch.bfloat16)
        install_fused_lora(model, zero_stage=2, dropout_kernel=lora.dropout_kernel)
    if tiled:
        from finetune.perf.tiled_mlp import install_tiled_mlp

        install_tiled_mlp(model, zero_stage=2, max_tokens=rows * seq, tile_tokens=512)
    assert attention.install(model)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), device="cuda")
    positions = torch.arange(seq // 2, device="cuda").repeat(rows, 2)  # two packed samples per row
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, position_ids=positions).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1))
    est = estimate_activations(json.load(open(os.path.join(SMALL_VOCAB, "config.json"))), lora, seq, rows, "none", 2,
                               "flex", True, dropout_mask_bytes=1, tiled_mlp=tiled)
    return sum(saved.values()), est


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=16)], ids=["full", "lora"])
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_flex_estimate_matches_saved_tensors(lora, tiled):
    measured, est = _saved_bytes(lora, tiled, 4096)
    print(f"saved {measured / 2**20:.2f} MiB, estimated {est['saved'] / 2**20:.2f} MiB")
    assert est["saved"] == pytest.approx(measured, rel=0.01), (measured, est)
