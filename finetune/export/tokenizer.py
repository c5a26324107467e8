"""The tokenizer files of an export, so that the ecosystem's own tools give the token ids zerotune trained on.

    write_tokenizer(tokenizer, "runs/x/export")   # export_module calls it beside the weights

`AutoTokenizer.from_pretrained(export).apply_chat_template(messages)` then equals finetune/data/template.py's
`encode_chat` (a conversation ending with an answer) and `encode_prompt` (ending with a question), token for token.

A sentencepiece tokenizer (tokenizer.model, e.g. Mistral-7B's) gets a `tokenizer.json` built from its own pieces that
tokenizes as sentencepiece does: transformers' converted Llama tokenizer merges runs of spaces differently and drops
the dummy "▁" after a special token, so a prompt of indented code would reach the model as ids it never trained on.
Each "[INST] ... [/INST]" block and each answer is encoded on its own in zerotune; in the rendered template they are
one text between the special tokens, and the pre-tokenizer below splits words where sentencepiece does, so the ids
agree. One difference stays: Hugging Face reads a literal "<s>" or "</s>" inside a message as the special token,
where sentencepiece (and so zerotune's training data) reads the characters. A Hugging Face tokenizer folder (no
tokenizer.model) keeps its own files and gets the template; its ids agree where that tokenizer encodes the rendered
text as zerotune encodes its parts.
"""

from __future__ import annotations

import json
import os

from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HfTokenizer
from tokenizers.models import BPE

from finetune.data.tokenizer import Tokenizer

SP_FILE = "tokenizer.model"
CONFIG_FILE = "tokenizer_config.json"

# zerotune's Mistral instruct (v1) layout (finetune/data/template.py): BOS, then per exchange
# "[INST] {system}\n\n{user} [/INST]" (the system prompt only in the first), " {answer}" and EOS. The space before an
# answer stands for the "▁" sentencepiece prefixes to the answer, which zerotune encodes on its own.
# add_generation_prompt needs nothing: a prompt ends right after "[/INST]", where the answer starts.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in turns %}"
    "{%- if message['role'] != ('user' if loop.index0 % 2 == 0 else 'assistant') %}"
    "{{- raise_exception('roles must alternate user/assistant after an optional leading system message') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system %}{{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def write_tokenizer(tokenizer: Tokenizer, dest: str) -> str:
    """Copy the tokenizer into `dest` and add what AutoTokenizer needs: tokenizer.json (sentencepiece tokenizers) and
    the chat template in tokenizer_config.json; returns `dest`."""
    tokenizer.save(dest)
    config_path = os.path.join(dest, CONFIG_FILE)
    sp_file = os.path.join(dest, SP_FILE)
    if os.path.isfile(sp_file):
        config = _sentencepiece_files(sp_file, dest)
    else:  # a Hugging Face tokenizer folder: its own files stay; the template joins its config
        config = {}
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return dest


def _sentencepiece_files(sp_file: str, dest: str) -> dict:
    """Write tokenizer.json beside `sp_file`; returns the tokenizer_config.json that loads it as written."""
    model = _load_model(sp_file)
    spec = model.trainer_spec
    pieces = {p.piece: i for i, p in enumerate(model.pieces)}
    special = [model.pieces[i].piece for i in (spec.unk_id, spec.bos_id, spec.eos_id)]
    config = {"bos_token": special[1], "eos_token": special[2], "unk_token": special[0], "pad_token": None,
              "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": 32768}
    if _unlike_mistral(model):
        # A tokenizer.json built here would not follow this model's rules: transformers converts tokenizer.model
        # itself (close to, not always equal to, sentencepiece).
        return {"tokenizer_class": "LlamaTokenizer", "legacy": False, **config}
    _hf_tokenizer(model, pieces, special).save(os.path.join(dest, "tokenizer.json"))
    # PreTrainedTokenizerFast loads tokenizer.json as written; LlamaTokenizer would rebuild its own pre-tokenizer.
    return {"tokenizer_class": "PreTrainedTokenizerFast", **config}


def _load_model(sp_file: str):
    model = sentencepiece_model_pb2.ModelProto()
    with open(sp_file, "rb") as f:
        model.ParseFromString(f.read())
    return model


def _unlike_mistral(model) -> bool:
    """True when the model follows rules the tokenizer.json below does not reproduce (a non-BPE model, a text
    normalizer, whitespace as a suffix, user-defined pieces: none of them in Mistral's tokenizers)."""
    spec, norm = model.trainer_spec, model.normalizer_spec
    user_defined = any(p.type == p.USER_DEFINED for p in model.pieces)
    return (spec.model_type != spec.BPE or not spec.byte_fallback or not spec.split_by_whitespace
            or spec.treat_whitespace_as_suffix or user_defined
            or norm.name != "identity" or not norm.add_dummy_prefix or norm.remove_extra_whitespaces)


def _merges(model, pieces: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges in sentencepiece's order: a higher-scored piece is merged first (as transformers' converter orders
    them)."""
    found = []
    for p in model.pieces:
        if p.type != p.NORMAL:
            continue
        pairs = [(p.piece[:i], p.piece[i:], p.score) for i in range(1, len(p.piece))]
        found += sorted((m for m in pairs if m[0] in pieces and m[1] in pieces), key=lambda m: (pieces[m[0]], pieces[m[1]]))
    # A stable sort: pieces of equal score (the all-space ones) keep the order above.
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _words(model, pieces: dict[str, int]) -> str:
    """A regex of sentencepiece's words (the spans BPE merges within)."""
    if not model.trainer_spec.allow_whitespace_only_pieces:
        return "▁[^▁]*|[^▁]+"  # each "▁" starts a word
    # A run of "▁" with the characters up to the next "▁". Spaces merge last (their pieces score lowest) and from
    # the left, so a run longer than the longest all-space piece splits off such pieces first.
    longest = max(len(p) for p in pieces if set(p) == {"▁"})
    return f"▁{{{longest}}}(?=▁)|▁+[^▁]*|[^▁]+"


def _hf_tokenizer(model, pieces: dict[str, int], special: list[str]):
    tok = HfTokenizer(BPE(vocab=pieces, merges=_merges(model, pieces), unk_token=special[0], fuse_unk=True,
                          byte_fallback=True))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    # sentencepiece's dummy prefix and space symbol, on every text between special tokens (as zerotune encodes each
    # [INST] block and each answer on its own).
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_words(model, pieces)), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bos = special[1]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, pieces[bos])])
    return tok
