"""`zerotune chat`: talk with a trained model (run folder, exported HF folder or LoRA adapter), tokens streamed.

    zerotune chat runs/tiny --prompt "What does ZeRO stage 3 partition?"      # one-shot: prints only the answer

A run folder means its `export/`, else its newest checkpoint exported to a temporary folder. A LoRA adapter is
put on `--base` (default: the base recorded in adapter_config.json). Weights are loaded in the dtype they were saved
in (the training dtype), so greedy answers are those of the training engine's own sample. One process, CPU or one
GPU, no DeepSpeed engine; the prompt is the Mistral chat template of the whole conversation so far.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import struct
import sys
import tempfile
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from finetune.checkpoint import MARKER, STEP_DIR, find_latest
from finetune.config import ConfigError
from finetune.data.template import Message, encode_prompt
from finetune.data.tokenizer import load_tokenizer
from finetune.model import folder as model_folder
from finetune.model.generate import reply
from finetune.run import console
from finetune.run import folder as run_folder

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class ChatError(ValueError):
    """A path or option the user must fix; the message says how."""


@dataclass
class ChatModel:
    model: object
    tokenizer: object
    description: str  # what was loaded, for the banner


def saved_dtype(folder: str) -> torch.dtype:
    """The floating dtype of the first tensor in the folder's safetensors files (read from the header only)."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ChatError(f"{folder!r} has no *.safetensors weights (zerotune export writes them)")
    with open(files[0], "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return next((_DTYPES[d] for d in ("F32", "BF16", "F16") if d in dtypes), torch.float32)


def _resolve(path: str, workdir: str | None) -> str:
    """The HF or adapter folder behind `path` (a run folder's checkpoint is exported into `workdir`, or a new
    temporary folder that the caller owns)."""
    if not os.path.isdir(path):
        raise ChatError(f"{path!r} does not exist: give a run folder, an exported model folder or a LoRA adapter folder")
    if model_folder.is_exported(path):
        return path
    if os.path.isdir(run_folder.path(path, run_folder.EXPORT)):
        return _resolve(run_folder.path(path, run_folder.EXPORT), workdir)
    checkpoint = path if STEP_DIR.match(os.path.basename(os.path.normpath(path))) and \
        os.path.isfile(os.path.join(path, MARKER)) else find_latest(path)
    if checkpoint is None:
        raise ChatError(f"{path!r} is not a run folder with export/ or a complete checkpoint (checkpoints/step_*/{MARKER}), "
                        f"an HF model folder (config.json) or a LoRA adapter folder (adapter_config.json)")
    # lazy: finetune.export.weights imports deepspeed, which logs to stdout as it loads; by now main() sends stdout to stderr,
    # so a one-shot answer stays alone on stdout
    from finetune.export.weights import export_checkpoint

    print(f"exporting {checkpoint} to a temporary folder", file=sys.stderr)
    # Not merged: a LoRA checkpoint becomes base + adapter, computed as in training, rather than merged weights
    # rounded to bf16 (which change greedy answers).
    workdir = workdir or tempfile.mkdtemp(prefix="zerotune-chat-")
    try:
        return export_checkpoint(checkpoint, os.path.join(workdir, "model"), merge=False)
    except ConfigError as e:  # a checkpoint whose files do not match its manifest, named file by file
        raise ChatError(str(e)) from None


def _tokenizer(*folders: str):
    for folder in folders:
        try:
            return load_tokenizer(folder)
        except FileNotFoundError:
            continue
    raise ChatError(f"no tokenizer files in {' or '.join(map(repr, folders))} (expected tokenizer.model or tokenizer.json)")


def load_chat_model(path: str, base: str | None = None, device: str | None = None, workdir: str | None = None) -> ChatModel:
    """Load what `path` names, ready for `reply`; a checkpoint is exported into `workdir` (default: a new temporary
    folder), which must outlive the call."""
    hf_logging.disable_progress_bar()  # a chat prompt, not a loading bar, is what the user should see
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    folder = _resolve(path, workdir)
    adapter_file = os.path.join(folder, model_folder.ADAPTER_CONFIG)
    if not os.path.isfile(adapter_file):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=saved_dtype(folder))
        what = f"{folder} ({model.dtype})"
        tokenizer = _tokenizer(folder)
    else:
        from peft import PeftModel  # lazy: slow to import, and only a LoRA adapter needs it

        with open(adapter_file) as f:
            recorded = json.load(f).get("base_model_name_or_path")
        base = base or recorded
        if not base or not model_folder.has_config(base):
            raise ChatError(f"LoRA adapter {folder!r} needs its base model: {base or 'none recorded'!r} is not a model "
                            f"folder here; pass --base PATH_TO_BASE_MODEL")
        if not model_folder.has_weights(base):
            raise ChatError(f"the base model folder {base!r} has no weights (the run started from a random init): "
                            f"`zerotune export RUN_DIR --out DIR --merge` writes base and adapter as one model to chat with")
        dtype = saved_dtype(folder)  # training ran the base in the adapter's dtype
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        # peft would upcast bf16 adapters to fp32 by default; training computed them in bf16.
        model = PeftModel.from_pretrained(model, folder, autocast_adapter_dtype=False)
        what = f"LoRA adapter {folder} on {base} ({dtype})"
        tokenizer = _tokenizer(folder, base)
    model.to(device).eval()
    return ChatModel(model, tokenizer, f"{what} on {device}")


def _fit(messages: list[Message], tokenizer, limit: int) -> list[Message]:
    """Drop the oldest user/assistant exchanges (never the system prompt) until the prompt fits the context."""
    system = messages[:1] if messages and messages[0].role == "system" else []
    turns = messages[len(system):]
    while len(turns) > 1 and len(encode_prompt(system + turns, tokenizer)) > limit:
        turns = turns[2:]
    return system + turns


def _interactive(chat: ChatModel, args, system: list[Message]) -> None:
    config = getattr(chat.model, "config", None)
    limit = getattr(config, "max_position_embeddings", 1 << 30) - args.max_new_tokens
    messages = list(system)
    print(f"chat with {chat.description}\n/reset starts over, /exit or Ctrl-D quits, Ctrl-C stops an answer",
          file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            print()
            return
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            messages = list(system)
            continue
        if not text:
            continue
        messages = _fit(messages + [Message("user", text)], chat.tokenizer, limit)
        print("model> ", end="", flush=True)
        try:
            out = _generate(chat, messages, args, stream=True)
        except KeyboardInterrupt:
            out = ""
        print()
        if out:
            messages.append(Message("assistant", out))
        else:  # the template refuses an empty assistant turn, and an interrupted one is not what the model said
            messages.pop()
            print("(no answer: this turn is left out of the conversation)", file=sys.stderr)


def _generate(chat: ChatModel, messages: list[Message], args, stream: bool) -> str:
    sampling = args.temperature != 0 and (args.temperature is not None or args.top_p is not None)
    if sampling and args.seed is not None:
        torch.manual_seed(args.seed)
    show = (lambda s: print(s, end="", flush=True)) if stream else None
    return reply(chat.model, chat.tokenizer, messages, args.max_new_tokens, do_sample=sampling,
                 temperature=args.temperature or 1.0, top_p=args.top_p if args.top_p is not None else 1.0, on_text=show)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zerotune chat", description=__doc__.splitlines()[0])
    p.add_argument("path", help="a run folder, an exported HF model folder, or a LoRA adapter folder")
    p.add_argument("--base", default=None, help="base model folder of a LoRA adapter (default: the one it records)")
    p.add_argument("--prompt", default=None, help="answer this one message, print only the answer, and exit")
    p.add_argument("--system", default=None, help="system prompt put before the first message")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy; 0 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="sample from this top probability mass (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="seed of sampling, for repeatable samples")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    system = [Message("system", args.system)] if args.system else []
    with tempfile.TemporaryDirectory(prefix="zerotune-chat-") as workdir:
        try:
            # Libraries print while loading (DeepSpeed's logger writes to stdout): keep stdout for the answer.
            with contextlib.redirect_stdout(sys.stderr):
                chat = load_chat_model(args.path, args.base, args.device, workdir)
        except (ChatError, FileNotFoundError) as e:
            console.error(e)
            return 2
        if args.prompt is None:
            _interactive(chat, args, system)
            return 0
        _generate(chat, system + [Message("user", args.prompt)], args, stream=True)
        print()
    return 0
