"""Test helpers: a saved tiny random Mistral, DeepSpeed JSON variants, and launching ranks on loopback only."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from finetune.dist import free_port  # noqa: F401  (tests import it from here)
from tests.fixtures.paths import ROOT
from tests.fixtures.zygote import ALLOWED as ZYGOTE_ALLOWED

VENV_BIN = os.path.dirname(sys.executable)
PCH_CC = os.path.join(ROOT, "tests", "fixtures", "pch_cc")  # a `c++` in front of the real one (its own comment says why)
TINY_CONFIG = os.path.join(ROOT, "recipes", "tiny_model", "config.json")
TINY_RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
# The tiny model with a 512-piece tokenizer (tests/fixtures/make_small_vocab.py): for tests whose subject is not the
# real Mistral tokenizer, a model that is not mostly vocabulary. `model.tokenizer={SMALL_VOCAB}` selects it.
SMALL_VOCAB = os.path.join(ROOT, "tests", "fixtures", "small_vocab")
with open(os.path.join(SMALL_VOCAB, "config.json")) as _config:
    SMALL_VOCAB_LAYERS = json.load(_config)["num_hidden_layers"]


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
    # A launched process prints at its default verbosity unless the test asks for another: a ZEROTUNE_LOG that the
    # test process itself carries (set by a run in it) must not reach the processes it starts.
    env.pop("ZEROTUNE_LOG", None)
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


def run_under_triton_interpreter(cases: str, passed: int) -> None:
    """Run a tests/drivers file of Triton kernel cases in a process of its own with TRITON_INTERPRET=1 (Triton reads it
    at its import) and assert that all `passed` of them passed."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", cases],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert re.search(rf"\b{passed} passed\b", out.stdout), out.stdout[-2000:]


def save_tiny_model(dest: str, seed: int = 0, config_dir: str = SMALL_VOCAB, **shape: int) -> str:
    """A random-init tiny Mistral saved with save_pretrained: the real from_pretrained path, one init for everyone.
    By default the small-vocabulary one (train it with `model.tokenizer={SMALL_VOCAB}`); config_dir=dirname(TINY_CONFIG)
    gives the 32,000-token one; `shape` overrides config keys (num_hidden_layers=4). Its weights are those a run draws
    from config_dir with model.init_seed=seed (finetune/model/init_weights.py), so a saved model and a random-init run start
    alike."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.init_weights import initialize

    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir, **shape), dtype=torch.float32)
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
              launcher: bool = False, fork: bool = True) -> subprocess.CompletedProcess:
    """`world` ranks of `script` on loopback; raises AssertionError with their output when one fails.

    By default the ranks are started here with the rendezvous variables DeepSpeed's launcher would set (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, `--local_rank=K`; a lone rank gets no --local_rank, as `python script`
    has none), forked by the tests' rank starter (tests/fixtures/zygote.py) where the environment allows: the
    launcher's own two processes, and each rank's import of DeepSpeed, transformers and peft, cost seconds per launch
    and are not what these tests test. launcher=True goes through the real `deepspeed --num_gpus N` (the tests of the
    user's command line). fork=False starts every rank as a fresh interpreter."""
    env = env or loopback_env()
    port = str(free_port())
    if not launcher:
        return _spawn_ranks(world, script, args, timeout, dict(env, MASTER_PORT=port), fork)
    cmd = [*deepspeed_command(), "--num_gpus", str(world), "--master_addr", "127.0.0.1", "--master_port", port,
           script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _spawn_ranks(world: int, script: str, args: list[str], timeout: int, env: dict,
                 fork: bool = True) -> subprocess.CompletedProcess:
    """Start `world` ranks as the deepspeed launcher does; when one fails the others are stopped (they would wait in
    a collective until gloo's timeout). stdout/stderr: rank 0's, then rank 1's, ..."""
    with tempfile.TemporaryDirectory() as logs:
        files = [(os.path.join(logs, f"{rank}.out"), os.path.join(logs, f"{rank}.err")) for rank in range(world)]
        procs = start_ranks(world, script, args, env, files, fork)
        deadline, stop_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs) and time.monotonic() < (stop_at or deadline):
            if stop_at is None and any(p.poll() not in (None, 0) for p in procs):
                stop_at = time.monotonic() + 10  # a rank failed: the others get a moment to print theirs
            time.sleep(0.05)
        timed_out = stop_at is None and any(p.poll() is None for p in procs)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # a forked rank may end (and be reaped) meanwhile
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        texts = []
        for out, err in files:
            with open(out) as o, open(err) as e:
                texts.append((o.read(), e.read()))
    cmd = [sys.executable, script, *args]
    stdout, stderr = "".join(t[0] for t in texts), "".join(t[1] for t in texts)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise AssertionError(f"{world} ranks of {' '.join(cmd)} failed (exit codes {codes}):\n"
                             + "\n".join(f"--- rank {r}:\n{o[-3000:]}\n{e[-6000:]}" for r, (o, e) in enumerate(texts)))
    return subprocess.CompletedProcess(cmd, 0, stdout, stderr)


def step_losses(out: str) -> list[tuple[int, float]]:
    """(step, loss) of every step record in OUT/metrics.jsonl so far; [] before the first."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def kill_two_ranks_when(args: list[str], log: str, until, timeout: float = 300) -> None:
    """Start 2 ranks of finetune/main.py (each writing `log`K) and SIGKILL both as soon as until() holds, as kill -9
    would; fails if they end or time out first."""
    procs = start_ranks(2, "finetune/main.py", args, loopback_env(MASTER_PORT=str(free_port())),
                        [(f"{log}{rank}",) * 2 for rank in range(2)])
    deadline = time.time() + timeout
    try:
        while not until():
            assert all(p.poll() is None for p in procs), "the run ended before it could be killed"
            assert time.time() < deadline, "the run never reached the point to kill it at"
            time.sleep(0.002)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()


def run_two_ranks(args: list[str], log: str, timeout: float = 300) -> list[int]:
    """2 ranks of finetune/main.py started as DeepSpeed's launcher would (start_ranks), each writing `log`K; waited
    for, and killed if they outlive `timeout`; their exit codes."""
    procs = start_ranks(2, "finetune/main.py", args, loopback_env(MASTER_PORT=str(free_port())),
                        [(f"{log}{rank}", f"{log}{rank}") for rank in range(2)])
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def start_ranks(world: int, script: str, args: list[str], env: dict, outputs: list[tuple[str, str]],
                fork: bool = True) -> list:
    """Start `world` ranks of `script` as the deepspeed launcher does (`--local_rank=K`, RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE; a lone rank as `python script args`), each in a session of its own, rank K writing to the files
    outputs[K] (stdout, stderr; the same path twice for one stream), and return them running: Popen objects, or ranks
    forked by the rank starter (the same pid, poll, wait, kill and returncode)."""
    procs = []
    for rank in range(world):
        if world == 1:
            rank_env, argv = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"), [script, *args]
        else:
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
            argv = [script, f"--local_rank={rank}", *args]
        out, err = outputs[rank]
        for path in (out, err):
            open(path, "a").close()
        forked = zygote(rank_env).start(argv, rank_env, ROOT, out, err) if fork else None
        if forked is None:
            with open(out, "a") as o, open(err, "a") as e:
                forked = subprocess.Popen([sys.executable, "-u", *argv], cwd=ROOT, env=rank_env, stdout=o,
                                          stderr=subprocess.STDOUT if err == out else e, start_new_session=True)
        procs.append(forked)
    return procs


class _ForkedRank:
    """A rank the rank starter forked: the part of Popen's interface _spawn_ranks uses (pid, poll, wait, returncode).
    The starter sends one JSON line with its pid, one with its exit status; a starter that is gone counts as a kill."""

    def __init__(self, conn: socket.socket):
        self.conn, self.pid, self.returncode, self._buffer = conn, None, None, b""

    def message(self, block: bool) -> dict | None:
        """The starter's next line; None when none has come yet (block=False), {} when the starter has gone."""
        while b"\n" not in self._buffer:
            if not block and not select.select([self.conn], [], [], 0)[0]:
                return None
            chunk = self.conn.recv(4096)
            if not chunk:
                return {}
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self.message(block=False)
            if message is not None:
                self.returncode = message.get("exit", -signal.SIGKILL)
                self.conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            select.select([self.conn], [], [], 0.5)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class _RankStarter:
    """The client of one tests/fixtures/zygote.py, started with `env`: start() returns a forked rank, or None where
    the starter refuses the environment or is off (ZEROTUNE_TEST_ZYGOTE=0, or it failed to start) and the caller
    starts a fresh interpreter."""

    def __init__(self, env: dict) -> None:
        self.proc, self.socket_path = None, None
        if os.environ.get("ZEROTUNE_TEST_ZYGOTE", "1") == "0":
            return
        folder = tempfile.mkdtemp(prefix="zerotune-zygote-")
        self.socket_path = os.path.join(folder, "socket")
        with open(os.path.join(folder, "zygote.log"), "w") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fixtures", "zygote.py"),
                                          self.socket_path], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            print(f"the tests' rank starter did not start (see {log.name}): ranks start as fresh processes",
                  file=sys.stderr)
            self.proc = None
            return
        atexit.register(self.stop)

    def start(self, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> _ForkedRank | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket_path)
        request = {"argv": argv, "env": env, "cwd": cwd, "stdout": stdout, "stderr": stderr}
        conn.sendall((json.dumps(request) + "\n").encode())
        rank = _ForkedRank(conn)
        answer = rank.message(block=True)
        if "pid" not in answer:  # refused, or the starter has gone
            conn.close()
            return None
        rank.pid = answer["pid"]
        return rank

    def stop(self) -> None:
        """It takes no new ranks and ends once the ranks it forked have ended and been reported."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
        if self.socket_path:
            shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)


_STARTERS: dict[tuple, _RankStarter] = {}  # by environment, the per-rank variables left out; the latest used last
_STARTERS_LOCK = threading.Lock()  # tests start ranks from threads too (test_chat.py)
MAX_STARTERS = 2


def zygote(env: dict) -> _RankStarter:
    """The rank starter (tests/fixtures/zygote.py) for ranks with environment `env`, started on first use in this
    process (a pytest worker). The environment drifts during a session (a test's logs.setup() sets TORCH_CPP_LOG_LEVEL
    in this process, ...), and one starter serves only the environment it was started with: a new one is started for
    a new environment, and the least recently used beyond MAX_STARTERS is stopped."""
    key = tuple(sorted((k, v) for k, v in env.items() if k not in ZYGOTE_ALLOWED))
    with _STARTERS_LOCK:
        starter = _STARTERS.pop(key, None) or _RankStarter({k: v for k, v in env.items() if k not in ZYGOTE_ALLOWED})
        _STARTERS[key] = starter
        while len(_STARTERS) > MAX_STARTERS:
            _STARTERS.pop(next(iter(_STARTERS))).stop()
    return starter


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
