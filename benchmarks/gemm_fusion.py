"""What would one GEMM for q/k/v (and one for gate/up) on concatenated weights save? Times the three GEMMs of a linear
layer (forward, input gradient, weight gradient) at Mistral-7B's shapes, the projections apart and fused, on one GPU.

    python benchmarks/gemm_fusion.py --tokens 16384 --out runs/gemm_fusion.json

Fusing also drops the sums of the input gradients (q, k and v share their input; so do gate and up): they are timed
too. The per-step figure is 32 layers' worth, for a micro-batch of `--tokens` tokens (8 rows of 2,048 tokens: 16,384).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

GROUPS = {"q/k/v": [4096, 1024, 1024], "gate/up": [14336, 14336]}  # output widths; input width 4096 (Mistral-7B)
HIDDEN, LAYERS = 4096, 32


def _once(fn) -> float:
    """Milliseconds of one CUDA-timed call of fn."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _time(fn, repeat: int) -> float:
    """Median milliseconds of fn over `repeat` CUDA-timed calls, after a warm-up."""
    for _ in range(3):
        fn()
    times = sorted(_once(fn) for _ in range(repeat))
    return times[len(times) // 2]


def layer_gemms(x: torch.Tensor, weights: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Forward, input gradient (summed over the projections that share x) and weight gradient of each projection."""
    grad_x = None
    for w, g in zip(weights, grads):
        torch.mm(x, w.t())
        gx = torch.mm(g, w)
        grad_x = gx if grad_x is None else grad_x.add_(gx)
        torch.mm(g.t(), x)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", default="runs/gemm_fusion.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_fusion.py times CUDA GEMMs: run it on a GPU")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(a.tokens, HIDDEN, device=dev, dtype=dt)
    rows = []
    for name, widths in GROUPS.items():
        weights = [torch.randn(w, HIDDEN, device=dev, dtype=dt) * 0.02 for w in widths]
        grads = [torch.randn(a.tokens, w, device=dev, dtype=dt) for w in widths]
        fused_w, fused_g = [torch.cat(weights)], [torch.cat(grads, dim=1)]
        apart = _time(lambda: layer_gemms(x, weights, grads), a.repeat)
        fused = _time(lambda: layer_gemms(x, fused_w, fused_g), a.repeat)
        flops = 3 * 2 * a.tokens * HIDDEN * sum(widths)
        rows.append({"group": name, "tokens": a.tokens, "apart_ms": apart, "fused_ms": fused,
                     "apart_tflops": flops / apart / 1e9, "fused_tflops": flops / fused / 1e9,
                     "saved_ms_per_step": LAYERS * (apart - fused)})
    print(f"| projections | apart ms | fused ms | apart TFLOP/s | fused TFLOP/s | saved per step ({LAYERS} layers) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['group']} | {r['apart_ms']:.3f} | {r['fused_ms']:.3f} | {r['apart_tflops']:.0f} | "
              f"{r['fused_tflops']:.0f} | {r['saved_ms_per_step']:.1f} ms |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
