"""The long-sequence peer built from DeepSpeed's own parts (ALST, `deepspeed.runtime.sequence_parallel.ulysses_sp`):
a Hugging Face model under a DeepSpeed engine with `UlyssesSPAttentionHF` registered, `TiledMLP` on every decoder
layer's MLP, `TiledFusedLogitsLoss` for the loss (no [tokens, vocab] logits), liger-kernel's RoPE and RMSNorm, and
activation checkpointing that keeps each layer's input in pinned CPU memory. One run per launch:

    deepspeed --num_gpus 1 --master_addr 127.0.0.1 benchmarks/peer_alst.py --model /tmp/init --lora --seq 131072 \
        --steps 3 --skip 1 --out alst.json

On one GPU the sequence-parallel degree is 1: `register_with_transformers` then leaves attention as it is (SDPA, the
attention DeepSpeed's tutorial runs without flash-attn), so what ALST adds there is the tiling and the offload. Work
per step is benchmarks/long_context.py's: one row of --seq tokens, LoRA r16 on the seven projections (or full
fine-tuning), bf16, AdamW, ZeRO-2. Rank 0 writes step times, tokens/s per GPU, peak GPU and host memory to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class OffloadedCheckpoint(torch.autograd.Function):
    """A decoder layer run without saving anything on the GPU: its input goes to pinned CPU memory, and backward
    brings it back, runs the layer again with gradients (same random state: LoRA dropout) and backpropagates."""

    @staticmethod
    def forward(ctx, function, hidden, *args):
        ctx.function, ctx.args, ctx.device = function, args, hidden.device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        ctx.kept = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=hidden.is_cuda)
        ctx.kept.copy_(hidden, non_blocking=True)
        with torch.no_grad():
            out = function(hidden, *args)
        return out if isinstance(out, torch.Tensor) else out[0]

    @staticmethod
    def backward(ctx, grad):
        hidden = ctx.kept.to(ctx.device, non_blocking=True).detach().requires_grad_(True)
        ctx.kept = None
        with torch.random.fork_rng(devices=[ctx.device] if ctx.cuda_rng is not None else []), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            out = ctx.function(hidden, *ctx.args)
            out = out if isinstance(out, torch.Tensor) else out[0]
        torch.autograd.backward(out, grad)
        return (None, hidden.grad) + (None,) * len(ctx.args)


def offloaded_checkpoint(function, *args, **kwargs):
    return OffloadedCheckpoint.apply(function, *args)


def tiled_mlp_forward(self, x):
    """DeepSpeed's TiledMLP as its docstring patches it in: shards of ~hidden-size tokens, forward again in backward."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
    params = [p for m in (self.gate_proj, self.up_proj, self.down_proj) for p in m.parameters() if p.requires_grad]

    def mlp(module, shard):
        return module.down_proj(module.act_fn(module.gate_proj(shard)) * module.up_proj(shard))

    return TiledMLP.apply(mlp, self, x, shards, params)


def prepare(model, lora: bool, tiled: bool, offload: bool, liger: bool):
    """The model as the peer trains it (after from_pretrained): LoRA, liger, tiled MLP, checkpointing with offload."""
    import types

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_mistral

        apply_liger_kernel_to_mistral(rope=True, rms_norm=True, swiglu=False, cross_entropy=False,
                                      fused_linear_cross_entropy=False, model=model)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model.enable_input_require_grads()  # the offloaded checkpoint's backward runs only for inputs with gradients
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS,
                                                 task_type="CAUSAL_LM"))
    base = model.get_base_model() if lora else model
    for layer in base.model.layers:
        if tiled:
            layer.mlp.forward = types.MethodType(tiled_mlp_forward, layer.mlp)
        if offload:
            layer._gradient_checkpointing_func = offloaded_checkpoint
    return model, base


def loss_sum(base, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed next-token loss, targets) through TiledFusedLogitsLoss: logits in shards of about 1 GiB (fp32)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    hidden = base.model(input_ids=ids).last_hidden_state
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    shards = max(1, math.ceil(ids.numel() * base.config.vocab_size * 4 / 2**30))
    params = [p for p in base.lm_head.parameters() if p.requires_grad]

    def fn(lm_head, x, y):
        return torch.nn.functional.cross_entropy(lm_head(x).float(), y, ignore_index=-100, reduction="sum")

    total = TiledFusedLogitsLoss.apply(fn, base.lm_head, hidden, targets, None, shards, params, "sum")
    return total, int((targets != -100).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a saved Mistral-7B-shaped model folder")
    p.add_argument("--lora", action="store_true", help="LoRA r16 on all seven projections (else full fine-tuning)")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--attn", default="sdpa", help="core attention (flash_attention_2 where flash-attn is installed)")
    p.add_argument("--tiled-mlp", choices=("on", "off"), default="on")
    p.add_argument("--offload", choices=("on", "off"), default="on", help="checkpointed layer inputs in CPU memory")
    p.add_argument("--liger", choices=("on", "off"), default="on")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", type=int, default=1, help="steps left out of the averages (warm-up)")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = p.parse_args()

    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation=args.attn)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=args.attn, sequence_parallel_size=world,
        micro_batch_size=1, seq_length=args.seq, seq_length_is_variable=True)
    model, base = prepare(model, args.lora, args.tiled_mlp == "on", args.offload == "on", args.liger == "on")
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5, fused=True)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
              "gradient_clipping": 1.0, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    engine.train()  # from_pretrained leaves eval mode, where transformers checkpoints nothing
    g = torch.Generator().manual_seed(0)
    times, losses = [], []
    for _ in range(args.steps):
        ids = torch.randint(3, base.config.vocab_size, (1, args.seq), generator=g).to(engine.device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        total, targets = loss_sum(base, ids)
        engine.backward(total / targets)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(total.item() / targets)
        print(f"step {len(times)}/{args.steps} | loss {losses[-1]:.4f} | {args.seq / times[-1]:,.0f} tok/s | "
              f"mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        kept = times[args.skip:]
        step_time = sum(kept) / len(kept)
        with open(args.out, "w") as f:
            json.dump({"step_times": times, "losses": losses, "step_time_s": step_time,
                       "tokens_per_s_per_gpu": args.seq / step_time,
                       "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                       "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                       "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
