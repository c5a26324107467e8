"""What does LoRA's input dropout cost per step, and which way is cheapest? Times one fused LoRA projection (forward
and backward, finetune/perf/fused_lora.py) at each of Mistral-7B's seven projection shapes, bf16, r 16, dropout 0.05, with
torch's dropout (a bool mask kept per adapter), with the seeded Triton kernels (lora.dropout_kernel=triton, nothing
kept) and with no dropout (the floor), on one GPU. With --sweep it first times each Triton kernel alone at each tile
(rows x columns x warps) for inputs 4,096 and 14,336 wide, and takes the fastest per kernel for the projections.

    python benchmarks/lora_dropout_kernels.py --sweep 64x64x4 32x128x4 --out runs/lora_dropout_kernels.json

The per-step figure is 32 layers' worth for a micro-batch of `--tokens` tokens (8 rows of 2,048 tokens: 16,384).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gemm_fusion import _once, _time  # noqa: E402
from finetune.perf import lora_dropout  # noqa: E402
from finetune.perf.fused_lora import LoraLinearFunction  # noqa: E402

# Mistral-7B's projections, (in, out): q, k, v, o, gate, up, down
PROJECTIONS = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
               "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}
LAYERS, RANK, P = 32, 16, 0.05


VARIANTS = {"none": (0.0, False), "torch": (P, False), "triton": (P, True)}  # (dropout, seeded)


def layer_ms(tokens: int, repeat: int) -> dict[str, float]:
    """Milliseconds of the seven adapted projections of one layer, forward and backward, summed, per dropout variant.
    The variants take turns call by call: the GPU slows as it heats under its power cap, and a variant timed after
    the others would pay for that."""
    total = dict.fromkeys(VARIANTS, 0.0)
    for width, out in PROJECTIONS.values():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = torch.randn(out, width, device="cuda", dtype=torch.bfloat16, generator=g) / width**0.5
        a = (torch.randn(RANK, width, device="cuda", dtype=torch.bfloat16, generator=g) / width**0.5).requires_grad_()
        b = (torch.randn(out, RANK, device="cuda", dtype=torch.bfloat16, generator=g) * 0.01).requires_grad_()
        grad = torch.randn(tokens, out, device="cuda", dtype=torch.bfloat16, generator=g)

        def step(p, seeded):
            LoraLinearFunction.apply(x, w, None, a, b, 2.0, p, seeded).backward(grad)
            x.grad = a.grad = b.grad = None

        for name in VARIANTS:  # warm-up; Triton compiles on the first call
            _once(lambda: step(*VARIANTS[name]))
        times = {name: [] for name in VARIANTS}
        for _ in range(repeat):
            for name in VARIANTS:
                times[name].append(_once(lambda: step(*VARIANTS[name])))
        for name in VARIANTS:
            total[name] += sorted(times[name])[len(times[name]) // 2]
    return total


def kernel_ms(kernel: str, tokens: int, width: int, repeat: int) -> dict[str, float]:
    """Milliseconds of one Triton kernel (finetune/perf/lora_dropout.py) alone on a [tokens, width] input, r 16, and of
    the torch ops that do its work with torch's dropout (mask given) and with none. (x stands in for grad_x too.)"""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(RANK, width, device="cuda", dtype=torch.bfloat16, generator=g) / width**0.5
    low = torch.randn(tokens, RANK, device="cuda", dtype=torch.bfloat16, generator=g)
    seed = lora_dropout.new_seed(x.device)
    mask = torch.rand(tokens, width, device="cuda", generator=g) >= P
    drop = torch.ops.aten.native_dropout_backward
    scale = 1 / (1 - P)

    def torch_backward(dropout: bool):
        if dropout:
            x.add_(drop(low @ a, mask, scale))
            return low.t() @ drop(x, mask, scale)
        x.addmm_(low, a)
        return low.t() @ x

    runs = {"low_rank": (lambda: lora_dropout.dropped_low_rank(x, a, seed, P),
                         lambda: torch.native_dropout(x, P, True)[0] @ a.t(), lambda: x @ a.t()),
            "backward": (lambda: lora_dropout.dropped_backward(low, a, seed, P, grad_x=x, x=x),
                         lambda: torch_backward(True), lambda: torch_backward(False))}[kernel]
    return dict(zip(("triton", "torch_dropout", "no_dropout"), (_time(run, repeat) for run in runs)))


def _tile(text: str) -> tuple[int, ...]:
    """ROWSxCOLUMNSxWARPS[xSTAGES] -> lora_dropout.TILES' (rows, columns, warps, stages); 3 stages if not given."""
    parts = tuple(int(n) for n in text.split("x"))
    return parts + (3,) * (4 - len(parts))


def sweep(tiles: list[str], tokens: int, repeat: int) -> list[dict]:
    """Each kernel at each tile; sets lora_dropout.TILES to the fastest over one layer's seven projections."""
    rows = []
    for kernel in ("low_rank", "backward"):
        best = None
        for tile in tiles:
            lora_dropout.TILES[kernel] = _tile(tile)
            ms = {w: kernel_ms(kernel, tokens, w, repeat) for w in (4096, 14336)}
            rows.append({"kernel": kernel, "tile": tile, **{f"{k}_{w}": v for w in ms for k, v in ms[w].items()}})
            per_layer = 6 * ms[4096]["triton"] + ms[14336]["triton"]  # six projections take 4,096 wide inputs
            if best is None or per_layer < best[1]:
                best = (lora_dropout.TILES[kernel], per_layer)
        lora_dropout.TILES[kernel] = best[0]
    print("| kernel | tile | ms, 4,096 wide: triton / torch dropout / none | 14,336 wide |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['tile']} | " + " | ".join(
            " / ".join(f"{r[f'{k}_{w}']:.3f}" for k in ("triton", "torch_dropout", "no_dropout"))
            for w in (4096, 14336)) + " |")
    print(f"fastest: {lora_dropout.TILES}\n")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--sweep", nargs="*", default=[],
                    help="Triton tiles ROWSxCOLUMNSxWARPS[xSTAGES] (COLUMNS a multiple of 8)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="runs/lora_dropout_kernels.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lora_dropout_kernels.py times CUDA kernels: run it on a GPU")
    swept = sweep(a.sweep, a.tokens, a.repeat) if a.sweep else []
    rows = [{"dropout": name, "ms_per_layer": ms} for name, ms in layer_ms(a.tokens, a.repeat).items()]
    floor = rows[0]["ms_per_layer"]
    print(f"| dropout | ms per layer | ms per step ({LAYERS} layers) | over no dropout per step |")
    print("|---|---:|---:|---:|")
    for r in rows:
        r["ms_per_step"] = LAYERS * r["ms_per_layer"]
        r["over_none_ms_per_step"] = LAYERS * (r["ms_per_layer"] - floor)
        print(f"| {r['dropout']} | {r['ms_per_layer']:.2f} | {r['ms_per_step']:.0f} | "
              f"{r['over_none_ms_per_step']:.0f} |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "sweep": swept, "tiles": lora_dropout.TILES, "tokens": a.tokens, "rank": RANK, "p": P,
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
