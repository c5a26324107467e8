"""FP8 against bf16 for LoRA's frozen base weight, at each of Mistral-7B's projection shapes, on one GPU: the forward
(x·Wᵀ) and the input gradient (grad_y·W) as bf16 F.linear, and as finetune/perf/fp8.py's Fp8BaseLinearFunction with
the weight quantized once beforehand and the per-token quantization of x and grad_y counted in its time.

    python benchmarks/fp8_linear.py --out /tmp/fp8.json [--tokens 16384] [--compile]
    python benchmarks/fp8_linear.py --smoke --out /tmp/fp8_smoke.json   # the same code on CPU, tiny shapes

--compile runs the row-wise quantizer through torch.compile (backward's fold of W's scales into grad_y, the abs,
amax, divide and cast fused). Both sides run under autograd, x requiring a gradient and W none, and each backward is
torch.autograd.grad (no .grad accumulation).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from finetune.perf.fp8 import Fp8BaseLinearFunction, fp8_gemm_runs, quantize_rows, quantize_weight  # noqa: E402

# Mistral-7B's projections, (out, in): W is [out, in], x is [tokens, in]
PROJECTIONS = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096),
               "gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336)}
SMOKE_DIVISOR, SMOKE_TOKENS = 64, 64  # --smoke: every width / 64 (still multiples of 16), 64 tokens


def _time(fn, repeat: int, cuda: bool) -> float:
    """Median milliseconds of fn over `repeat` calls after a warm-up (compiles included there): CUDA events on a
    GPU, the wall clock on CPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def projection(out_f: int, in_f: int, tokens: int, device: str, quantize, repeat: int) -> dict:
    """Times and errors of one projection: bf16 against FP8, forward alone and forward + input gradient."""
    x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(out_f, in_f, device=device) / in_f ** 0.5).bfloat16()
    grad_y = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight(w)
    bf16 = lambda: F.linear(x, w)
    fp8 = lambda: Fp8BaseLinearFunction.apply(x, w_q, w_scale, None, quantize)
    cuda = device == "cuda"
    row = {"out": out_f, "in": in_f,
           "bf16_fwd_ms": _time(bf16, repeat, cuda), "fp8_fwd_ms": _time(fp8, repeat, cuda),
           "bf16_ms": _time(lambda: torch.autograd.grad(bf16(), x, grad_y), repeat, cuda),
           "fp8_ms": _time(lambda: torch.autograd.grad(fp8(), x, grad_y), repeat, cuda)}
    flops = 2 * tokens * out_f * in_f  # one GEMM; forward + input gradient is two
    for side in ("bf16", "fp8"):
        row[f"{side}_fwd_tflops"] = flops / row[f"{side}_fwd_ms"] / 1e9
        row[f"{side}_tflops"] = 2 * flops / row[f"{side}_ms"] / 1e9
    row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
    # FP8 against the bf16 result: the timed path computes the layer (near 0.04 for random data: tests/unit/test_fp8.py)
    y8 = fp8()
    row["rel_err_y"] = _rel(y8, bf16())
    row["rel_err_grad_x"] = _rel(torch.autograd.grad(y8, x, grad_y)[0], torch.autograd.grad(bf16(), x, grad_y)[0])
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="quantize through torch.compile(quantize_rows)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the code, times nothing of interest")
    p.add_argument("--out", default="runs/fp8_linear.json")
    a = p.parse_args()
    if a.smoke:
        device, tokens, div = "cpu", SMOKE_TOKENS, SMOKE_DIVISOR
    else:
        if not torch.cuda.is_available():
            raise SystemExit("fp8_linear.py times FP8 GEMMs on a CUDA GPU (compute capability 8.9+); none is visible "
                             "here. --smoke runs the same code on CPU at tiny shapes.")
        if not fp8_gemm_runs(torch.device("cuda"), torch.bfloat16):
            raise SystemExit(f"{torch.cuda.get_device_name()} (compute capability "
                             f"{torch.cuda.get_device_capability()}) has no FP8 tensor cores: they start at 8.9.")
        device, tokens, div = "cuda", a.tokens, 1
    torch.manual_seed(0)
    quantize = torch.compile(quantize_rows) if a.compile else quantize_rows
    rows = []
    for name, (out_f, in_f) in PROJECTIONS.items():
        rows.append({"proj": name, **projection(out_f // div, in_f // div, tokens, device, quantize, a.repeat)})
    total_bf16, total_fp8 = sum(r["bf16_ms"] for r in rows), sum(r["fp8_ms"] for r in rows)
    print(f"tokens {tokens}, compile {a.compile}, {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    print("| proj | W [out, in] | fwd TFLOP/s bf16 | fwd TFLOP/s fp8 | fwd+bwd ms bf16 | fwd+bwd ms fp8 "
          "| fwd+bwd TFLOP/s bf16 | fwd+bwd TFLOP/s fp8 | speed-up | rel err y | rel err grad_x |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['proj']} | {r['out']}x{r['in']} | {r['bf16_fwd_tflops']:.0f} | {r['fp8_fwd_tflops']:.0f} | "
              f"{r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | {r['bf16_tflops']:.0f} | {r['fp8_tflops']:.0f} | "
              f"{r['speedup']:.2f} | {r['rel_err_y']:.3f} | {r['rel_err_grad_x']:.3f} |")
    print(f"| layer | all seven | | | {total_bf16:.3f} | {total_fp8:.3f} | | | {total_bf16 / total_fp8:.2f} | | |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "tokens": tokens, "compile": a.compile, "smoke": a.smoke, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "layer_bf16_ms": total_bf16, "layer_fp8_ms": total_fp8}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
