"""The Mistral instruct (v1) chat template, token for token what mistral_common's MistralTokenizer.v1() produces.

    sample = encode_chat([Message("user", "Hi"), Message("assistant", "Hello!")], tok)

Layout: <s>[INST] {system}\\n\\n{user 1} [/INST]{assistant 1}</s>[INST] {user 2} [/INST]{assistant 2}</s>...
Each "[INST] ... [/INST]" string and each assistant answer is encoded on its own (so each gets
sentencepiece's "▁" dummy prefix), exactly as mistral_common's InstructTokenizerV1 does.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.data.tokenizer import Tokenizer

IGNORE = -100  # label of a token that is not trained (the value torch's cross_entropy skips)
_ROLES = ("system", "user", "assistant")


@dataclass
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass
class Sample:
    """input_ids and labels of equal length; labels are NOT shifted (the collator shifts)."""

    input_ids: list[int]
    labels: list[int]  # labels[i] = input_ids[i] if token i is trained, else IGNORE


@dataclass
class Pair:
    """One preference pair: two complete sequences (BOS + prompt + response + EOS) with the same prompt tokens.

    Labels are IGNORE on the prompt of both, whatever data.train_on_inputs says: a preference objective compares the
    two responses, so only response tokens are targets (Encoder.pair builds them).
    """

    chosen: Sample
    rejected: Sample


def _split(messages: list[Message], for_training: bool) -> tuple[str, list[Message]]:
    """Check the role order and return (system prompt or "", the alternating user/assistant turns)."""
    if not messages:
        raise ValueError("conversation is empty")
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise ValueError(f"message {i} has unknown role {m.role!r}; expected one of {', '.join(_ROLES)}")
        if not isinstance(m.content, str):
            raise ValueError(f"message {i} ({m.role}) content must be a string, got {type(m.content).__name__}")
    system, turns = "", messages
    if messages[0].role == "system":
        system, turns = messages[0].content, messages[1:]
    offset = len(messages) - len(turns)
    for j, m in enumerate(turns):
        expected = "user" if j % 2 == 0 else "assistant"
        if m.role != expected:
            raise ValueError(f"message {offset + j} has role {m.role!r} but {expected!r} was expected: roles "
                             f"must alternate user/assistant after an optional leading system message")
        # mistral_common rejects an empty answer; training on a lone EOS would teach silence.
        if m.role == "assistant" and not m.content:
            raise ValueError(f"message {offset + j} (assistant) is empty")
    last, what = ("assistant", "an assistant message for training") if for_training else \
        ("user", "a user message to prompt for an answer")
    if not turns or turns[-1].role != last:
        raise ValueError(f"conversation must end with {what}, but it ends with {messages[-1].role!r}")
    return system, turns


def _user_tokens(content: str, system: str, tok: Tokenizer) -> list[int]:
    # mistral_common v1 prepends the (non-empty) system prompt to the FIRST user message only.
    if system:
        content = system + "\n\n" + content
    return tok.encode(f"[INST] {content} [/INST]")


def _encode(system: str, turns: list[Message], tok: Tokenizer, train_on_inputs: bool) -> Sample:
    ids, labels = [tok.bos_id], [IGNORE]
    for j, m in enumerate(turns):
        if m.role == "user":
            part = _user_tokens(m.content, system if j == 0 else "", tok)
            trained = train_on_inputs
        else:
            part = tok.encode(m.content) + [tok.eos_id]
            trained = True
        ids += part
        labels += part if trained else [IGNORE] * len(part)
    return Sample(input_ids=ids, labels=labels)


def encode_chat(messages: list[Message], tok: Tokenizer, train_on_inputs: bool = False) -> Sample:
    """Tokenize a conversation that ends with an assistant turn.

    Trained tokens: each assistant answer plus its EOS; with `train_on_inputs` also the
    [INST] ... [/INST] blocks. BOS is never trained (nothing precedes it to predict it).
    Raises ValueError on a bad role order (the caller adds file and record index).
    """
    return _encode(*_split(messages, for_training=True), tok, train_on_inputs)


def encode_prompt(messages: list[Message], tok: Tokenizer) -> list[int]:
    """Tokenize a conversation that ends with a user turn, up to right after the last [/INST] (for generation)."""
    return _encode(*_split(messages, for_training=False), tok, train_on_inputs=False).input_ids
