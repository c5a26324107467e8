"""The quickstart, and every runnable block of README.md and docs/*.md after it, as a user runs them.

The blocks run in a folder laid out like a checkout (the repository's files linked in, its own empty runs/). First
launch/quickstart.sh runs there as written (real `deepspeed` launcher, 2 ranks, ZeRO-3, all its steps), but without
its install (this environment is installed: `pip` on PATH is a stand-in that installs nothing). What it prints is
compared with the README's block; that it learns, what it wrote and what it left behind are checked on its run folder.
Then each runnable block runs in that folder: ```bash blocks with `bash -e`, ```python blocks as a script. A block
that is not run carries a mark on the line before its fence (tests/docs_pages.py).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from tests.docs_pages import all_blocks
from tests.fixtures.quickstart_install import pip_calls, readme_install_commands, write_stand_ins
from tests.helpers import ROOT, VENV_BIN, free_port, loopback_env

# Linked into the folder: what a fresh clone has, less runs/ (the folder's own) and build outputs.
HIDDEN_LINKED = {".ci", ".gitignore"}
NOT_LINKED = {"runs", "build", "zerotune.egg-info", "__pycache__"}
RUNNABLE = [b for b in all_blocks() if b.runnable]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """(folder, environment) after the quickstart ran there."""
    folder = tmp_path_factory.mktemp("checkout")
    for name in os.listdir(ROOT):
        if name not in NOT_LINKED and (not name.startswith(".") or name in HIDDEN_LINKED):
            os.symlink(os.path.join(ROOT, name), folder / name)
    stand_in = tmp_path_factory.mktemp("bin")
    pip_log = write_stand_ins(str(stand_in))
    with open(os.path.join(ROOT, "launch", "quickstart.sh")) as f:
        script = f.read()
    # The stand-in must be what installs, or the test would install this checkout's copy into the environment.
    assert "-m pip" not in script, "launch/quickstart.sh runs `python -m pip`: the test's `pip` stand-in misses it"
    env = loopback_env(PATH=os.pathsep.join([str(stand_in), VENV_BIN, os.environ.get("PATH", "")]))
    env.pop("VIRTUAL_ENV", None)  # a fresh clone's shell: the quickstart makes .venv (the stand-in's) and installs there
    port = free_port()
    # One stream, as a terminal shows it: the README's block is stdout and stderr in their order.
    proc = subprocess.run(["bash", "launch/quickstart.sh"], cwd=folder, env={**env, "MASTER_PORT": str(port)},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert proc.returncode == 0, f"the quickstart failed ({proc.returncode}):\n{proc.stdout[-8000:]}"
    assert os.path.isfile(folder / "runs" / "tiny" / "export" / "config.json"), os.listdir(folder / "runs" / "tiny")
    return folder, env, proc.stdout, port, pip_calls(pip_log)


# A progress line: its step and lr are the same everywhere; loss and grad_norm move by a few percent with the CPU's
# kernels and thread count (a sum's order); tokens/s, memory and ETA are the machine's.
PROGRESS = re.compile(r"^step (\d+)/(\d+) \| loss ([\d.]+) \| lr (\S+) \| grad_norm ([\d.]+) \| [\d,]+ tok/s "
                      r"\([\d,]+/rank\) \| mem [\d.]+ GiB \| ETA [\d:]+$")


def readme_quickstart_output() -> list[str]:
    """The lines of the output block that follows `bash launch/quickstart.sh` in the README."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    after = readme.split("```bash\nbash launch/quickstart.sh\n```\n", 1)[1]
    block = re.match(r"\s*```\n(.*?)```\n", after, re.S)
    assert block, "the README's quickstart command is not followed by its output block"
    return block.group(1).splitlines()


def test_the_quickstart_prints_what_the_readme_shows(checkout):
    _, _, output, _, _ = checkout
    printed = [line for line in output.splitlines() if line.strip()]
    shown = readme_quickstart_output()
    assert len(printed) <= 15 and len(printed) == len(shown), "\n".join(printed)
    for got, want in zip(printed, shown):
        g, w = PROGRESS.match(got), PROGRESS.match(want)
        if not w:
            assert got == want
            continue
        assert g, got
        assert (g[1], g[2], g[4]) == (w[1], w[2], w[4]), (got, want)
        for i in (3, 5):  # loss, grad_norm
            assert float(g[i]) == pytest.approx(float(w[i]), abs=0.02, rel=0.15), (got, want)


def test_the_quickstart_installs_into_a_new_virtual_environment_with_the_readmes_lines(checkout):
    """From a shell with no virtual environment the quickstart makes .venv in the checkout and installs there, never
    into the Python it was started with; on a CPU machine with the README's lines for one."""
    folder, _, _, _, calls = checkout
    assert os.path.isfile(folder / ".venv" / "bin" / "activate")
    assert calls and {venv for venv, _ in calls} == {str(folder / ".venv")}, calls
    readme = readme_install_commands()
    # pip itself, torch's CPU build alone, then zerotune with the versions the tests run with (not the GPU line)
    assert [[w for w in args.split() if w != "-q"] for _, args in calls] == [readme[0], readme[2], readme[3]]


def test_the_quickstart_learns_its_training_answer(checkout):
    folder, _, _, _, _ = checkout
    run = folder / "runs" / "tiny"
    steps = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 121))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_mem_gib"):
        assert all(r[key] is not None for r in steps), key
    assert sum(r["loss"] for r in steps[-5:]) < sum(r["loss"] for r in steps[:5]) / 50
    samples = [json.loads(line) for line in open(run / "samples.jsonl")]
    before, after = samples[0], samples[-1]
    assert (before["step"], after["step"]) == (0, 120)
    bundled = next(json.loads(line)["output"] for line in open(os.path.join(ROOT, "recipes", "data", "tiny_instruct.jsonl"))
                   if json.loads(line)["instruction"] == after["prompt"])
    assert after["answer"] == bundled and before["answer"] != bundled


def test_the_quickstart_writes_resolved_configs(checkout):
    folder, _, _, _, _ = checkout
    run = folder / "runs" / "tiny"
    ds = json.load(open(run / "ds_config.json"))
    assert ds["train_batch_size"] == 2 and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["optimizer"]["params"]["lr"] == 5e-3 and ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 1280  # 10 x hidden
    assert '"auto"' not in json.dumps(ds)
    assert "train:" in (run / "recipe.yaml").read_text()


def test_the_quickstart_leaves_no_shared_memory_behind(checkout):
    """DeepSpeed's CPU shm all-reduce never unlinks its per-rank workspace; finetune/dist.py does, or every CPU run
    would leave two in /dev/shm (RAM) until a day of runs fills it."""
    _, env, _, port, _ = checkout
    built = glob.glob(os.path.join(env["TORCH_EXTENSIONS_DIR"], "deepspeed_shm_comm*", "*.so"))
    assert built, "the op was not built: DeepSpeed's CPU backend loads it in every run when it builds"
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith("deepspeed_allreduce_buffer_")
                 and f"_127.0.0.1_{port}_" in name]
    assert leftovers == []


@pytest.mark.parametrize("dashes", [["--"], []], ids=["with --", "without --"])
def test_single_node_passes_the_training_arguments_with_or_without_a_leading_dashdash(dashes):
    """launch/single_node.sh adds the launcher's own `--`: one given too (as `zerotune launch` takes them) is not passed
    on to finetune/main.py."""
    proc = subprocess.run(["bash", "launch/single_node.sh", *dashes, "--deepspeed", "zero3_fp32", "--config", "tiny"],
                          cwd=ROOT, env=loopback_env(LAUNCH_ARGS="--dry-run", NUM_GPUS="2"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    command = next(line for line in proc.stdout.splitlines() if line.startswith("$ "))
    assert command.endswith(" finetune/main.py --deepspeed zero3_fp32 --config tiny"), command


def test_there_are_runnable_blocks():
    assert {b.page for b in RUNNABLE} >= {"README.md", "docs/data.md"}, [b.id for b in RUNNABLE]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs_as_written(checkout, block):
    folder, env, _, _, _ = checkout
    if block.lang == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    else:
        script = folder / f"block_{block.page.replace('/', '_')}_{block.line}.py"
        script.write_text(block.text)
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{block.id}: the {block.lang} block failed ({proc.returncode}); mark it on the line "
                                  f"before its fence if it cannot run on a CPU machine after the quickstart:\n"
                                  f"{block.text}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
