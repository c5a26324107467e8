"""ZeRO-1/2 in bf16: find a step's non-finite gradient by the gradient norm alone (optim.overflow_check=norm).

    install_overflow_check(engine, recipe.optim.overflow_check)   # by perf.apply_engine, after deepspeed.initialize

Before each step DeepSpeed's ZeRO-1/2 optimizer tests every gradient tensor for inf/NaN (reductions per tensor, then
a host sync that waits for the whole backward), then computes the global gradient norm and, with
bf16.check_grad_overflow on (its default), skips the step when that norm is not finite. A norm is non-finite whenever
any gradient element is, so the first test adds only its cost: while the host waits on it and then queues the norm's
kernels one tensor at a time, the GPU idles. For LoRA (448 adapter tensors) that was most of a LoRA ZeRO-2 profile's
idle time, and the step ran faster without the test (docs/benchmarks/2026-11-30-2xh200-vs-peer.md, calls ov and ov2).
Turning bf16.check_grad_overflow off instead drops both tests, and a NaN gradient then reaches the weights
(tests/integration/test_overflow_check.py shows both).
"""

from __future__ import annotations


def install_overflow_check(engine, mode: str) -> bool:
    """With mode `norm`, skip DeepSpeed's per-tensor test where its norm test stands in for it: ZeRO-1/2, no CPU
    offload (its norm is computed elsewhere), the norm computed and checked. Returns whether it did."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if mode != "norm" or not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    if not (optimizer.check_grad_overflow and optimizer.compute_grad_norm) or optimizer.cpu_offload:
        return False
    # step() calls check_overflow first and then, since check_grad_overflow stays on, treats an invalid norm as an
    # overflow: the same skipped step, the same loss-scale update.
    optimizer.check_overflow = _norm_decides
    return True


def _norm_decides(partition_gradients: bool = True) -> None:
    """DeepSpeedZeroOptimizer.check_overflow's stand-in: leaves `overflow` False for the norm test to set."""
