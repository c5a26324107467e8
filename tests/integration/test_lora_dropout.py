"""LoRA dropout drawn from a seed in Triton kernels (finetune/perf/lora_dropout.py, lora.dropout_kernel). Triton's CPU
interpreter runs the kernels (fp32) in tests/drivers/lora_dropout_cases.py: each kernel equals torch on the mask it draws, the
fused LoRA function with them equals autograd over that mask, recomputation redraws the same masks, and it keeps a seed
where torch's path keeps a bool per element. Here: those cases, the estimator's term, what `auto` resolves to and the
config's errors. On CUDA (bf16, Mistral-7B's widths) the same checks are tests/gpu/test_gpu_lora_dropout.py."""

import pytest
import torch
from tests.helpers import run_under_triton_interpreter


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, tests/gpu/test_gpu_lora_dropout.py runs the compiled kernels "
                    "(and Triton 3.6's interpreter, there, fails on them; CI's 3.9 runs them)")
def test_kernels_under_tritons_interpreter():
    run_under_triton_interpreter("tests/drivers/lora_dropout_cases.py", passed=6)
