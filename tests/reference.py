"""The oracle: a plain-PyTorch, single-process training loop with no DeepSpeed and no zerotune training code.

Same init (the saved model folder, adapters seeded as documented), same data order (the global batches of
the loader), same AdamW settings, warm-up + cosine schedule, clipping and token-normalised loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def reference_losses(model_dir: str, recipe, steps: int, global_rows: int, tokenizer, data, evaluation=None,
                     eval_every: int = 0) -> dict[str, list[float]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.data.loader import StepLoader

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if recipe.lora.enabled:
        torch.manual_seed(recipe.model.init_seed + 1)
        model = get_peft_model(model, LoraConfig(r=recipe.lora.rank, lora_alpha=recipe.lora.alpha, lora_dropout=0.0,
                                                 target_modules=list(recipe.lora.target_modules), task_type="CAUSAL_LM"))
    model.train()
    o = recipe.optim
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not (p.ndim >= 2 and "norm" not in n)]
    groups = [g for g in ({"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    params = [p for g in groups for p in g["params"]]
    # One "rank" holding the whole global batch as one micro-batch: the same rows, in any grouping.
    loader = StepLoader(data, global_rows, 1, 1, 0, recipe.data.max_seq_len, recipe.data.packing, recipe.train.seed,
                        tokenizer.pad_id, shuffle=recipe.data.shuffle)
    losses, eval_losses = [], []
    for step in range(steps):
        if step < o.warmup_steps:
            scale = (step + 1) / o.warmup_steps
        else:
            progress = min(1.0, (step - o.warmup_steps) / max(1, recipe.train.max_steps - o.warmup_steps))
            scale = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = o.lr * scale
        (batch,) = loader.step(step)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        targets = batch["targets"].reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, ignore_index=-100, reduction="sum")
        loss = loss / (targets != -100).sum()
        loss.backward()
        if recipe.optim.grad_clip > 0:
            # The global norm summed in float64: torch's clip_grad_norm_ takes per-tensor float32 norms, ~1e-4
            # relative off on the 32,000-row embedding, which would make the oracle the least exact party.
            norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)).item()
            coef = recipe.optim.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if evaluation is not None and (step + 1) % eval_every == 0:
            eval_losses.append(_eval_loss(model, evaluation, recipe, tokenizer))
    return {"loss": losses, "eval_loss": eval_losses}


@torch.no_grad()
def _eval_loss(model, evaluation, recipe, tokenizer) -> float:
    from finetune.data.loader import collate

    model.eval()
    total, count = 0.0, 0
    for i in range(len(evaluation)):  # one sample at a time: no packing, no padding, nothing shared
        batch = collate([[i]], evaluation, tokenizer.pad_id)
        logits = model(input_ids=batch["input_ids"]).logits
        targets = batch["targets"].reshape(-1)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
    model.train()
    return total / count
