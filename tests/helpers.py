"""Test helpers: a saved tiny random Mistral, DeepSpeed JSON variants, and launching ranks on loopback only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from finetune.dist import free_port  # noqa: F401  (tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
PCH_CC = os.path.join(ROOT, "tests", "fixtures", "pch_cc")  # a `c++` in front of the real one (its own comment says why)
TINY_CONFIG = os.path.join(ROOT, "recipes", "tiny_model", "config.json")
TINY_RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
# The tiny model with a 512-piece tokenizer (tests/fixtures/make_small_vocab.py): for tests whose subject is not the
# real Mistral tokenizer, a model that is not mostly vocabulary. `model.tokenizer={SMALL_VOCAB}` selects it.
SMALL_VOCAB = os.path.join(ROOT, "tests", "fixtures", "small_vocab")


def deepspeed_command() -> list[str]:
    """The `deepspeed` launcher: the one on PATH, else this interpreter's `python -m deepspeed.launcher.runner`
    (an install may put its scripts elsewhere than beside sys.executable)."""
    found = shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def loopback_env(**extra: str) -> dict[str, str]:
    """The environment of a launched test process: loopback-only rendezvous, and CPU-only on any machine (the
    integration tier is a CPU test by design): no CUDA device and DeepSpeed's CPU accelerator. DeepSpeed's launcher
    re-sets CUDA_VISIBLE_DEVICES for each rank, so tests/fixtures/cpu_only (its sitecustomize, on PYTHONPATH) sets
    both again at each rank's start."""
    cpu_only = os.path.join(ROOT, "tests", "fixtures", "cpu_only")
    env = dict(os.environ)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
        CUDA_VISIBLE_DEVICES="",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, cpu_only, env.get("PYTHONPATH")) if p),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        # The venv's ninja first: /usr/bin/ninja would discard its build log and JIT-rebuild DeepSpeed's ops. Before
        # it, the `c++` that builds the async I/O op against a precompiled torch header (tests/fixtures/pch_cc).
        PATH=os.pathsep.join((PCH_CC, VENV_BIN, env.get("PATH", ""))),
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
    env.update(extra)
    return env


def save_tiny_model(dest: str, seed: int = 0, config_dir: str = SMALL_VOCAB) -> str:
    """A random-init tiny Mistral saved with save_pretrained: the real from_pretrained path, one init for everyone.
    By default the small-vocabulary one (train it with `model.tokenizer={SMALL_VOCAB}`); config_dir=dirname(TINY_CONFIG)
    gives the 32,000-token one. Its weights are those a run draws from config_dir with model.init_seed=seed
    (finetune/init_weights.py), so a saved model and a random-init run start alike."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.init_weights import initialize

    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    initialize(model, seed)
    model.save_pretrained(dest)
    return dest


def ds_variant(base: str, dest: str, bf16: bool = True, **zero: object) -> str:
    """A copy of ds_configs/<base>.json with bf16 switched and zero_optimization keys overridden."""
    with open(os.path.join(ROOT, "ds_configs", f"{base}.json")) as f:
        cfg = json.load(f)
    if "torch_autocast" in cfg:  # ZeRO-0's bf16 is autocast (fp32 weights and gradients)
        cfg["torch_autocast"]["enabled"] = bf16
    else:
        cfg["bf16"] = {"enabled": bf16}
    cfg["zero_optimization"].update(zero)
    with open(dest, "w") as f:
        json.dump(cfg, f)
    return dest


def run_ranks(world: int, script: str, args: list[str], timeout: int = 600, env: dict | None = None,
              launcher: bool = False) -> subprocess.CompletedProcess:
    """`world` ranks of `script` on loopback; raises AssertionError with their output when one fails.

    By default the ranks are started here with the rendezvous variables DeepSpeed's launcher would set (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, `--local_rank=K`): the launcher's own two processes, each importing
    DeepSpeed before a rank starts, cost seconds per launch and are not what these tests test. launcher=True goes
    through the real `deepspeed --num_gpus N` (the tests of the user's command line)."""
    env = env or loopback_env()
    port = str(free_port())
    if world == 1 and not launcher:
        # One thread, as every rank has (loopback_env): the tiny models' ops are too small to gain from more, and the
        # other pytest worker is using the other core.
        env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_PORT=port)
        cmd = [sys.executable, script, *args]
    elif launcher:
        cmd = [*deepspeed_command(), "--num_gpus", str(world), "--master_addr", "127.0.0.1",
               "--master_port", port, script, *args]
    else:
        return _spawn_ranks(world, script, args, timeout, dict(env, MASTER_PORT=port))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _spawn_ranks(world: int, script: str, args: list[str], timeout: int, env: dict) -> subprocess.CompletedProcess:
    """Start `world` ranks as the deepspeed launcher does; when one fails the others are stopped (they would wait in
    a collective until gloo's timeout). stdout/stderr: rank 0's, then rank 1's, ..."""
    with tempfile.TemporaryDirectory() as logs:
        procs, files = [], []
        for rank in range(world):
            out, err = open(os.path.join(logs, f"{rank}.out"), "w+"), open(os.path.join(logs, f"{rank}.err"), "w+")
            files.append((out, err))
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
            procs.append(subprocess.Popen([sys.executable, "-u", script, f"--local_rank={rank}", *args], cwd=ROOT,
                                          env=rank_env, stdout=out, stderr=err, start_new_session=True))
        deadline, stop_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs) and time.monotonic() < (stop_at or deadline):
            if stop_at is None and any(p.poll() not in (None, 0) for p in procs):
                stop_at = time.monotonic() + 10  # a rank failed: the others get a moment to print theirs
            time.sleep(0.05)
        timed_out = stop_at is None and any(p.poll() is None for p in procs)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        texts = []
        for out, err in files:
            out.seek(0), err.seek(0)
            texts.append((out.read(), err.read()))
            out.close(), err.close()
    cmd = [sys.executable, script, *args]
    stdout, stderr = "".join(t[0] for t in texts), "".join(t[1] for t in texts)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise AssertionError(f"{world} ranks of {' '.join(cmd)} failed (exit codes {codes}):\n"
                             + "\n".join(f"--- rank {r}:\n{o[-3000:]}\n{e[-6000:]}" for r, (o, e) in enumerate(texts)))
    return subprocess.CompletedProcess(cmd, 0, stdout, stderr)


def train_cases(world: int, cases: list[dict], tmp) -> dict:
    """Run zerotune trainings (tests/drivers/parity_driver.py cases: name, config, deepspeed, overrides) in one process group of
    `world` ranks; their results (losses, grad norms, ...) by name. tmp: a folder for the cases and results files."""
    cases_file, out = os.path.join(str(tmp), "cases.json"), os.path.join(str(tmp), "out.json")
    with open(cases_file, "w") as f:
        json.dump(cases, f)
    run_ranks(world, os.path.join(ROOT, "tests", "drivers", "parity_driver.py"), [out, cases_file])
    with open(out) as f:
        return json.load(f)


def skip_shm_build() -> None:
    """Call before init_distributed in rank scripts: DeepSpeed's shm op is only a faster CPU all-reduce, and its JIT
    build costs 30-70 s per launch; losses are identical without it (FACTS.md). `deepspeed.comm.torch` as an
    attribute is torch itself (deepspeed.comm imports torch), hence import_module."""
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def driver_main(one_case) -> None:
    """The body of a multi-case driver script: `script OUT.json CASES.json` runs `one_case(case)` for every case in
    one process group (one start of Python, torch and DeepSpeed for many trainings) and rank 0 writes the results."""
    from finetune import dist

    skip_shm_build()
    out, cases_file = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    with open(cases_file) as f:
        cases = json.load(f)
    results = {case["name"]: one_case(case) for case in cases}
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(results, f)
    dist.shutdown()
    dist.exit_process(0)
