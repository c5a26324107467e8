"""The fused LoRA projection (finetune/perf/fused_lora.py) on CUDA: the CPU tests of tests/integration/test_fused_lora.py again with
cuBLAS's addmm and CUDA's dropout kernels. CI (CPU) skips it; the GPU benchmark call runs it with
tests/gpu/test_gpu_kernels.py (benchmarks/gpu_vs_peer.sh)."""

import copy

import pytest
import torch

from finetune.perf.fused_lora import install_fused_lora
from tests.fixtures.fused_lora_checks import (loss_and_grads, peft_mistral, rel_err,
                                              with_and_without_recomputation)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fp32_and_bf16_equal_peft_on_cuda():
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    peft_fp32 = peft_mistral(torch.float32).cuda()
    fused_fp32 = copy.deepcopy(peft_fp32)
    install_fused_lora(fused_fp32, zero_stage=2)
    ref_loss, oracle = loss_and_grads(peft_fp32, ids)
    loss, got = loss_and_grads(fused_fp32, ids)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert rel_err(got, oracle) < 1e-4
    peft_bf16 = peft_mistral(torch.bfloat16).cuda()
    fused_bf16 = copy.deepcopy(peft_bf16)
    install_fused_lora(fused_bf16, zero_stage=2)
    _, peft_grads = loss_and_grads(peft_bf16, ids)
    _, fused_grads = loss_and_grads(fused_bf16, ids)
    print("bf16 error vs fp32: peft", rel_err(peft_grads, oracle), "fused", rel_err(fused_grads, oracle))
    assert rel_err(fused_grads, oracle) < 2 * rel_err(peft_grads, oracle)


def test_cuda_dropout_mask_survives_recomputation():
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(4)).cuda()
    ((loss_plain, plain), (loss_ckpt, ckpt)), _ = with_and_without_recomputation(ids, "cuda")
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-5)
    assert rel_err(ckpt, plain) < 1e-4
