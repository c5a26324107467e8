"""`zerotune export` on finished runs that kept no checkpoint (train.save_every=0): their final export/ is what there
is. A LoRA run's adapter merged into its base (`--merge`) gives the logits of base + adapter through peft; a full run
exports as it is and refuses `--merge`; a folder with neither says what it lacks. The loading snippet of the docs runs
on the merged export. A checkpoint's export, as its own process, prints zerotune's line only (DeepSpeed's loader
lines and the progress bars with --verbose) and refuses an --out folder that holds files unless --overwrite. The
template half: tests/unit/test_export_template.py; --out's other refusals: tests/unit/test_export_out.py."""

import contextlib
import io
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune import cli
from finetune.data.template import Message, encode_prompt
from finetune.data.tokenizer import load_tokenizer
from tests.helpers import (ROOT, SMALL_VOCAB, TINY_CONFIG, TINY_RECIPE, ds_variant, loopback_env, run_ranks,
                           save_tiny_model)

STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One LoRA run and one full run of the small-vocabulary tiny model, fp32, without checkpoints, side by side."""
    tmp = tmp_path_factory.mktemp("export_run")
    base = save_tiny_model(str(tmp / "base"))
    ds = ds_variant("zero2", str(tmp / "zero2_fp32.json"), bf16=False)
    common = ["--deepspeed", ds, "--config", TINY_RECIPE, f"model.path={base}", f"model.tokenizer={SMALL_VOCAB}",
              "model.activation_checkpointing=none", "data.max_seq_len=128", f"train.max_steps={STEPS}",
              "train.save_every=0", "train.sample_prompt=null", "train.log_every=100"]
    lora = common + ["lora.enabled=true", "lora.rank=8", "optim.lr=2e-2", f"train.output_dir={tmp / 'lora'}"]
    full = common + ["lora.enabled=false", "optim.lr=1e-3", f"train.output_dir={tmp / 'full'}"]
    with ThreadPoolExecutor(2) as pool:
        for job in [pool.submit(run_ranks, 1, "finetune/main.py", args, 600) for args in (lora, full)]:
            job.result()
    for run in ("lora", "full"):
        assert not os.path.exists(tmp / run / "checkpoints") and os.path.isdir(tmp / run / "export")
    return {"tmp": tmp, "base": base, "lora": str(tmp / "lora"), "full": str(tmp / "full")}


def export(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["export", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def merged(runs):
    """`zerotune export LORA_RUN --out merged --merge`: (its exit code, its stdout, the folder)."""
    out = str(runs["tmp"] / "merged")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli.main(["export", runs["lora"], "--out", out, "--merge"])
    return code, stdout.getvalue(), out


def test_merge_of_the_final_adapter_gives_base_plus_adapter(runs, merged):
    code, stdout, out = merged
    assert code == 0 and f"exported {out} from {os.path.join(runs['lora'], 'export')}" in stdout
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(runs["base"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, os.path.join(runs["lora"], "export")).eval()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, got = adapted(ids).logits, merged(ids).logits
        with adapted.disable_adapter():
            plain = adapted(ids).logits
    # fp32 rounding apart ((W + BA) x against W x + B (A x)), a thousandth of what the adapter moves them by
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)
    assert (plain - expected).abs().max() > 5e-2  # the adapter trained: merging it changes the model


def test_the_loading_snippet_runs_on_the_merged_export(merged):
    """The docs' snippet, as written there (RUN/export replaced by the merged folder): the chat template's prompt is
    the one zerotune generates from, and generate() answers."""
    folder = merged[2]
    # --- the snippet
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What does ZeRO stage 3 partition?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    # ---
    ours = encode_prompt([Message(m["role"], m["content"]) for m in messages], load_tokenizer(SMALL_VOCAB))
    assert inputs["input_ids"][0].tolist() == ours
    assert output.shape[1] > len(ours) and isinstance(answer, str)


def test_full_and_lora_runs_export_their_final_export(runs, capsys):
    for run, weights in (("full", "model.safetensors"), ("lora", "adapter_model.safetensors")):
        out = str(runs["tmp"] / f"copy_{run}")
        code, stdout, _ = export(capsys, runs[run], "--out", out)
        assert code == 0 and f"from {os.path.join(runs[run], 'export')}" in stdout
        src = os.path.join(runs[run], "export")
        assert sorted(os.listdir(out)) == sorted(os.listdir(src))
        with open(os.path.join(out, weights), "rb") as a, open(os.path.join(src, weights), "rb") as b:
            assert a.read() == b.read()
    assert AutoModelForCausalLM.from_pretrained(str(runs["tmp"] / "copy_full")).config.model_type == "mistral"


def test_merge_of_a_full_run_is_refused(runs, capsys, tmp_path):
    out = str(tmp_path / "never")
    code, _, err = export(capsys, runs["full"], "--out", out, "--merge")
    assert code == 2
    assert err == (f"zerotune: error: --merge: {os.path.join(runs['full'], 'export')!r} is a full fine-tune "
                   f"(lora.enabled=false): its weights are the whole model and there is no adapter to merge; export "
                   f"it without --merge\n")
    assert not os.path.exists(out)
    # a full run's checkpoint too (only its zerotune.json is read before the refusal)
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "zerotune.json").write_text(json.dumps({"step": 4, "recipe": {"lora": {"enabled": False}}, "ds_config": {}}))
    code, _, err = export(capsys, str(tmp_path / "run"), "--out", out, "--merge")
    assert code == 2 and f"--merge: {str(step)!r} is a full fine-tune" in err


def test_a_folder_with_neither_says_what_it_lacks(runs, capsys, tmp_path):
    empty = str(tmp_path / "empty")
    os.makedirs(os.path.join(empty, "checkpoints", ".tmp-step_00000002"))  # a save that never finished
    code, _, err = export(capsys, empty, "--out", str(tmp_path / "out"))
    assert code == 2
    assert err == (f"zerotune: error: {empty!r} has neither a complete checkpoint (checkpoints/step_*/zerotune.json) "
                   f"nor a final export (export/): a run writes export/ when it finishes (train.export=true) and "
                   f"checkpoints every train.save_every steps; give the folder of a finished run\n")
    assert "train.resume" not in err
    code, _, err = export(capsys, os.path.join(runs["lora"], "export"), "--out", str(tmp_path / "out"))
    assert code == 2 and "is already an exported model" in err and "give its run folder" in err
    code, _, err = export(capsys, runs["full"], "--out", str(tmp_path / "out"), "--step", "3")
    assert code == 2 and "--step 3:" in err and "(complete checkpoints: none)" in err


def test_merge_onto_a_random_init_base_is_refused(capsys, tmp_path):
    """A LoRA run on a config-only model (random init) has no base to rebuild outside the run: no guessed merge."""
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "adapter_config.json").write_text("{}")
    (run / "recipe.yaml").write_text(f"model:\n  path: {os.path.dirname(TINY_CONFIG)}\nlora:\n  enabled: true\n")
    (run / "ds_config.json").write_text("{}")
    code, _, err = export(capsys, str(run), "--out", str(tmp_path / "out"), "--merge")
    assert code == 2 and "has no weights (it was a random init)" in err and "train.save_every > 0" in err


@pytest.fixture(scope="module")
def checkpointed(runs):
    """A ZeRO-3 full run that kept its checkpoint of step 2 (and wrote no export)."""
    tmp = runs["tmp"]
    ds = ds_variant("zero3", str(tmp / "zero3_fp32.json"), bf16=False)
    run_ranks(1, "finetune/main.py", ["--deepspeed", ds, "--config", TINY_RECIPE, f"model.path={runs['base']}",
                                      f"model.tokenizer={SMALL_VOCAB}", "model.activation_checkpointing=none",
                                      "data.max_seq_len=128", "train.max_steps=2", "train.save_every=2",
                                      "train.sample_prompt=null", "train.log_every=100", "train.export=false",
                                      "lora.enabled=false", f"train.output_dir={tmp / 'checkpointed'}"], 600)
    return str(tmp / "checkpointed")


def export_process(*args: str) -> subprocess.CompletedProcess:
    """`zerotune export ARGS` as a user runs it: its own process, every line it prints on either stream."""
    return subprocess.run([sys.executable, "-m", "finetune.cli", "export", *args], cwd=ROOT, env=loopback_env(),
                          capture_output=True, text=True, timeout=300)


def test_a_checkpoints_export_prints_only_zerotunes_line(checkpointed, tmp_path):
    step = os.path.join(checkpointed, "checkpoints", "step_00000002")
    quiet = export_process(checkpointed, "--out", str(tmp_path / "quiet"))
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert (quiet.stdout, quiet.stderr) == (f"exported {tmp_path / 'quiet'} from {step}\n", "")
    # what it held back: DeepSpeed's checkpoint lines (standard output) and the loaders' progress bars
    loud = export_process(checkpointed, "--out", str(tmp_path / "loud"), "--verbose")
    assert loud.returncode == 0, loud.stdout + loud.stderr
    assert "Processing zero checkpoint" in loud.stdout and "Gathering sharded weights" in loud.stderr
    assert loud.stdout.endswith(f"exported {tmp_path / 'loud'} from {step}\n")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "quiet" / name).read_bytes() == (tmp_path / "loud" / name).read_bytes()


def test_a_checkpoints_export_refuses_a_folder_with_files_unless_overwrite(checkpointed, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    code, stdout, stderr = export(capsys, checkpointed, "--out", str(out))  # in this process: the output is not the subject
    assert code == 2 and stdout == ""
    assert stderr == (f"zerotune: error: --out {str(out)!r} is not empty (it holds notes.txt): choose another "
                      f"folder, or pass --overwrite to replace it (its files stay until the new export is complete)\n")
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "my notes"
    code, stdout, stderr = export(capsys, checkpointed, "--out", str(out), "--overwrite")
    assert code == 0, stdout + stderr
    assert "notes.txt" not in os.listdir(out) and (out / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["mine"]
