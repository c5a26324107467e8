"""Exact resume and verified export, on 2 ranks with real engines (CPU, gloo, loopback).

- 8 steps straight vs 4 steps, stop, resume to 8: steps 5-8 bit-identical (ZeRO-2/3, LoRA/full, fp32/bf16).
- The export of a ZeRO-3 run (HF folder for full, adapter and merged model for LoRA, in-training and offline
  `zerotune export`) reproduces the engine's logits on a fixed prompt.
- A half-written checkpoint is never resumed from; an unwritable output dir fails before the first step."""

import json
import os
import pytest
import torch
from finetune import checkpoint
from finetune.config import ConfigError
from tests.helpers import SMALL_VOCAB, ROOT, TINY_RECIPE, ds_variant, run_ranks, save_tiny_model


CASES = [(stage, lora, bf16) for stage in (2, 3) for lora in (False, True) for bf16 in (False, True)]


RESHARD_STAGES = (1, 2)  # ZeRO-3 on another world size is refused with a message (test below)
STEPS, HALF = 8, 4  # the straight runs' steps; the interrupted runs stop (and save) after HALF, then resume


def name(stage, lora, bf16):
    return f"zero{stage}-{'lora' if lora else 'full'}-{'bf16' if bf16 else 'fp32'}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    model_dir = save_tiny_model(str(tmp / "model"))
    cases = []
    for stage, lora, bf16 in CASES:
        ds = ds_variant(f"zero{stage}", str(tmp / f"z{stage}-{bf16}.json"), bf16=bf16)
        common = [f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", f"lora.enabled={str(lora).lower()}",
                  "lora.dropout=0.1", "lora.rank=8", "data.max_seq_len=128", "optim.lr=1e-3", "optim.warmup_steps=3",
                  f"train.max_steps={STEPS}", "train.micro_batch_size=1", "train.grad_accum=2", "train.sample_prompt=null",
                  "train.log_every=100"]
        n = name(stage, lora, bf16)
        straight, halves = str(tmp / n / "straight"), str(tmp / n / "halves")
        cases += [
            {"name": f"{n}/straight", "kind": "straight", "deepspeed": ds, "overrides": common + [f"train.output_dir={straight}"]},
            {"name": f"{n}/stop", "kind": "stop", "deepspeed": ds,
             "overrides": common + [f"train.output_dir={halves}", f"train.save_every={HALF}", f"train.stop_at={HALF}"]},
            {"name": f"{n}/resume", "kind": "resume", "deepspeed": ds,
             "overrides": common + [f"train.output_dir={halves}", f"train.save_every={HALF}", "train.resume=auto"]},
        ]
    # Another world size: 2 ranks x accumulation 2 <-> 1 rank x accumulation 4 (the same global batch).
    reshard = {1: [], 2: [], 3: []}  # launch order: 2 ranks, then 1 rank, then 2 ranks again
    for stage in RESHARD_STAGES:
        ds = ds_variant(f"zero{stage}", str(tmp / f"z{stage}-False.json"), bf16=False)
        n = name(stage, False, False)
        common = [f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", "lora.enabled=false", "data.max_seq_len=128",
                  "optim.lr=1e-3", "optim.warmup_steps=3", f"train.max_steps={STEPS}", "train.micro_batch_size=1",
                  "train.sample_prompt=null", "train.log_every=100", f"train.save_every={HALF}", "train.export=false"]
        to1, to2 = str(tmp / n / "w2to1"), str(tmp / n / "w1to2")
        reshard[1].append({"name": f"{n}/2to1-stop", "kind": "stop", "deepspeed": ds,
                           "overrides": common + ["train.grad_accum=2", f"train.output_dir={to1}", f"train.stop_at={HALF}"]})
        reshard[2] += [{"name": f"{n}/2to1-resume", "kind": "resume", "deepspeed": ds,
                        "overrides": common + ["train.grad_accum=4", f"train.output_dir={to1}", "train.resume=auto"]},
                       {"name": f"{n}/1to2-stop", "kind": "stop", "deepspeed": ds,
                        "overrides": common + ["train.grad_accum=4", f"train.output_dir={to2}", f"train.stop_at={HALF}"]}]
        reshard[3].append({"name": f"{n}/1to2-resume", "kind": "resume", "deepspeed": ds,
                           "overrides": common + ["train.grad_accum=2", f"train.output_dir={to2}", "train.resume=auto"]})
    losses = {}
    driver = os.path.join(ROOT, "tests", "drivers", "resume_driver.py")
    for launch, (world, batch) in enumerate([(2, cases + reshard[1]), (1, reshard[2]), (2, reshard[3])]):
        (tmp / f"cases{launch}.json").write_text(json.dumps(batch))
        run_ranks(world, driver, [str(tmp / f"out{launch}.json"), str(tmp / f"cases{launch}.json")], timeout=2400)
        losses.update(json.loads((tmp / f"out{launch}.json").read_text()))
    return tmp, losses


@pytest.mark.parametrize("stage, lora, bf16", CASES, ids=[name(*c) for c in CASES])
def test_resume_continues_the_same_loss_curve(runs, stage, lora, bf16):
    tmp, losses = runs
    n = name(stage, lora, bf16)
    straight, first, second = losses[f"{n}/straight"], losses[f"{n}/stop"], losses[f"{n}/resume"]
    assert len(straight) == STEPS and len(first) == HALF and len(second) == STEPS - HALF
    assert first == straight[:HALF]
    assert second == straight[HALF:], "the resumed steps must be bit-identical to the uninterrupted run's"
    metrics = [json.loads(line) for line in open(tmp / n / "halves" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    kept = [s for s, _ in checkpoint.complete_checkpoints(str(tmp / n / "halves"))]
    assert kept == [HALF, STEPS]


@pytest.mark.parametrize("stage", RESHARD_STAGES)
@pytest.mark.parametrize("direction", ["2to1", "1to2"])
def test_resume_on_another_world_size(runs, stage, direction):
    """The same samples in the same order, and a loss curve equal to the uninterrupted run within 1e-4 (fp32:
    micro-batch shapes change with the world size, so float roundings do)."""
    _, losses = runs
    n = name(stage, False, False)
    straight = losses[f"{name(2, False, False)}/straight"]  # ZeRO-1 and ZeRO-2 give the same losses (test_parity)
    assert losses[f"{n}/{direction}-stop"] == pytest.approx(straight[:HALF], abs=1e-5, rel=0)
    assert losses[f"{n}/{direction}-resume"] == pytest.approx(straight[HALF:], abs=1e-4, rel=0)


def test_zero3_checkpoint_on_another_world_size_is_refused(runs):
    from finetune.train import prepare

    tmp, _ = runs
    run = tmp / name(3, False, False) / "halves"  # saved by 2 ranks; this process is 1 rank
    with pytest.raises(ConfigError, match="saved by 2 rank.s. under ZeRO-3; resume it on that many ranks"):
        prepare(TINY_RECIPE, str(tmp / "z3-False.json"), [f"model.path={tmp / 'model'}", f"train.output_dir={run}",
                                                          "train.resume=auto"])


def _prompt():
    from tests.drivers.resume_driver import PROMPT_IDS

    return torch.tensor([PROMPT_IDS])


def _tolerance(bf16):
    return dict(atol=1e-5, rtol=0) if not bf16 else dict(atol=2e-2, rtol=0)  # bf16: identical weights, kernels may differ


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_full_export_gives_the_engines_logits(runs, bf16):
    from transformers import AutoModelForCausalLM

    tmp, _ = runs
    run = tmp / name(3, False, bf16) / "straight"
    want = torch.load(run / "engine_logits.pt")
    export = run / "export"
    assert (export / "config.json").exists() and (export / "tokenizer.model").exists()
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16 if bf16 else torch.float32)
    assert next(model.parameters()).dtype == (torch.bfloat16 if bf16 else torch.float32)
    with torch.no_grad():
        got = model(input_ids=_prompt()).logits.float()
    torch.testing.assert_close(got, want, **_tolerance(bf16))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_lora_adapter_and_merged_exports_give_the_engines_logits(runs, bf16):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, _ = runs
    run = tmp / name(3, True, bf16) / "straight"
    dtype = torch.bfloat16 if bf16 else torch.float32
    want = torch.load(run / "engine_logits.pt")
    assert sorted(os.listdir(run / "export")) >= ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=dtype)
    with_adapter = PeftModel.from_pretrained(base, run / "export").eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=dtype).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=_prompt()).logits.float(), want, **_tolerance(bf16))
        torch.testing.assert_close(merged(input_ids=_prompt()).logits.float(), want, **_tolerance(bf16))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_offline_export_of_a_checkpoint(runs, tmp_path, lora):
    """`zerotune export RUN_DIR --out DIR [--merge]` from the resumed run's last checkpoint = the straight run's engine."""
    from transformers import AutoModelForCausalLM

    from finetune.export import main as export_main

    tmp, _ = runs
    n = name(3, lora, False)
    out = tmp_path / "exported"
    assert export_main([str(tmp / n / "halves"), "--out", str(out)] + (["--merge"] if lora else [])) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=_prompt()).logits.float()
    torch.testing.assert_close(got, torch.load(tmp / n / "straight" / "engine_logits.pt"), atol=1e-5, rtol=0)


def _launch_and_kill(args: list[str], out, until) -> None:
    """Start 2 ranks through the deepspeed launcher, SIGKILL the whole job as soon as until(out) holds."""
    import signal
    import subprocess
    import time

    from tests.helpers import deepspeed_command, free_port, loopback_env

    cmd = [*deepspeed_command(), "--num_gpus", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "finetune/main.py", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=loopback_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    try:
        while not until(out):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.time() < deadline, "the run never reached the point to kill it at"
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("moment", ["training", "saving"])
def test_kill_9_then_resume_continues_the_uninterrupted_curve(runs, tmp_path, moment):
    """kill -9 of every rank mid-run (after the step-4 checkpoint) or in the middle of writing a checkpoint; resume=auto
    continues from the last complete checkpoint with the uninterrupted run's losses, bit for bit."""
    tmp, losses = runs
    n = name(3, False, False)
    straight = losses[f"{n}/straight"]
    out = tmp_path / "run"
    args = ["--deepspeed", str(tmp / "z3-False.json"), "--config", TINY_RECIPE, f"model.path={tmp / 'model'}",
            f"model.tokenizer={SMALL_VOCAB}", "lora.enabled=false", "data.max_seq_len=128", "optim.lr=1e-3",
            "optim.warmup_steps=3", f"train.max_steps={STEPS}", "train.micro_batch_size=1", "train.grad_accum=2",
            "train.sample_prompt=null", "train.log_every=100", "train.save_every=2", "train.export=false",
            f"train.output_dir={out}"]
    ckpts = out / "checkpoints"
    if moment == "training":
        until = lambda o: (ckpts / "step_00000004" / checkpoint.MARKER).exists()
    else:
        until = lambda o: (ckpts / ".tmp-step_00000004").exists()
    _launch_and_kill(args, out, until)
    last = checkpoint.find_latest(str(out))
    assert last is not None
    resumed_from = int(last.rsplit("_", 1)[1])
    assert resumed_from == 2 if moment == "saving" else resumed_from >= 4
    run_ranks(2, "finetune/main.py", args + ["train.resume=auto"], timeout=600)
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics] == straight
    assert not list(ckpts.glob(".tmp-*")), "the half-written checkpoint is cleaned up by the next save of that step"
