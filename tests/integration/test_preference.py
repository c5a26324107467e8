"""Preference objectives (DPO) on real DeepSpeed engines (CPU, gloo, loopback).

- fp32 ZeRO-0/1/2/3 on 1 and 2 ranks give the same per-step losses within 1e-5, for LoRA (reference: the adapters
  off) and full fine-tuning (reference: precomputed); 1 rank x accumulation 2 x 1 row equals 1 x 1 x 2 rows. The
  micro-batches of a step hold different numbers of pairs, so only a loss that is the mean over the global batch's
  pairs agrees across these layouts; step 1's gradient is that of that mean, scored sequence by sequence in plain
  PyTorch.
- kill -9 of a full DPO run after its step-2 checkpoint, then train.resume=auto: the uninterrupted run's losses, bit
  for bit, with the reference read back from the run folder (a reference recomputed from the trained model would
  zero every reward of the first resumed step).
- A LoRA DPO run's export/ loads in peft over its base and gives the trained engine's logits.
- recipes/tiny_dpo.yaml as shipped reaches reward accuracy >= 0.9 at its last step.
- train.objective=dpo on instruction data: exit 2, one error line, the output folder as it was.

Every training of the oracle runs in one launch per world size (tests/fixtures/preference_driver.py).
"""

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from finetune import checkpoint
from tests.helpers import (ROOT, SMALL_VOCAB, TINY_RECIPE, ds_variant, free_port, kill_two_ranks_when, loopback_env,
                           run_ranks, save_tiny_model, start_ranks)

STAGES = [0, 1, 2, 3]
STEPS = 4
SAVED = 2  # the killed run's checkpoint cadence: it is killed once step SAVED is saved
TINY_DPO = os.path.join(ROOT, "recipes", "tiny_dpo.yaml")
DRIVER = os.path.join(ROOT, "tests", "fixtures", "preference_driver.py")
BETA = 0.1  # recipes/tiny_dpo.yaml's train.beta, which the cases keep


def case_name(stage: int, lora: bool, micro: int = 1) -> str:
    return f"zero{stage}-{'lora' if lora else 'full'}" + ("-micro2" if micro == 2 else "")


def overrides(model_dir: str, out: str, lora: bool, world: int, micro: int = 1) -> list[str]:
    """tiny_dpo on the small-vocabulary tiny model: 2 rows of packed pairs per step (1 rank x accumulation 2 x 1 row,
    1 x 1 x 2, or 2 ranks x 1 x 1)."""
    return [f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", f"lora.enabled={str(lora).lower()}",
            "lora.rank=8", "lora.dropout=0.0", f"train.reference={'adapters_off' if lora else 'precomputed'}",
            "data.max_seq_len=256", f"train.max_steps={STEPS}", f"train.micro_batch_size={micro}",
            f"train.grad_accum={2 // world // micro}", "train.save_every=0", "train.export=false",
            "train.log_every=100", f"train.output_dir={out}"]


def _train(world: int, cases: list[dict], folder) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cases.json").write_text(json.dumps(cases))
    run_ranks(world, DRIVER, [str(folder / "out.json"), str(folder / "cases.json")], timeout=600)
    return json.loads((folder / "out.json").read_text())


def _main(args: list[str], out: str, err: str) -> int:
    """One rank of finetune/main.py (what `zerotune train` runs), waited for; its exit status."""
    [proc] = start_ranks(1, "finetune/main.py", args, loopback_env(MASTER_PORT=str(free_port())), [(out, err)])
    try:
        return proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _demo_and_refusal(tmp) -> dict:
    """recipes/tiny_dpo.yaml as shipped (its output folder and DeepSpeed file named), then train.objective=dpo on the
    tiny recipe's instruction data into a folder that does not exist and into one that exists and is empty."""
    ds = os.path.join(ROOT, "ds_configs", "zero3_fp32.json")
    demo = str(tmp / "demo")
    code = _main(["--deepspeed", ds, "--config", TINY_DPO, f"train.output_dir={demo}"], f"{demo}.log", f"{demo}.log")
    assert code == 0, open(f"{demo}.log").read()[-6000:]
    refusals = {}
    for kind in ("absent", "empty"):
        out = tmp / f"refused-{kind}"
        if kind == "empty":
            out.mkdir()
        log = str(tmp / f"refused-{kind}")
        code = _main(["--deepspeed", ds, "--config", TINY_RECIPE, "train.objective=dpo", f"train.output_dir={out}"],
                     f"{log}.out", f"{log}.err")
        refusals[kind] = {"code": code, "stdout": open(f"{log}.out").read(), "stderr": open(f"{log}.err").read(),
                          "exists": out.exists(), "listing": sorted(os.listdir(out)) if out.exists() else None}
    return {"demo": demo, "refusals": refusals}



def _kill_and_resume(tmp, model_dir: str, ds: str) -> dict:
    """The 2-rank ZeRO-3 full case (its DeepSpeed file `ds`) with a checkpoint every SAVED steps, killed once its
    step-SAVED checkpoint is complete, then resumed with train.resume=auto."""
    out = tmp / "killed"
    args = ["--deepspeed", ds, "--config", TINY_DPO, *overrides(model_dir, str(out), False, 2),
            f"train.save_every={SAVED}"]
    marker = out / "checkpoints" / f"step_{SAVED:08d}" / checkpoint.MARKER
    kill_two_ranks_when(args, str(tmp / "killed.rank"), marker.exists)
    reference = out / "reference_logps.pt"
    before = (reference.read_bytes(), reference.stat().st_mtime_ns)
    last = checkpoint.find_latest(str(out))
    run_ranks(2, "finetune/main.py", args + ["train.resume=auto"], timeout=300)
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return {"last": last, "metrics": metrics, "reference_before": before,
            "reference_after": (reference.read_bytes(), reference.stat().st_mtime_ns)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case on 1 rank, then on 2 ranks; alongside, on the other core: the tiny demo, the refusals, the killed
    and resumed run."""
    tmp = tmp_path_factory.mktemp("preference")
    model_dir = save_tiny_model(str(tmp / "model"))
    ds = {stage: ds_variant(f"zero{stage}", str(tmp / f"zero{stage}.json"), bf16=False) for stage in STAGES}
    launches = {1: [], 2: []}
    for world in (1, 2):
        for stage in STAGES:
            for lora in (False, True):
                name = case_name(stage, lora)
                case = {"name": name, "config": TINY_DPO, "deepspeed": ds[stage],
                        "overrides": overrides(model_dir, str(tmp / f"w{world}" / name), lora, world)}
                if world == 1 and stage == 3 and lora:  # the export under test: ZeRO-3's gathered adapter
                    case["overrides"] = case["overrides"] + ["train.export=true"]
                    case["logits"] = True
                launches[world].append(case)
    for lora in (False, True):  # 1 row x accumulation 2 above; 2 rows x accumulation 1 here
        name = case_name(3, lora, micro=2)
        launches[1].append({"name": name, "config": TINY_DPO, "deepspeed": ds[3],
                            "overrides": overrides(model_dir, str(tmp / "w1" / name), lora, 1, micro=2)})

    for share in ("on", "off"):  # one pair per row either way, so both runs take the same pairs in each step
        name = f"zero3-lora-unpacked-share-{share}"
        launches[2].append({"name": name, "config": TINY_DPO, "deepspeed": ds[3], "overrides": overrides(
            model_dir, str(tmp / "w2" / name), True, 2) + ["data.packing=false", "model.attn_implementation=flex",
                                                            f"train.share_prompt={share}"]})

    def alongside():
        return {**_demo_and_refusal(tmp), "resumed": _kill_and_resume(tmp, model_dir, ds[3])}

    with ThreadPoolExecutor(1) as pool:  # a rank is one thread (OMP_NUM_THREADS=1): the two queues fill the 2 cores
        side = pool.submit(alongside)
        results = {world: _train(world, launches[world], tmp / f"w{world}") for world in (1, 2)}
        return {"tmp": tmp, "model": model_dir, **results, **side.result()}


# 1. The same losses on every ZeRO stage, world size and accumulation

@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_stage_and_world_size_gives_the_same_losses(runs, lora):
    want = runs[1][case_name(0, lora)]
    assert len(want["loss"]) == STEPS
    # policy = reference before the first update: every pair's loss is log 2, whatever the reference's source
    assert want["loss"][0] == pytest.approx(math.log(2), abs=1e-5)
    assert want["loss"][-1] < want["loss"][0] - 0.01, "the model must learn, or equal losses prove little"
    for world in (1, 2):
        for stage in STAGES:
            got = runs[world][case_name(stage, lora)]
            where = f"ZeRO-{stage}, {world} rank(s)"
            assert got["pairs"] == want["pairs"], where
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5, rel=0), where
            assert got["reward_margin"] == pytest.approx(want["reward_margin"], abs=1e-4, rel=0), where


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_accumulating_one_row_twice_equals_two_rows_at_once(runs, lora):
    one_by_two, two_by_one = runs[1][case_name(3, lora)], runs[1][case_name(3, lora, micro=2)]
    assert one_by_two["pairs"] == two_by_one["pairs"]
    assert one_by_two["loss"] == pytest.approx(two_by_one["loss"], abs=1e-5, rel=0)
    assert one_by_two["reward_margin"] == pytest.approx(two_by_one["reward_margin"], abs=1e-4, rel=0)


def _step_pairs(recipe, tokenizer, tmp, step: int):
    """The tokenized data and each micro-batch's pairs (sample ids, chosen first) of `step` on 1 rank x accumulation 2."""
    from finetune.data import build_datasets
    from finetune.data.loader import StepLoader

    data = build_datasets(recipe.data, tokenizer, recipe.train.seed, str(tmp / "oracle-cache"))[0]
    loader = StepLoader(data, 1, 2, 1, 0, recipe.data.max_seq_len, recipe.data.packing, recipe.train.seed,
                        tokenizer.pad_id, shuffle=recipe.data.shuffle)
    return data, [mb["sample_ids"].view(-1, 2).tolist() for mb in loader.step(step)]


def test_the_cases_put_unequal_pair_counts_in_one_step(runs):
    """What the comparisons above rely on: a loss divided per micro-batch (or per rank) would differ across layouts."""
    from finetune.config import load_recipe
    from finetune.data.tokenizer import load_tokenizer

    recipe = load_recipe(TINY_DPO, overrides(runs["model"], str(runs["tmp"] / "unused"), False, 1))
    counts = [[len(mb) for mb in _step_pairs(recipe, load_tokenizer(SMALL_VOCAB), runs["tmp"], step)[1]]
              for step in range(STEPS - 1)]  # the last step's micro-batches change no loss the runs report
    assert any(len(set(step)) > 1 for step in counts), counts
    assert [sum(step) for step in counts] == runs[1][case_name(0, False)]["pairs"][:STEPS - 1]


def test_first_gradient_is_that_of_the_mean_over_the_global_batchs_pairs(runs):
    """Full fine-tuning: step 1's gradient norm on every stage and world size = that of the mean DPO loss over step
    1's pairs, each sequence scored alone by the saved model in plain PyTorch (reference = that same model)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from finetune.config import load_recipe
    from finetune.data.tokenizer import load_tokenizer

    recipe = load_recipe(TINY_DPO, overrides(runs["model"], str(runs["tmp"] / "unused"), False, 1))
    data, micro_batches = _step_pairs(recipe, load_tokenizer(SMALL_VOCAB), runs["tmp"], 0)
    model = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32)

    def logp(i):
        ids, labels = (torch.tensor(a, dtype=torch.long) for a in data.sample(i))
        logits = model(input_ids=ids[None]).logits[0, :-1]
        return -F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")

    pairs = [pair for mb in micro_batches for pair in mb]
    losses = []
    for chosen, rejected in pairs:
        pi_c, pi_r = logp(chosen), logp(rejected)
        losses.append(-F.logsigmoid(BETA * ((pi_c - pi_c.detach()) - (pi_r - pi_r.detach()))))
    torch.stack(losses).mean().backward()
    want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    for world in (1, 2):
        for stage in STAGES:
            got = runs[world][case_name(stage, False)]["grad_norm"][0]
            assert got == pytest.approx(want, rel=1e-4), f"ZeRO-{stage}, {world} rank(s)"


# 2. kill -9 and resume

def test_kill_9_then_resume_continues_the_uninterrupted_curve(runs):
    resumed = runs["resumed"]
    straight = runs[2][case_name(3, False)]
    assert resumed["last"] is not None and int(resumed["last"].rsplit("_", 1)[1]) == SAVED
    metrics = resumed["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics] == straight["loss"]
    assert [m["reward_margin"] for m in metrics] == straight["reward_margin"]
    # the resumed steps trained against the starting model's log-probs: the trained model's would make them log 2
    assert all(abs(m["loss"] - math.log(2)) > 1e-3 for m in metrics[SAVED:])


def test_the_resumed_run_reads_the_reference_back_unchanged(runs):
    resumed = runs["resumed"]
    assert resumed["reference_after"] == resumed["reference_before"]


# 3. The LoRA export

def test_lora_dpo_export_loads_in_peft_and_gives_the_engines_logits(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.fixtures.preference_driver import PROMPT_IDS

    run = runs["tmp"] / "w1" / case_name(3, True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(run / "export"))
    want = torch.load(run / "engine_logits.pt")
    base = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(run / "export")).eval()
    with torch.no_grad():
        got = adapted(input_ids=torch.tensor([PROMPT_IDS])).logits
        with adapted.disable_adapter():
            plain = adapted(input_ids=torch.tensor([PROMPT_IDS])).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (plain - want).abs().max() > 1e-2, "the adapter trained: it must change the logits"


def test_shared_prompts_leave_the_loss_curve(runs):
    """Each pair's prompt once (train.share_prompt=on, zerotune's attention on the CPU) against every sequence whole:
    the same DPO losses and rewards on 2 ranks under ZeRO-3 with LoRA, in fewer tokens."""
    on, off = (runs[2][f"zero3-lora-unpacked-share-{share}"] for share in ("on", "off"))
    assert len(on["loss"]) == STEPS
    for key in ("loss", "chosen_reward", "rejected_reward", "pairs"):
        assert max(abs(a - b) for a, b in zip(on[key], off[key])) < 1e-5, (key, on[key], off[key])
    assert on["loss"][-1] < on["loss"][0]
    assert sum(on["tokens"]) < 0.9 * sum(off["tokens"]), (on["tokens"], off["tokens"])


# 4. The tiny demo

def test_tiny_dpo_recipe_reaches_reward_accuracy_0_9(runs):
    from finetune.config import load_recipe

    steps = [json.loads(line) for line in open(os.path.join(runs["demo"], "metrics.jsonl"))]
    assert [s["step"] for s in steps] == list(range(1, load_recipe(TINY_DPO, []).train.max_steps + 1))
    assert steps[-1]["accuracy"] >= 0.9, [s["accuracy"] for s in steps]
    assert steps[0]["accuracy"] < 0.9
    assert steps[-1]["reward_margin"] > steps[0]["reward_margin"] and steps[-1]["loss"] < steps[0]["loss"]


# 5. Preference objective on instruction data

@pytest.mark.parametrize("kind", ["absent", "empty"])
def test_dpo_on_instruction_data_is_refused_leaving_the_folder_as_it_was(runs, kind):
    r = runs["refusals"][kind]
    assert r["code"] == 2, r["stdout"] + r["stderr"]
    [line] = r["stderr"].splitlines()
    assert line.startswith("zerotune: error: ") and "train.objective=dpo" in line and "data.format" in line
    assert r["stdout"] == ""
    assert (r["exists"], r["listing"]) == ((False, None) if kind == "absent" else (True, []))
