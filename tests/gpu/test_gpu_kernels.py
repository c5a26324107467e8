"""liger-kernel's RMSNorm, SwiGLU and RoPE (model.kernels) leave the loss curve unchanged: a small Mistral trained for 6
AdamW steps on one fixed batch, which it memorises (so the loss falls every step), with and without the kernels from
the same weights, fp32 and bf16. Needs CUDA and liger-kernel (Triton), so CI (CPU) skips it; the GPU runs
record it (docs/benchmarks/2026-12-03-h200-gpu-tier.md). The kernels go into each model through finetune.perf.apply
(per instance: the models without them here are transformers' own, whatever ran before).
"""

import os

import pytest
import torch

from finetune import perf
from finetune.config import Recipe, load_recipe
from finetune.perf import liger as kernels
from tests.helpers import TINY_CONFIG, TINY_RECIPE, save_tiny_model

pytestmark = pytest.mark.skipif(kernels.available() is not None, reason=str(kernels.available()))

STAGE0 = {"zero_optimization": {"stage": 0}}
# The 32,000-token tiny model: the inputs below draw ids from its whole vocabulary (save_tiny_model's default is the
# 512-piece one, where they would index past the embedding).
TINY_DIR = os.path.dirname(TINY_CONFIG)


def _recipe(model_dir: str, liger: bool, fused_loss: bool) -> Recipe:
    return load_recipe(TINY_RECIPE, [f"model.path={model_dir}", "lora.enabled=false", "model.fused_mlp=false", "model.attn_implementation=sdpa",
                                     f"model.kernels={'liger' if liger else 'none'}",
                                     f"model.fused_loss={str(fused_loss).lower()}"])


def _curve(model_dir: str, dtype, liger: bool, steps: int = 6) -> list[float]:
    """The loss before each of `steps` AdamW steps on one batch of random tokens, the same batch every step: random
    tokens drawn afresh each step cannot be learned (the loss stays at ln(32,000)), a repeated batch can."""
    from transformers import AutoModelForCausalLM

    from finetune.perf.fused_loss import fused_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    applied = perf.apply(model, _recipe(model_dir, liger, fused_loss=True), STAGE0)
    assert applied == (["liger", "fused_loss"] if liger else ["fused_loss"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 32000, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    losses = []
    for _ in range(steps):
        with fused_loss(model, torch.roll(ids, -1, 1)):
            loss = model(input_ids=ids).logits / ids.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# How far the curves with and without the kernels may part over the 6 steps: fp32 differs only in summation order,
# bf16 also in where each kernel rounds to bf16 (liger's RMSNorm and SwiGLU compute in fp32 inside and round once).
PARITY = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
LEARNS = 0.5
"""The least fall of the loss over the 6 steps (nats): the batch is being memorised, so the curves compared move."""


def test_liger_kernels_leave_the_loss_curve(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "m"), config_dir=TINY_DIR)
    for dtype, tolerance in PARITY.items():
        plain, liger = _curve(model_dir, dtype, liger=False), _curve(model_dir, dtype, liger=True)
        gap = max(abs(a - b) for a, b in zip(plain, liger))
        print(f"{dtype}: without {[round(x, 5) for x in plain]}, with liger {[round(x, 5) for x in liger]}, "
              f"largest gap {gap:.2e}")
        for curve in (plain, liger):
            assert all(b < a for a, b in zip(curve, curve[1:])) and curve[0] - curve[-1] > LEARNS, (dtype, curve)
        assert gap < tolerance, (dtype, gap, plain, liger)


def _mlp_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("liger", [True, False], ids=["liger", "torch"])
def test_fused_mlp_gradients_on_cuda(tmp_path, liger):
    """finetune/perf/fused_mlp.py on the GPU, over liger's SwiGLU kernels (the default there) and torch's ops: the loss is
    the unfused model's to the bit (the same kernels in forward), every gradient within cuBLAS's own variation (fp32)
    or bf16's (the down projection's weight gradient is one GEMM over the rebuilt product)."""
    import copy

    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers import AutoModelForCausalLM

    from finetune.perf.fused_mlp import install_fused_mlp

    model_dir = save_tiny_model(str(tmp_path / "m"), config_dir=TINY_DIR)
    ids = torch.randint(0, 32000, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
        assert perf.apply(plain, _recipe(model_dir, liger, fused_loss=False), STAGE0) == (["liger"] if liger else [])
        mlp_forward = getattr(plain.model.layers[0].mlp.forward, "__func__", None)
        assert (mlp_forward is LigerSwiGLUMLP.forward) == liger
        fused = copy.deepcopy(plain)  # the fused MLP alone, on top of what plain runs
        assert install_fused_mlp(fused, zero_stage=2, liger=liger) == len(plain.model.layers)
        loss_p, grads_p = _mlp_grads(plain, ids)
        loss_f, grads_f = _mlp_grads(fused, ids)
        assert torch.equal(loss_p, loss_f), (dtype, loss_p, loss_f)
        for name, g in grads_p.items():
            err = (grads_f[name] - g).abs().max().item() / max(g.abs().max().item(), 1e-12)
            assert err < tol, (dtype, name, err)
