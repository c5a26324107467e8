"""Built-in dataset formats; importing this module registers them (registry.get_format does it for you).

    sample = get_format("sharegpt")({"conversations": [...]}, Encoder(tok))
"""

from __future__ import annotations

from finetune.data.registry import Encoder, RecordError, field, register
from finetune.data.template import Message, Sample


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


@register("messages", schema='{messages: [{role: system|user|assistant, content}]}')
def messages(record: dict, enc: Encoder) -> Sample:
    return enc.chat([Message(field(m, "role", str, "messages", at=f"messages[{i}]"),
                             field(m, "content", str, "messages", at=f"messages[{i}]"))
                     for i, m in enumerate(field(record, "messages", list, "messages"))])
