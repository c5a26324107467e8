"""Greedy or sampled answers from a model with the Mistral chat template (the training sample and `zerotune chat`).

    text = answer(model, tokenizer, "What is ZeRO?", max_new_tokens=64)
    text = reply(model, tokenizer, [Message("user", "Hi")], on_text=lambda s: print(s, end="", flush=True))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from finetune.data.template import Message, encode_prompt


class _TextStreamer:
    """transformers' streamer protocol (put(ids), end()) for our Tokenizer: hands on_text each new piece of text.

    The reply is decoded whole each time and the new suffix emitted, because sentencepiece pieces (the "▁" space,
    byte-fallback bytes of one character) only decode right in context; a trailing U+FFFD is an unfinished
    character and waits for its next byte.
    """

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.ids: list[int] = []
        self.shown = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        self.ids += [i for i in value.reshape(-1).tolist() if i != self.tokenizer.eos_id]
        self._emit(final=False)

    def end(self) -> None:
        self._emit(final=True)

    def _emit(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return
        if len(text) > self.shown:
            self.on_text(text[self.shown:])
            self.shown = len(text)


@torch.no_grad()
def reply(model, tokenizer, messages: list[Message], max_new_tokens: int = 64, synced_gpus: bool = False,
          do_sample: bool = False, temperature: float = 0.7, top_p: float = 0.9,
          on_text: Callable[[str], None] | None = None) -> str:
    """The model's next assistant turn for a conversation ending with a user turn; `on_text` gets it as it is
    generated. Under ZeRO-3 with several ranks every rank must call this (synced_gpus)."""
    ids = encode_prompt(messages, tokenizer)
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
        streamer=_TextStreamer(tokenizer, on_text) if on_text else None,
        **sampling,
    )
    model.train(was_training)
    new = out[0, len(ids):].tolist()
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    return tokenizer.decode(new)


def answer(model, tokenizer, prompt: str, max_new_tokens: int = 64, synced_gpus: bool = False,
           do_sample: bool = False, temperature: float = 0.7, top_p: float = 0.9) -> str:
    """The model's reply to one user turn (the sample printed during training)."""
    return reply(model, tokenizer, [Message("user", prompt)], max_new_tokens, synced_gpus, do_sample, temperature, top_p)
