"""`zerotune chat` gives the training engine's own greedy sample (samples.jsonl) on a run folder, its checkpoint, its
export and a LoRA adapter on its base; streams what it returns; keeps the conversation in interactive mode."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from finetune.commands import chat
from finetune.data.template import Message
from finetune.model.generate import answer, reply
from tests.helpers import TINY_CONFIG, ROOT, TINY_RECIPE, ds_variant, loopback_env, run_ranks, save_tiny_model

PROMPT = "What does ZeRO stage 3 partition?"
TOKENS = 24


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full fine-tune of the tiny recipe (trained enough to answer in words) and a LoRA run on a saved tiny model,
    trained side by side; both write samples.jsonl and export/."""
    tmp = tmp_path_factory.mktemp("chat")
    base = save_tiny_model(str(tmp / "base"), config_dir=os.path.dirname(TINY_CONFIG))
    # fp32: CPUs with and without native bf16 round bf16 differently, and the answers compared below are exact text
    zero2_fp32 = ds_variant("zero2", str(tmp / "zero2_fp32.json"), bf16=False)
    common = ["--deepspeed", zero2_fp32, "--config", TINY_RECIPE, f"train.sample_prompt={PROMPT}",
              f"train.sample_max_new_tokens={TOKENS}", "train.micro_batch_size=2"]
    full = common + ["train.max_steps=30", "train.save_every=30", f"train.output_dir={tmp / 'full'}"]
    lora = common + ["train.max_steps=8", "train.save_every=8", "data.max_seq_len=128", "lora.enabled=true",
                     f"model.path={base}", f"train.output_dir={tmp / 'lora'}"]
    with ThreadPoolExecutor(2) as pool:
        # a hang guard, not a speed test
        for job in [pool.submit(run_ranks, 1, "finetune/main.py", args, 900) for args in (full, lora)]:
            job.result()
    samples = lambda run: [json.loads(line)["answer"] for line in (tmp / run / "samples.jsonl").read_text().splitlines()]
    (untrained, full), (_, lora) = samples("full"), samples("lora")
    assert full != untrained and len(full.split()) >= 5, full  # trained weights, answering in several words
    return {"full": tmp / "full", "lora": tmp / "lora", "base": base, "full_answer": full, "lora_answer": lora}


def one_shot(capsys, *args) -> str:
    # The engine's samples come from CPU ranks (the integration tier is CPU-only): the same device here, GPU or not.
    assert chat.main([*args, "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--device", "cpu"]) == 0
    return capsys.readouterr().out


def test_run_folder_checkpoint_gives_the_engine_sample(runs, tmp_path):
    """The real command on a run folder that has only its checkpoint (exported on the fly); stdout is the answer alone."""
    os.symlink(runs["full"] / "checkpoints", tmp_path / "checkpoints")
    cmd = [sys.executable, "-m", "finetune.cli", "chat", str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", str(TOKENS)]
    proc = subprocess.run(cmd, cwd=ROOT, env=loopback_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == runs["full_answer"] + "\n"
    assert "exporting" in proc.stderr


def test_run_folder_and_export_give_the_engine_sample(runs, capsys):
    assert one_shot(capsys, str(runs["full"])) == runs["full_answer"] + "\n"  # picks export/
    assert one_shot(capsys, str(runs["full"] / "export")) == runs["full_answer"] + "\n"


def test_lora_adapter_on_its_base_gives_the_engine_sample(runs, capsys, tmp_path):
    adapter = str(runs["lora"] / "export")
    assert os.path.isfile(os.path.join(adapter, "adapter_config.json"))
    assert one_shot(capsys, adapter, "--base", runs["base"]) == runs["lora_answer"] + "\n"
    assert one_shot(capsys, adapter) == runs["lora_answer"] + "\n"  # the base recorded in adapter_config.json
    os.symlink(runs["lora"] / "checkpoints", tmp_path / "checkpoints")  # a LoRA run folder with only its checkpoint
    assert one_shot(capsys, str(tmp_path)) == runs["lora_answer"] + "\n"
    # ... and the adapter is what makes that answer: the base alone says something else.
    loaded = chat.load_chat_model(adapter, device="cpu")
    with loaded.model.disable_adapter():
        assert answer(loaded.model, loaded.tokenizer, PROMPT, TOKENS) != runs["lora_answer"]


def test_streamed_text_is_the_answer(runs):
    loaded = chat.load_chat_model(str(runs["full"]), device="cpu")
    pieces = []
    text = reply(loaded.model, loaded.tokenizer, [Message("user", PROMPT)], TOKENS, on_text=pieces.append)
    assert text == runs["full_answer"] and "".join(pieces) == text and len(pieces) > 3


def test_interactive_keeps_the_conversation(runs, monkeypatch, capsys):
    follow_up = "And ZeRO stage 1?"
    lines = iter([PROMPT, follow_up, "/reset", PROMPT, "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert chat.main([str(runs["full"]), "--max-new-tokens", str(TOKENS), "--device", "cpu"]) == 0
    shown = capsys.readouterr().out.split("model> ")[1:]
    loaded = chat.load_chat_model(str(runs["full"]), device="cpu")
    second = reply(loaded.model, loaded.tokenizer, [Message("user", PROMPT), Message("assistant", runs["full_answer"]),
                                                    Message("user", follow_up)], TOKENS)
    assert [s.strip("\n") for s in shown] == [runs["full_answer"], second, runs["full_answer"]]


def test_sampling_is_repeatable_with_a_seed(runs, capsys):
    args = [str(runs["full"]), "--temperature", "1.5", "--top-p", "0.95", "--seed", "3"]
    first, again = one_shot(capsys, *args), one_shot(capsys, *args)
    assert first == again and first.strip()


def test_clear_errors(tmp_path, runs, capsys):
    (tmp_path / "empty").mkdir()
    assert chat.main([str(tmp_path / "empty"), "--prompt", "hi"]) == 2
    assert "is not a run folder with export/ or a complete checkpoint" in capsys.readouterr().err
    assert chat.main([str(runs["lora"] / "export"), "--base", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert "pass --base PATH_TO_BASE_MODEL" in capsys.readouterr().err
    assert chat.main([str(runs["lora"] / "export"), "--base", os.path.join(ROOT, "recipes", "tiny_model"), "--prompt", "hi"]) == 2
    assert "has no weights (the run started from a random init)" in capsys.readouterr().err
