"""The exported tokenizer folder, loaded by transformers' AutoTokenizer, gives through `apply_chat_template` exactly the
ids zerotune trains on (every chat record shipped in recipes/data, through each chat format) and prompts with.

The folder is written by the export's own tokenizer writer (finetune/export/tokenizer.py, which export_module calls)
for the real Mistral-7B tokenizer; no model is trained. The integration half: tests/integration/test_export_run.py.
"""

import json
import os

import jinja2
import pytest
from transformers import AutoTokenizer

from finetune.data.registry import Encoder, get_format
from finetune.data.template import Message, encode_prompt
from finetune.data.tokenizer import builtin_tokenizer_dir, load_tokenizer
from finetune.export.tokenizer import write_tokenizer
from tests.helpers import ROOT

DATA = os.path.join(ROOT, "recipes", "data")


def _records(name: str) -> list[dict]:
    with open(os.path.join(DATA, name)) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """zerotune's tokenizer and the AutoTokenizer of a folder the export wrote from it."""
    tok = load_tokenizer("mistral-common")
    folder = write_tokenizer(tok, str(tmp_path_factory.mktemp("export")))
    return tok, AutoTokenizer.from_pretrained(folder), folder


def _hf_ids(hf, messages: list[dict], prompt: bool = False) -> list[int]:
    return hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt, return_dict=False)


def _conversations() -> list[list[dict]]:
    return [r["messages"] for r in _records("sample_chat.jsonl")]


def test_the_folder_loads_as_written(toks):
    _, hf, folder = toks
    assert sorted(os.listdir(folder)) == ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert "[INST]" in config["chat_template"] and config["eos_token"] == "</s>"
    assert hf("Hello").input_ids == [1, 22557]  # BOS added by a plain call, as for the Mistral-7B repo's tokenizer
    assert hf.decode(hf("  Hello  world\n x").input_ids, skip_special_tokens=True) == "  Hello  world\n x"


def test_messages_records_train_on_the_template_ids(toks):
    tok, hf, _ = toks
    conversations = _conversations()
    assert len(conversations) == 400
    assert any(c[0]["role"] == "system" for c in conversations) and any(len(c) > 4 for c in conversations)
    fmt = get_format("messages")
    for i, messages in enumerate(conversations):
        assert _hf_ids(hf, messages) == fmt({"messages": messages}, Encoder(tok)).input_ids, f"record {i}"


def test_sharegpt_and_interactions_records_train_on_the_template_ids(toks):
    """The same conversations in the other chat formats: sharegpt (system prompts too) and interactions (none)."""
    tok, hf, _ = toks
    sharegpt, interactions = get_format("sharegpt"), get_format("interactions")
    who = {"system": "system", "user": "human", "assistant": "gpt"}
    for i, messages in enumerate(_conversations()):
        expected = _hf_ids(hf, messages)
        record = {"conversations": [{"from": who[m["role"]], "value": m["content"]} for m in messages]}
        assert sharegpt(record, Encoder(tok)).input_ids == expected, f"record {i}"
        if messages[0]["role"] != "system":
            record = {"interactions": [{"is_user": m["role"] == "user", "text": m["content"]} for m in messages]}
            assert interactions(record, Encoder(tok)).input_ids == expected, f"record {i}"


def test_alpaca_records_train_on_the_template_ids(toks):
    tok, hf, _ = toks
    alpaca = get_format("alpaca")
    for i, r in enumerate(_records("tiny_instruct.jsonl")):
        user = r["instruction"] + ("\n\n" + r["input"] if r["input"] else "")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": r["output"]}]
        assert _hf_ids(hf, messages) == alpaca(r, Encoder(tok)).input_ids, f"record {i}"


def test_prompts_are_what_zerotune_generates_from(toks):
    """Every conversation cut after each user turn, with add_generation_prompt: the ids `zerotune chat` answers."""
    tok, hf, _ = toks
    for messages in _conversations()[:100]:
        for end in range(len(messages)):
            if messages[end]["role"] == "user":
                prefix = messages[: end + 1]
                ours = encode_prompt([Message(m["role"], m["content"]) for m in prefix], tok)
                assert _hf_ids(hf, prefix, prompt=True) == ours


def test_runs_of_spaces_and_indented_code_keep_their_ids(toks, tmp_path):
    """transformers' own conversion of tokenizer.model merges runs of spaces differently from sentencepiece; the
    exported tokenizer.json does not."""
    tok, hf, _ = toks
    code = "def f(x):\n    if x:\n        return  [x,\t x]\n" + "".join(f"{' ' * n}{n}\n" for n in range(1, 40))
    messages = [{"role": "system", "content": "  Indent   with spaces.  "},
                {"role": "user", "content": " Fix this:\n" + code},
                {"role": "assistant", "content": "   Here:\n\n" + code + "    "}]
    ours = get_format("messages")({"messages": messages}, Encoder(tok)).input_ids
    assert _hf_ids(hf, messages) == ours
    converted = AutoTokenizer.from_pretrained(builtin_tokenizer_dir(str(tmp_path)))  # tokenizer.model alone
    converted.chat_template = hf.chat_template
    assert _hf_ids(converted, messages) != ours


def test_roles_out_of_order_are_refused(toks):
    _, hf, _ = toks
    with pytest.raises(jinja2.TemplateError, match="alternate user/assistant"):
        hf.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
