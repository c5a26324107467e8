"""Dataset formats by name: a plain dict from name to a function `(record, Encoder) -> Sample` (or `-> Pair` for
preference data: a format returns one kind for every record).

    fmt = get_format("alpaca"); sample = fmt({"instruction": "Hi", "output": "Hello"}, Encoder(tok))
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from finetune.data.template import IGNORE, Message, Pair, Sample, encode_chat, encode_prompt
from finetune.data.tokenizer import Tokenizer


class RecordError(ValueError):
    """A record does not match its format; the caller adds the file and record index."""


@dataclass
class Encoder:
    """What a format plugin gets: the tokenizer and the template, nothing about ranks, padding or samplers."""

    tok: Tokenizer
    train_on_inputs: bool = False

    def chat(self, messages: list[Message]) -> Sample:
        """Mistral-template a conversation ending with an assistant turn (see template.encode_chat)."""
        try:
            return encode_chat(messages, self.tok, self.train_on_inputs)
        except ValueError as e:  # a bad role order is the record's fault, like a missing field
            raise RecordError(str(e)) from e

    def pair(self, prompt: list[Message], chosen: list[Message], rejected: list[Message]) -> Pair:
        """A preference pair: prompt + chosen and prompt + rejected, each encoded as `chat` encodes it for SFT, with
        every prompt token's label IGNORE (train_on_inputs does not apply: only the responses are compared).

        `prompt` ends with a user turn; each response is the turn(s) after it, starting with an assistant turn. The
        template encodes each turn on its own, so a conversation's tokens begin with its prompt's tokens."""
        try:
            shared = len(encode_prompt(prompt, self.tok))
        except ValueError as e:
            raise RecordError(f"prompt: {e}") from e
        return Pair(self._response(prompt, chosen, shared, "chosen"),
                    self._response(prompt, rejected, shared, "rejected"))

    def _response(self, prompt: list[Message], response: list[Message], shared: int, side: str) -> Sample:
        try:
            sample = encode_chat(prompt + response, self.tok, train_on_inputs=False)
        except ValueError as e:
            raise RecordError(f"{side}: {e}") from e
        sample.labels[:shared] = [IGNORE] * shared
        return sample

    def text(self, text: str) -> Sample:
        """BOS + text + EOS for plain-text pretraining; every token but BOS is trained."""
        ids = [self.tok.bos_id] + self.tok.encode(text) + [self.tok.eos_id]
        return Sample(input_ids=ids, labels=[IGNORE] + ids[1:])


FormatFn = Callable[[dict, Encoder], Sample | Pair]
_FORMATS: dict[str, FormatFn] = {}
_SCHEMAS: dict[str, str] = {}  # name -> "{instruction, input?, output}", quoted by RecordError messages


def register(name: str, schema: str = "") -> Callable[[FormatFn], FormatFn]:
    """Decorator: `@register("alpaca", schema="{instruction, input?, output}")` adds a format."""

    def add(fn: FormatFn) -> FormatFn:
        if name in _FORMATS:
            raise ValueError(f"dataset format {name!r} is already registered (by {_FORMATS[name].__module__})")
        _FORMATS[name], _SCHEMAS[name] = fn, schema
        return fn

    return add


def known_formats() -> list[str]:
    """Sorted names of all registered formats, built-ins included."""
    return sorted(_FORMATS)


def get_format(name: str) -> FormatFn:
    """The format function registered as `name`; unknown names raise ValueError listing the known ones."""
    known = known_formats()
    if name not in _FORMATS:
        raise ValueError(f"unknown dataset format {name!r}; known formats: {', '.join(known)} "
                         f"(add your own with @register and list its module in `data.plugins`)")
    return _FORMATS[name]


def load_plugins(modules: list[str]) -> None:
    """Import each module so its @register calls run (the recipe's `data.plugins` list)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"cannot import dataset-format plugin module {module!r} listed in the recipe "
                              f"key `data.plugins`: {e}") from e


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object", type(None): "null"}


def _type_name(kind: type) -> str:
    return _JSON_TYPES.get(kind, kind.__name__)


_MISSING: Any = object()


def field(record: dict, name: str, kind: type, format_name: str, default: Any = _MISSING, at: str = "") -> Any:
    """record[name], checked to be a `kind`; if `default` is passed, a missing or null field gives it.

    `at` locates a nested record in messages, e.g. at="conversations[2]" for a turn of a conversation.
    """
    where = f"{at}.{name}" if at else name
    expects = f"; format {format_name!r} expects {_SCHEMAS.get(format_name) or 'other fields'}"
    if not isinstance(record, dict):
        raise RecordError(f"{at or 'record'} must be a JSON object, got {_type_name(type(record))}{expects}")
    value = record.get(name)
    if value is None and default is not _MISSING:
        return default
    if name not in record:
        raise RecordError(f"missing field {where!r}{expects}")
    # bool is a subclass of int in Python, but true/false is not a number in a dataset.
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise RecordError(f"field {where!r} must be {_type_name(kind)}, got {_type_name(type(value))}{expects}")
    return value
