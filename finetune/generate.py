"""Greedy or sampled answers from a model with the Mistral chat template (quickstart sample, later `zerotune chat`).

    text = answer(model, tokenizer, "What is ZeRO?", max_new_tokens=64)
"""

from __future__ import annotations

import torch

from finetune.data.template import Message, encode_prompt


@torch.no_grad()
def answer(model, tokenizer, prompt: str, max_new_tokens: int = 64, synced_gpus: bool = False,
           do_sample: bool = False, temperature: float = 0.7, top_p: float = 0.9) -> str:
    """The model's reply to one user turn. Under ZeRO-3 with several ranks every rank must call this (synced_gpus)."""
    ids = encode_prompt([Message("user", prompt)], tokenizer)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    was_training = model.training
    model.eval()
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if do_sample else dict(do_sample=False)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        use_cache=True,
        synced_gpus=synced_gpus,
        **sampling,
    )
    model.train(was_training)
    new = out[0, len(ids):].tolist()
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    return tokenizer.decode(new)
