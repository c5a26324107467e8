"""liger-kernel's RMSNorm, SwiGLU and RoPE (model.kernels) leave the loss curve unchanged: 6 AdamW steps of a small
Mistral, with and without the kernels, fp32 and bf16. Needs CUDA and liger-kernel (Triton), so CI (CPU) skips it; the
GPU benchmark call runs it (benchmarks/gpu_vs_peer.sh) and docs/benchmarks/vs_peer_2xh200.md records the result.
"""

import pytest
import torch

from finetune.perf import liger as kernels
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.skipif(kernels.available() is not None, reason=str(kernels.available()))


def _curve(model_dir: str, dtype, steps: int = 6) -> list[float]:
    from transformers import AutoModelForCausalLM

    from finetune.perf.fused_loss import install_fused_loss, fused_loss

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


class TorchMLP(torch.nn.Module):
    """transformers' MistralMLP (act_fn = silu), which liger's patch replaces in transformers' module."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gate_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


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

    from transformers import AutoModelForCausalLM

    from finetune.perf.fused_mlp import install_fused_mlp

    model_dir = save_tiny_model(str(tmp_path / "m"))
    if liger:
        assert kernels.apply("auto") == "liger"
    ids = torch.randint(0, 32000, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
        if not liger:  # transformers' own MLP (an earlier test patched liger's into its module)
            for layer in plain.model.layers:
                mlp = TorchMLP(plain.config).to(dtype).cuda()
                mlp.load_state_dict(layer.mlp.state_dict())
                layer.mlp = mlp
        assert (type(plain.model.layers[0].mlp).__name__ == "LigerSwiGLUMLP") == liger
        fused = copy.deepcopy(plain)
        assert install_fused_mlp(fused, zero_stage=2, liger=liger) == len(plain.model.layers)
        loss_p, grads_p = _mlp_grads(plain, ids)
        loss_f, grads_f = _mlp_grads(fused, ids)
        assert torch.equal(loss_p, loss_f), (dtype, loss_p, loss_f)
        for name, g in grads_p.items():
            err = (grads_f[name] - g).abs().max().item() / max(g.abs().max().item(), 1e-12)
            assert err < tol, (dtype, name, err)
