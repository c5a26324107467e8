"""The precision of the linear layers' GEMMs, chosen by model.precision: bf16, or FP8 (finetune/perf/fp8.py).

    precision = of_recipe(recipe, bf16)                       # "bf16" | "fp8": resolve() with the recipe's shape
    count = install(model, lora, zero_stage)                  # by perf.apply, before deepspeed.initialize

LoRA: each adapted projection's frozen base layer becomes an Fp8FrozenLinear. Under ZeRO-0/1/2 its weight is
quantized once, here, to float8_e4m3fn with one fp32 scale per output row, and the bf16 weight is dropped: the base
takes half the memory. Under ZeRO-3 the bf16 weight stays partitioned and the gathered weight is quantized at each
use (forward, and again in backward), so nothing gathered is kept. The forward's GEMM and the input gradient's run in
FP8; the adapters, norms, attention, loss and optimizer do not change. The FP8 copy is never trained and never
saved (non-persistent buffers): checkpoints keep what they kept, and a merged export takes the base from model.path.

Full fine-tuning: every decoder linear layer becomes an Fp8Linear: the forward's and the input gradient's GEMMs in
FP8 with per-token and per-output-row scales, as LoRA's base, the weight quantized at each use; the weight gradient
in bf16 from the kept input, as F.linear's (the one the optimizer accumulates keeps bf16's precision); master weights
and optimizer states as before. Per-token scales make a token's result independent of the other tokens of its
micro-batch (a tensor-wise scale is the whole micro-batch's largest value, padding included), so the same rows give
the same losses on any number of ranks. lm_head stays in bf16.

`auto` is FP8 only on GPUs with FP8 tensor cores (compute capability 8.9+) in a bf16 run, only for the kinds of run
(LoRA, full) whose quality gate passed (benchmarks/precision.py, docs/performance.md), and only for micro-batches
large enough for FP8 to be faster (AUTO_MIN_TOKENS) of rows the gate ran (AUTO_MAX_SEQ_LEN); elsewhere bf16. An
explicit `fp8` runs anywhere: on a CPU the GEMMs are the FP8 reference (exact fp32 products of the FP8 values), which is
what the tests check, and no faster.
"""

from __future__ import annotations

import torch

from finetune.perf import fp8

GATE_PASSED = {"lora": True, "full": True}
"""Where `auto` may pick FP8: the kinds of run whose quality gate passed on an H200 (benchmarks/precision.py, 200
steps from the same init on the same batches): LoRA ZeRO-2 within 0.10% of bf16's loss at every step, eval 0.02%
(docs/benchmarks/2026-12-03-h200-fp8-precision.md); full fine-tuning ZeRO-3 through Fp8Linear within 0.16%, eval
0.01% (docs/benchmarks/2026-12-04-h200-fp8-vs-peer.md). At 8 rows of 2,048 tokens FP8 ran LoRA ZeRO-2 at 1.33x
bf16's tok/s and full ZeRO-3 at 1.20x (the same page)."""
AUTO_MIN_TOKENS = 16_384
"""`auto` picks FP8 for micro-batches of at least this many tokens: on an H200 FP8 ran below bf16's tok/s at smaller
ones (LoRA ZeRO-2 0.85x at 4 rows of 2,048 tokens, full ZeRO-3 0.78x at 1 row), where the quantizers' and GEMMs'
fixed costs per call outweigh the faster GEMMs."""
AUTO_MAX_SEQ_LEN = 2048
"""...and for rows no longer than the gate's: longer rows (attention over more positions, tiled MLPs, long-context
RoPE) are not what it measured, so `auto` keeps bf16 there; model.precision=fp8 still runs them."""


def of_recipe(recipe, bf16: bool) -> str:
    """resolve() for a run of this recipe (the training run and the memory estimator ask the same)."""
    return resolve(recipe.model.precision, recipe.lora.enabled, bf16,
                   recipe.train.micro_batch_size * recipe.data.max_seq_len, recipe.data.max_seq_len)


def resolve(precision: str, lora: bool, bf16: bool, micro_batch_tokens: int, seq_len: int) -> str:
    """`bf16` or `fp8` for this run: model.precision, with `auto` decided by the GPU, the quality gate and the shape
    of the micro-batch."""
    if precision != "auto":
        return precision
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    measured = micro_batch_tokens >= AUTO_MIN_TOKENS and seq_len <= AUTO_MAX_SEQ_LEN
    wanted = GATE_PASSED["lora" if lora else "full"] and measured
    return "fp8" if bf16 and wanted and fp8.fp8_gemm_runs(device, torch.bfloat16) else "bf16"


class Fp8Linear(torch.nn.Linear):
    """A trained nn.Linear (full fine-tuning) whose forward GEMM and input-gradient GEMM run in FP8: its parameters,
    names and checkpoints are nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.Fp8LinearFunction.apply(x, self.weight, self.bias, fp8.quantizer(x.device))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=e4m3 row-wise, weight gradient in the input's dtype"


class Fp8FrozenLinear(torch.nn.Linear):
    """A frozen nn.Linear whose forward GEMM and input-gradient GEMM run in FP8.

    Its FP8 weight is `weight_fp8` [out, in] with `weight_scale` [out, 1] once to_fp8 has made them (then it has no
    `weight` parameter), else (ZeRO-3) its gathered `weight` quantized at each use."""

    def fp8_weight(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(w_q, w_scale) when kept, else (None, None): the caller quantizes `weight`."""
        if "weight_fp8" in self._buffers:
            return self.weight_fp8, self.weight_scale
        return None, None

    def to_fp8(self) -> None:
        """Quantize the weight once (on the GPU when there is one) and drop the bf16 copy."""
        weight = self.weight.detach()
        if torch.cuda.is_available():
            weight = weight.to(torch.cuda.current_device())
        w_q, w_scale = fp8.quantize_weight(weight)
        del self.weight
        self.register_buffer("weight_fp8", w_q, persistent=False)
        self.register_buffer("weight_scale", w_scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_q, w_scale = self.fp8_weight()
        return fp8.Fp8BaseLinearFunction.apply(x, w_q, w_scale, self.bias, fp8.quantizer(x.device),
                                               None if w_q is not None else self.weight)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=e4m3 row-wise"


def install(model: torch.nn.Module, lora: bool, zero_stage: int) -> int:
    """Put the model's linear layers in FP8; returns how many. Call it before deepspeed.initialize (ZeRO-3's hooks)."""
    if lora:
        return _install_lora(model, keep_fp8=zero_stage < 3)
    return _install_full(model)


def _install_lora(model: torch.nn.Module, keep_fp8: bool) -> int:
    from peft.tuners.lora.layer import Linear

    count = 0
    for layer in [m for m in model.modules() if isinstance(m, Linear)]:
        base = layer.get_base_layer()
        if type(base) is not torch.nn.Linear or base.weight.requires_grad:
            continue
        base.__class__ = Fp8FrozenLinear
        if keep_fp8:
            base.to_fp8()
        count += 1
    return count


def _install_full(model: torch.nn.Module) -> int:
    """Every decoder nn.Linear becomes an Fp8Linear (its class swapped: the same parameters); lm_head stays."""
    layers = [m for name, m in model.named_modules()
              if type(m) is torch.nn.Linear and ".layers." in f".{name}"]
    for layer in layers:
        layer.__class__ = Fp8Linear
    return len(layers)
