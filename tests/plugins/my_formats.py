"""A tiny out-of-tree dataset-format plugin, as a user would write one.

    data: {format: qa, plugins: [tests.plugins.my_formats]}
"""

from finetune.data.registry import Encoder, field, register
from finetune.data.template import Message, Sample


@register("qa", schema="{question, answer}")
def qa(record: dict, enc: Encoder) -> Sample:
    return enc.chat([Message("user", field(record, "question", str, "qa")),
                     Message("assistant", field(record, "answer", str, "qa"))])
