"""liger-kernel's RMSNorm, SwiGLU and RoPE (model.kernels) leave the loss curve unchanged: 6 AdamW steps of a small
Mistral, with and without the kernels, fp32 and bf16. Needs CUDA and liger-kernel (Triton), so CI (CPU) skips it; the
GPU benchmark call runs it (benchmarks/gpu_vs_peer.sh) and docs/benchmarks/vs_peer_2xh200.md records the result.
"""

import pytest
import torch

from finetune import kernels
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.skipif(kernels.available() is not None, reason=str(kernels.available()))


def _curve(model_dir: str, dtype, steps: int = 6) -> list[float]:
    from transformers import AutoModelForCausalLM

    from finetune.loss import install_fused_loss, fused_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    install_fused_loss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 32000, (2, 128), generator=g).cuda()
        with fused_loss(model, torch.roll(ids, -1, 1)):
            loss = model(input_ids=ids).logits / ids.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_liger_kernels_leave_the_loss_curve(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "m"))
    plain = {dtype: _curve(model_dir, dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert kernels.apply("auto") == "liger"  # patches transformers' Mistral modules for models built from now on
    liger = {dtype: _curve(model_dir, dtype) for dtype in (torch.float32, torch.bfloat16)}
    print({str(k): (plain[k], liger[k]) for k in plain})
    assert plain[torch.float32][-1] < plain[torch.float32][0]
    assert max(abs(a - b) for a, b in zip(plain[torch.float32], liger[torch.float32])) < 1e-4
    assert max(abs(a - b) for a, b in zip(plain[torch.bfloat16], liger[torch.bfloat16])) < 2e-2
