"""Built-in dataset formats; importing this module registers them (registry.get_format does it for you).

    sample = get_format("sharegpt")({"conversations": [...]}, Encoder(tok))
    pair = get_format("preference")({"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."}, Encoder(tok))
"""

from __future__ import annotations

from typing import Any

from finetune.data.registry import Encoder, RecordError, field, register
from finetune.data.template import Message, Pair, Sample


@register("text", schema="{text}")
def text(record: dict, enc: Encoder) -> Sample:
    return enc.text(field(record, "text", str, "text"))


@register("alpaca", schema="{instruction, input?, output}")
def alpaca(record: dict, enc: Encoder) -> Sample:
    prompt = field(record, "instruction", str, "alpaca")
    extra = field(record, "input", str, "alpaca", default="")
    if extra:  # Alpaca leaves `input` empty for most records; then the instruction is the whole turn
        prompt = prompt + "\n\n" + extra
    return enc.chat([Message("user", prompt), Message("assistant", field(record, "output", str, "alpaca"))])


@register("instruction_output", schema="{instruction, output}")
def instruction_output(record: dict, enc: Encoder) -> Sample:
    return enc.chat([Message("user", field(record, "instruction", str, "instruction_output")),
                     Message("assistant", field(record, "output", str, "instruction_output"))])


@register("interactions", schema='{interactions: [{is_user, text}]}')
def interactions(record: dict, enc: Encoder) -> Sample:
    turns = field(record, "interactions", list, "interactions")
    return enc.chat([
        Message("user" if field(t, "is_user", bool, "interactions", at=f"interactions[{i}]") else "assistant",
                field(t, "text", str, "interactions", at=f"interactions[{i}]"))
        for i, t in enumerate(turns)])


_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@register("sharegpt", schema='{conversations: [{from: system|human|gpt, value}]}')
def sharegpt(record: dict, enc: Encoder) -> Sample:
    messages = []
    for i, turn in enumerate(field(record, "conversations", list, "sharegpt")):
        who = field(turn, "from", str, "sharegpt", at=f"conversations[{i}]")
        if who not in _SHAREGPT_ROLES:
            raise RecordError(f"field 'conversations[{i}].from' is {who!r}; format 'sharegpt' accepts "
                              f"{', '.join(sorted(_SHAREGPT_ROLES))}")
        messages.append(Message(_SHAREGPT_ROLES[who], field(turn, "value", str, "sharegpt", at=f"conversations[{i}]")))
    return enc.chat(messages)


def _message(m: Any, format_name: str, at: str) -> Message:
    """One OpenAI-style message {role, content}; `at` names it in errors (e.g. "messages[2]")."""
    return Message(field(m, "role", str, format_name, at=at), field(m, "content", str, format_name, at=at))


def _messages(items: list, format_name: str, at: str) -> list[Message]:
    return [_message(m, format_name, f"{at}[{i}]") for i, m in enumerate(items)]


@register("messages", schema='{messages: [{role: system|user|assistant, content}]}')
def messages(record: dict, enc: Encoder) -> Sample:
    return enc.chat(_messages(field(record, "messages", list, "messages"), "messages", "messages"))


# --- preference pairs -------------------------------------------------------------------------------------

_PREFERENCE = "preference"
_SIDES = ("chosen", "rejected")


@register(_PREFERENCE, schema="{prompt, chosen, rejected} (prompt: a string or [messages] ending with a user turn; "
                              "chosen, rejected: a string, a message {role, content} or [messages]), or "
                              "{chosen: [messages], rejected: [messages]} sharing the turns before the answers")
def preference(record: dict, enc: Encoder) -> Pair:
    if isinstance(record, dict) and "prompt" not in record and isinstance(record.get("chosen"), list):
        prompt, chosen, rejected = _shared_prompt(*(_messages(field(record, side, list, _PREFERENCE), _PREFERENCE, side)
                                                    for side in _SIDES))
    else:
        prompt = _prompt(record)
        chosen, rejected = (_response(record, side) for side in _SIDES)
        if chosen == rejected:
            raise RecordError("chosen and rejected are identical: a pair must differ")
    return enc.pair(prompt, chosen, rejected)


def _prompt(record: dict) -> list[Message]:
    value = record.get("prompt") if isinstance(record, dict) else None
    if isinstance(value, list):
        return _messages(value, _PREFERENCE, "prompt")
    return [Message("user", field(record, "prompt", str, _PREFERENCE))]  # field names what is wrong with it


def _response(record: dict, side: str) -> list[Message]:
    """The response turn(s) `side` of the prompt form: a string is one assistant turn."""
    value = record.get(side)
    if isinstance(value, list):
        turns, names = _messages(value, _PREFERENCE, side), [f"{side}[{i}].content" for i in range(len(value))]
        if not turns:
            raise RecordError(f"field {side!r} is empty: the {side} response needs at least one assistant turn")
    elif isinstance(value, dict):
        turns, names = [_message(value, _PREFERENCE, side)], [f"{side}.content"]
    else:
        turns, names = [Message("assistant", field(record, side, str, _PREFERENCE))], [side]
    if turns[0].role != "assistant":
        first = names[0].removesuffix(".content")
        raise RecordError(f"field '{first}.role' is {turns[0].role!r}: a response starts with an assistant turn")
    for turn, name in zip(turns, names):
        if turn.role == "assistant" and not turn.content:
            raise RecordError(f"field {name!r} is empty: the {side} response needs text")
    return turns


def _shared_prompt(chosen: list[Message], rejected: list[Message]
                   ) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen response, rejected response) of two whole conversations: the prompt is their common leading
    messages, which must end with a user turn; what follows in each is its response."""
    if chosen == rejected:
        raise RecordError("chosen and rejected are identical: a pair must differ")
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    for side, turns, other in (("chosen", chosen, "rejected"), ("rejected", rejected, "chosen")):
        if k == len(turns):
            raise RecordError(f"field {side!r} has an empty response: all its messages begin {other!r} too; the two "
                              f"conversations must differ in their last assistant turn(s)")
    if k == 0 or chosen[k - 1].role != "user":
        where = "share no prompt: their first messages differ" if k == 0 else \
            f"differ first at message {k}, which follows a {chosen[k - 1].role!r} turn"
        raise RecordError(f"chosen and rejected {where}; both conversations must start with the same messages, "
                          f"up to and including a user turn, and differ only in the assistant turn(s) after it")
    return chosen[:k], chosen[k:], rejected[k:]
