"""The fused LoRA projection (finetune/perf/fused_lora.py) on CUDA: the CPU tests of tests/integration/test_fused_lora.py again with
cuBLAS's addmm and CUDA's dropout kernels. CI (CPU) skips it; the GPU benchmark call runs it with
tests/gpu/test_gpu_kernels.py (benchmarks/gpu_vs_peer.sh)."""

import copy

import pytest
import torch

from finetune.perf.fused_lora import install_fused_lora
from tests.unit.test_fused_lora import (_loss_and_grads, _peft_mistral, _rel_err,
                                   _with_and_without_recomputation)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fp32_and_bf16_equal_peft_on_cuda():
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    peft_fp32 = _peft_mistral(torch.float32).cuda()
    fused_fp32 = copy.deepcopy(peft_fp32)
    install_fused_lora(fused_fp32, zero_stage=2)
    ref_loss, oracle = _loss_and_grads(peft_fp32, ids)
    loss, got = _loss_and_grads(fused_fp32, ids)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert _rel_err(got, oracle) < 1e-4
    peft_bf16 = _peft_mistral(torch.bfloat16).cuda()
    fused_bf16 = copy.deepcopy(peft_bf16)
    install_fused_lora(fused_bf16, zero_stage=2)
    _, peft_grads = _loss_and_grads(peft_bf16, ids)
    _, fused_grads = _loss_and_grads(fused_bf16, ids)
    print("bf16 error vs fp32: peft", _rel_err(peft_grads, oracle), "fused", _rel_err(fused_grads, oracle))
    assert _rel_err(fused_grads, oracle) < 2 * _rel_err(peft_grads, oracle)


def test_cuda_dropout_mask_survives_recomputation():
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(4)).cuda()
    ((loss_plain, plain), (loss_ckpt, ckpt)), _ = _with_and_without_recomputation(ids, "cuda")
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-5)
    assert _rel_err(ckpt, plain) < 1e-4
