"""The one tokenizer object zerotune tokenizes with: sentencepiece first, Hugging Face as fallback.

    tok = load_tokenizer("mistral-common"); ids = tok.encode("Hello")  # no BOS/EOS
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import sentencepiece

MISTRAL_COMMON = "mistral-common"
_SP_FILE = "tokenizer.model"
# Files a Hugging Face tokenizer folder may hold; all that exist go into the fingerprint.
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tekken.json")
_EXPECTED = (f"expected '{_SP_FILE}' (sentencepiece, as in the Mistral-7B repo) or 'tokenizer.json' / "
             f"'tokenizer_config.json' (Hugging Face); set `model.tokenizer` to a folder that has them, "
             f"or to '{MISTRAL_COMMON}' for the Mistral-7B v0.1 tokenizer shipped with mistral_common")


@dataclass
class Tokenizer:
    """Token ids of the special tokens plus encode/decode; build it with `load_tokenizer`."""

    bos_id: int
    eos_id: int
    pad_id: int
    vocab_size: int
    path: str  # the folder given to load_tokenizer, or "mistral-common"
    _backend: Any = field(repr=False)  # sentencepiece.SentencePieceProcessor or a transformers tokenizer
    _files: list[str] = field(repr=False)  # paths of the files the backend was built from

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without BOS/EOS (sentencepiece adds its "▁" dummy prefix, as sp.encode does)."""
        if isinstance(self._backend, sentencepiece.SentencePieceProcessor):
            return self._backend.encode(text)
        return self._backend.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special tokens (BOS/EOS) are dropped."""
        if isinstance(self._backend, sentencepiece.SentencePieceProcessor):
            return self._backend.decode(list(ids))
        return self._backend.decode(list(ids), skip_special_tokens=True)

    def fingerprint(self) -> str:
        """sha256 of the tokenizer files: for a lone tokenizer.model it equals `sha256sum tokenizer.model`."""
        if len(self._files) == 1:
            return _sha256(self._files[0])
        # Several files: hash a sha256sum-style manifest so names and contents both count.
        manifest = "".join(f"{_sha256(f)}  {os.path.basename(f)}\n" for f in sorted(self._files))
        return hashlib.sha256(manifest.encode()).hexdigest()

    def save(self, dest: str) -> str:
        """Copy the tokenizer files into `dest` (e.g. next to an exported checkpoint); returns `dest`."""
        if self.path == MISTRAL_COMMON:
            return builtin_tokenizer_dir(dest)
        os.makedirs(dest, exist_ok=True)
        for f in self._files:
            shutil.copyfile(f, os.path.join(dest, os.path.basename(f)))
        return dest


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _mistral_common_model() -> str:
    import mistral_common  # imported lazily: only this special path needs the wheel

    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"'{path}' is missing from the installed mistral_common; reinstall it")
    return path


def _from_sentencepiece(model_file: str, path: str) -> Tokenizer:
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    # Mistral's model has no pad piece (pad_id() == -1). Padded positions are masked out of
    # attention and loss, so any in-vocab id works; EOS is what HF generate() pads Mistral with,
    # and unlike unk (0) it can never be mistaken for a real token of the data.
    pad = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    return Tokenizer(bos_id=sp.bos_id(), eos_id=sp.eos_id(), pad_id=pad, vocab_size=sp.get_piece_size(),
                     path=path, _backend=sp, _files=[model_file])


def _from_hf(folder: str) -> Tokenizer:
    from transformers import AutoTokenizer  # lazy: it imports torch; the sentencepiece path stays without it

    hf = AutoTokenizer.from_pretrained(folder)
    if hf.bos_token_id is None or hf.eos_token_id is None:
        raise ValueError(f"tokenizer in '{folder}' has no BOS or EOS token; the Mistral template needs both")
    pad = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    files = [os.path.join(folder, f) for f in _HF_FILES if os.path.isfile(os.path.join(folder, f))]
    return Tokenizer(bos_id=hf.bos_token_id, eos_id=hf.eos_token_id, pad_id=pad, vocab_size=len(hf),
                     path=folder, _backend=hf, _files=files)


def load_tokenizer(path: str) -> Tokenizer:
    """Load the tokenizer in folder `path`, or the one inside mistral_common if `path == "mistral-common"`."""
    if path == MISTRAL_COMMON:
        return _from_sentencepiece(_mistral_common_model(), MISTRAL_COMMON)
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"tokenizer folder '{path}' {what}; {_EXPECTED}")
    # sentencepiece is the reference: the transformers-converted tokenizer differs on whitespace
    # runs and parses "<s>" inside text as a special token.
    if os.path.isfile(os.path.join(path, _SP_FILE)):
        return _from_sentencepiece(os.path.join(path, _SP_FILE), path)
    if any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return _from_hf(path)
    raise FileNotFoundError(f"no tokenizer files in '{path}'; {_EXPECTED}")


def builtin_tokenizer_dir(dest: str) -> str:
    """Write mistral_common's Mistral-7B v0.1 tokenizer to `dest` so AutoTokenizer.from_pretrained(dest) loads it."""
    os.makedirs(dest, exist_ok=True)
    shutil.copyfile(_mistral_common_model(), os.path.join(dest, _SP_FILE))
    # Mirrors the Mistral-7B-v0.1 repo's config; without it AutoTokenizer cannot pick a class,
    # and LlamaTokenizer(vocab_file=...) alone silently yields a 3-token vocabulary.
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": None, "add_bos_token": True, "add_eos_token": False,
              "legacy": False, "clean_up_tokenization_spaces": False, "model_max_length": 32768}
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dest
