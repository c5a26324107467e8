"""What does one layer's attention cost at 32K tokens, zerotune's FlexAttention against transformers' sdpa with its
mask? Mistral-7B's attention shapes (32 query heads, 8 key/value heads, head_dim 128), one packed row of 32,768 tokens
(8 samples of 4,096), sliding window 4,096, bf16: the milliseconds of one forward and backward of
finetune/perf/attention.py's compiled path, and of sdpa over the 4-D mask Mistral builds (built once, as a model's
forward builds it), each the mean of 5 runs after 3 that compile and warm up. On one CUDA GPU:

    python benchmarks/attention_32k.py    # prints: attention fwd+bwd per layer at 32768 tokens, window 4096: flex ... ms, ...

That the two compute the same is tests/gpu/test_gpu_attention.py.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from finetune.perf import attention  # noqa: E402
from tests.fixtures.cuda_attention import forward_backward, packed_positions, sdpa_mask, sdpa_over  # noqa: E402

LENGTH, WINDOW, SAMPLES = 32768, 4096, 8
WARM, TIMED = 3, 5


def layer_ms() -> dict[str, float]:
    """Milliseconds of one forward and backward of one layer's attention, by implementation."""
    from transformers import MistralConfig
    from transformers.models.mistral.modeling_mistral import MistralAttention

    config = MistralConfig(sliding_window=WINDOW)
    config._attn_implementation = "sdpa"
    module = MistralAttention(config, 0)
    position_ids = packed_positions(LENGTH, (LENGTH // SAMPLES,) * SAMPLES)
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(1, h, LENGTH, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (32, 8, 8)]
    grad_out = torch.randn(1, LENGTH, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    flex = lambda q, k, v: attention.attention(module, q, k, v, None, position_ids=position_ids,
                                               scaling=module.scaling, sliding_window=WINDOW)[0]
    sdpa = sdpa_over(module, sdpa_mask(config, inputs[0], position_ids))  # built once, as a model's forward builds it
    timings = {}
    for name, fn in (("flex", flex), ("sdpa with its mask", sdpa)):
        for _ in range(WARM):  # compile, then warm
            forward_backward(fn, inputs, grad_out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMED):
            forward_backward(fn, inputs, grad_out)
        end.record()
        torch.cuda.synchronize()
        timings[name] = start.elapsed_time(end) / TIMED
    return timings


def main() -> int:
    why = attention.available()
    if why is not None:
        print(f"attention_32k: {why}", file=sys.stderr)
        return 1
    timings = layer_ms()
    print(f"attention fwd+bwd per layer at {LENGTH} tokens, window {WINDOW}: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
