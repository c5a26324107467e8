"""Tokenizer, Mistral template and dataset formats, checked against mistral_common as the oracle (CPU, no network)."""

import os
import random
import re

import pytest
import sentencepiece
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from finetune.data.registry import Encoder, RecordError, get_format, load_plugins, register
from finetune.data.template import IGNORE, Message, encode_chat, encode_prompt
from finetune.data.tokenizer import builtin_tokenizer_dir, load_tokenizer

MC_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"
MC_MODEL = str(MistralTokenizer._data_path() / "tokenizer.model.v1")
# Two oracles: "finetuning" mode accepts a conversation ending with an assistant turn,
# the default ("test") mode encodes a prompt ending with a user turn.
MC_TRAIN = MistralTokenizer.from_file(MC_MODEL, mode=ValidationMode.finetuning)
MC_PROMPT = MistralTokenizer.v1()
_MC_CLASS = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}

CONVERSATIONS = {
    "single": [("user", "Hello"), ("assistant", "Hi there!")],
    "single_system": [("system", "You are terse."), ("user", "What is 2+2?"), ("assistant", "4")],
    "multi": [("user", "Name a fruit."), ("assistant", "Apple."), ("user", "Another?"), ("assistant", "Pear.")],
    "multi_system": [("system", "Answer in French.\nAlways."), ("user", "Hello"), ("assistant", "Bonjour"),
                     ("user", "Thanks"), ("assistant", "De rien"), ("user", "Bye"), ("assistant", "Au revoir")],
    "whitespace": [("user", "  two  spaces\n\n\tand tab  "), ("assistant", "\n  indented\n    code  "),
                   ("user", "literal [INST] and <s> and </s>"), ("assistant", "héllo wörld 你好 🙂")],
}


def mc_tokens(conv):
    msgs = [_MC_CLASS[role](content=content) for role, content in conv]
    oracle = MC_TRAIN if conv[-1][0] == "assistant" else MC_PROMPT
    return oracle.encode_chat_completion(ChatCompletionRequest(messages=msgs)).tokens


def mc_labels(conv):
    """Expected labels from mistral_common alone: an assistant turn spans from the end of the
    prompt before it to the end of the conversation through it (its tokens plus EOS)."""
    full = mc_tokens(conv)
    labels = [IGNORE] * len(full)
    for k, (role, _) in enumerate(conv):
        if role == "assistant":
            start, through = len(mc_tokens(conv[:k])), mc_tokens(conv[:k + 1])
            assert full[:len(through)] == through  # the oracle itself is prefix-stable
            labels[start:len(through)] = through[start:]
    return labels


# Each chat format as a function conversation -> record; None where it cannot express it.
def _messages(conv):
    return {"messages": [{"role": r, "content": c} for r, c in conv]}


def _sharegpt(conv, names={"system": "system", "user": "human", "assistant": "gpt"}):
    return {"conversations": [{"from": names[r], "value": c} for r, c in conv]}


def _sharegpt_aliases(conv):
    return _sharegpt(conv, names={"system": "system", "user": "user", "assistant": "assistant"})


def _interactions(conv):
    if conv[0][0] == "system":
        return None
    return {"interactions": [{"is_user": r == "user", "text": c} for r, c in conv]}


def _instruction_output(conv):
    return None if len(conv) != 2 else {"instruction": conv[0][1], "output": conv[1][1]}


def _alpaca(conv):
    return None if len(conv) != 2 else {"instruction": conv[0][1], "input": "", "output": conv[1][1]}


FORMATS = {"messages": _messages, "sharegpt": _sharegpt, "sharegpt_aliases": _sharegpt_aliases,
           "interactions": _interactions, "instruction_output": _instruction_output, "alpaca": _alpaca}
CASES = [(f, c) for f in FORMATS for c in CONVERSATIONS if FORMATS[f](CONVERSATIONS[c]) is not None]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("mistral-common")


# --- template against mistral_common ---------------------------------------------------------

@pytest.mark.parametrize("fmt,conv_name", CASES)
def test_chat_formats_match_mistral_common(tok, fmt, conv_name):
    conv = CONVERSATIONS[conv_name]
    sample = get_format(fmt.replace("_aliases", ""))(FORMATS[fmt](conv), Encoder(tok))
    assert sample.input_ids == mc_tokens(conv)
    assert sample.labels == mc_labels(conv)


@pytest.mark.parametrize("conv_name", CONVERSATIONS)
def test_prompt_matches_mistral_common(tok, conv_name):
    conv = CONVERSATIONS[conv_name][:-1]
    assert encode_prompt([Message(r, c) for r, c in conv], tok) == mc_tokens(conv)


def test_alpaca_input_joins_instruction(tok):
    record = {"instruction": "Translate.", "input": "chat", "output": "cat"}
    conv = [("user", "Translate.\n\nchat"), ("assistant", "cat")]
    assert get_format("alpaca")(record, Encoder(tok)).input_ids == mc_tokens(conv)


def test_train_on_inputs_trains_all_but_bos(tok):
    conv = [Message(r, c) for r, c in CONVERSATIONS["multi_system"]]
    sample = encode_chat(conv, tok, train_on_inputs=True)
    assert sample.labels == [IGNORE] + sample.input_ids[1:]


def test_text_format_is_bos_text_eos(tok):
    sample = get_format("text")({"text": "Once upon a time"}, Encoder(tok))
    assert sample.input_ids == [tok.bos_id] + tok.encode("Once upon a time") + [tok.eos_id]
    assert sample.labels == [IGNORE] + sample.input_ids[1:]


@pytest.mark.parametrize("roles,match", [
    ([], "empty"),
    (["assistant"], "message 0 has role 'assistant' but 'user'"),
    (["user", "user", "assistant"], "message 1 has role 'user' but 'assistant'"),
    (["user", "assistant", "system", "user", "assistant"], "message 2 has role 'system'"),
    (["system", "user"], "must end with an assistant message for training"),
    (["user", "tool"], "unknown role 'tool'"),
])
def test_bad_role_order_raises(tok, roles, match):
    with pytest.raises(ValueError, match=match):
        encode_chat([Message(r, "x") for r in roles], tok)


def test_prompt_must_end_with_user(tok):
    with pytest.raises(ValueError, match="must end with a user"):
        encode_prompt([Message("user", "a"), Message("assistant", "b")], tok)


# --- tokenizer ------------------------------------------------------------------------------

def test_mistral_common_tokenizer(tok):
    assert tok.encode("[INST] Hello [/INST]") == [733, 16289, 28793, 22557, 733, 28748, 16289, 28793]
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 32000)
    assert tok.fingerprint() == MC_SHA256
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_encode_agrees_with_sentencepiece_on_whitespace(tok):
    sp = sentencepiece.SentencePieceProcessor(model_file=MC_MODEL)
    mc = MC_PROMPT.instruct_tokenizer.tokenizer
    pieces = [" ", "  ", "\n", "\n\n", "\t", " \n ", "a", "word", "é", "你", "[INST]", "<s>", "1", "  x  "]
    rng = random.Random(0)
    for _ in range(200):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert tok.encode(s) == sp.encode(s) == mc.encode(s, bos=False, eos=False), repr(s)


def test_builtin_dir_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    folder = builtin_tokenizer_dir(str(tmp_path / "tok"))
    hf = AutoTokenizer.from_pretrained(folder)
    assert len(hf) == 32000 and (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert hf.encode("[INST] Hello [/INST]", add_special_tokens=False) == [733, 16289, 28793, 22557, 733,
                                                                           28748, 16289, 28793]
    ours = load_tokenizer(folder)  # tokenizer.model present: sentencepiece, same file as mistral-common
    assert ours.fingerprint() == MC_SHA256 and ours.path == folder

    # Without tokenizer.model the wrapper falls back to AutoTokenizer.
    hf.save_pretrained(str(tmp_path / "hf"))
    if os.path.exists(tmp_path / "hf" / "tokenizer.model"):
        os.remove(tmp_path / "hf" / "tokenizer.model")
    fallback = load_tokenizer(str(tmp_path / "hf"))
    assert (fallback.bos_id, fallback.eos_id, fallback.pad_id, fallback.vocab_size) == (1, 2, 2, 32000)
    assert fallback.encode("Hello world") == ours.encode("Hello world")
    assert len(fallback.fingerprint()) == 64


def test_missing_tokenizer_folder_says_what_to_do(tmp_path):
    for path in (str(tmp_path / "nope"), str(tmp_path)):
        with pytest.raises(FileNotFoundError) as e:
            load_tokenizer(path)
        assert path in str(e.value) and "tokenizer.model" in str(e.value) and "model.tokenizer" in str(e.value)


# --- registry and plugins -------------------------------------------------------------------

def test_unknown_format_lists_known_ones():
    with pytest.raises(ValueError) as e:
        get_format("nope")
    listed = re.search(r"known formats: ([\w, ]+?) \(", str(e.value)).group(1).split(", ")
    assert listed == sorted(listed)
    assert {"text", "alpaca", "instruction_output", "interactions", "sharegpt", "messages"} <= set(listed)


def test_duplicate_registration_fails(monkeypatch):
    from finetune.data import registry

    # Registered into copies: other tests in this process list the known formats and must not see "_test_dup".
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    monkeypatch.setattr(registry, "_SCHEMAS", dict(registry._SCHEMAS))
    register("_test_dup")(lambda record, enc: None)
    with pytest.raises(ValueError, match="_test_dup.*already registered"):
        register("_test_dup")(lambda record, enc: None)
    with pytest.raises(ValueError, match="'alpaca' is already registered"):
        register("alpaca")(lambda record, enc: None)


def test_plugin_registers_a_usable_format(tok):
    load_plugins(["tests.fixtures.plugins.my_formats"])
    sample = get_format("qa")({"question": "Hello", "answer": "Hi there!"}, Encoder(tok))
    assert sample.input_ids == mc_tokens(CONVERSATIONS["single"])


def test_plugin_import_error_names_module_and_key():
    with pytest.raises(ImportError, match=r"'tests\.fixtures\.plugins\.does_not_exist'.*`data\.plugins`"):
        load_plugins(["tests.fixtures.plugins.does_not_exist"])


# --- record errors --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,record,message", [
    ("alpaca", {"instruction": "x"},
     "missing field 'output'; format 'alpaca' expects {instruction, input?, output}"),
    ("alpaca", {"instruction": "x", "output": 3},
     "field 'output' must be string, got integer; format 'alpaca' expects {instruction, input?, output}"),
    ("alpaca", {"instruction": "x", "output": None}, "field 'output' must be string, got null"),
    ("text", {"txt": "x"}, "missing field 'text'; format 'text' expects {text}"),
    ("messages", {"messages": "hi"}, "field 'messages' must be array, got string; format 'messages' expects"),
    ("interactions", {"interactions": [{"is_user": "yes", "text": "x"}]},
     "field 'interactions[0].is_user' must be boolean, got string"),
    ("sharegpt", {"conversations": [{"from": "bot", "value": "x"}]},
     "'conversations[0].from' is 'bot'; format 'sharegpt' accepts assistant, gpt, human, system, user"),
    ("sharegpt", {"conversations": [{"from": "human"}]}, "missing field 'conversations[0].value'"),
    ("messages", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
     "message 1 has role 'user' but 'assistant' was expected"),
])
def test_record_errors_name_field_and_format(tok, fmt, record, message):
    with pytest.raises(RecordError) as e:
        get_format(fmt)(record, Encoder(tok))
    assert message in str(e.value)
