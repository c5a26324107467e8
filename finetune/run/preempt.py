"""Save on preemption: SIGTERM or SIGUSR1 (Slurm's `--signal`, Kubernetes' stop, `kill`) ends a run cleanly.

    with preempt.watching():          # around the training steps (finetune/train.py _train_loop)
        ... votes = preempt.votes()   # summed over the ranks with the step's sums (finetune/step.py)
        if stop := preempt.agreed(summed): save, then raise preempt.Stopped(step, f"by {stop}")

The handler only notes the signal. After each optimizer step every rank adds its note to the step sums it reduces
anyway, so all ranks learn of a signal in the same step, however many of them received it and whenever: they all
finish that step, save it and leave; train.main prints `stopped at step N by SIGTERM; resume with: <command>` and
exits 0. A signal after the first (Slurm and a launcher may both send one; an impatient user) is counted and
ignored: the save goes on, and it becomes visible only by its atomic rename (finetune/checkpoint/store.py), so a
SIGKILL at any moment leaves the previous complete checkpoint the newest one.

Which process is signalled decides whether the job ends in that save and exit 0: a rank, or `zerotune launch`
(finetune/multinode/jobwatch.py), which runs DeepSpeed's processes in a session of their own, so that a SIGTERM to
its whole process group (`timeout`, `kill -- -PGID`) reaches it alone, passes the signal on to the ranks and waits
for their save. A SIGTERM to the whole process group of a plain `deepspeed --num_gpus N` run cannot end so, whatever
the ranks do: DeepSpeed's runner sets no handler on one node and dies of it at once (143), and its
deepspeed.launcher.launch SIGTERMs the ranks, SIGKILLs them 30 s later and exits 1. Hence the ranks do not leave
the launcher's process group (os.setsid) either: the runner would still die, Ctrl-C would reach them only as the
launcher's SIGTERM (a save, not a stop), and a launcher killed by SIGKILL would leave them training.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that stop a run at the next step boundary, in the order that names the reason when several arrive."""


class Stopped(Exception):
    """The run stopped early at `step` (saved there), for `reason` (`by SIGTERM`). Raised on every rank alike.

    The signal handlers stay in place while it travels (a later signal must not kill a rank whose run is already
    saved and leaving); whoever catches it calls restore_signals() once the process is about to end."""

    def __init__(self, step: int, reason: str, ignored: int):
        super().__init__(f"stopped at step {step} {reason}")
        self.step, self.reason, self.ignored = step, reason, ignored
        self._restore = lambda: None

    def restore_signals(self) -> None:
        self._restore()


class _Notes:
    """What the handler writes: plain assignments, nothing else (it may run between any two bytecodes)."""

    def __init__(self) -> None:
        self.first = 0
        """The first stopping signal received (0: none)."""
        self.later = 0
        """Signals received after it, ignored."""

    def note(self, signum: int, frame: object) -> None:
        if self.first:
            self.later += 1
        else:
            self.first = signum


_notes = _Notes()


@contextlib.contextmanager
def watching():
    """Note SIGTERM/SIGUSR1 instead of dying of them while the block runs; the previous handlers come back after
    it (after a Stopped, when its restore_signals() is called). Outside the main thread Python cannot take signals:
    nothing is installed and the default actions stay."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _notes.first = _notes.later = 0
    for s in SIGNALS:
        signal.signal(s, _notes.note)
    restore = True
    try:
        yield
    except Stopped as e:
        e._restore, restore = (lambda: _restore(previous)), False
        raise
    finally:
        if restore:
            _restore(previous)


def _restore(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python


def votes() -> list[float]:
    """This rank's vote, one value per signal of SIGNALS (1.0: received), to be summed over the ranks."""
    return [1.0 if _notes.first == s else 0.0 for s in SIGNALS]


def agreed(summed: list[float]) -> str:
    """The name of the signal that stops the run (`SIGTERM`), from the votes summed over the ranks; '' to go on."""
    return next((signal.Signals(s).name for s, n in zip(SIGNALS, summed) if n > 0), "")


def ignored() -> int:
    """Signals this rank received after the one that stopped it."""
    return _notes.later


def stopped_line(step: int, reason: str, command: str) -> str:
    return f"stopped at step {step} {reason}; resume with: {command}"


_LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def resume_command(program: str, args: list[str], output_dir: str, env: dict[str, str] | None = None,
                   stop_at_ended: bool = False) -> str:
    """The command that continues this run: `program` (the rank's sys.argv[0]) and `args` (what train.main parsed)
    without DeepSpeed's --local_rank, with the run folder explicit and train.resume=auto. A run ended by
    train.stop_at resumes without it (train.stop_at=0); a signal leaves the user's stop_at in place.

    How it starts follows how this rank was started: `zerotune train`, `python finetune/main.py` (one process), or
    DeepSpeed's launcher (--local_rank given): `deepspeed --num_gpus N` on one node, `zerotune launch` on several
    (whose hostfile no rank knows: HOSTFILE stands for it)."""
    env = os.environ if env is None else env
    dropped = ("train.resume=", "train.output_dir=") + (("train.stop_at=",) if stop_at_ended else ())
    kept, launched, skip = [], False, False
    for arg in args:
        if skip:
            skip = False
        elif arg in _LOCAL_RANK_FLAGS:
            launched = skip = True  # `--local_rank 0`: its value goes too
        elif arg.startswith(tuple(f + "=" for f in _LOCAL_RANK_FLAGS)):
            launched = True
        elif not arg.startswith(dropped):
            kept.append(arg)
    kept += [f"train.output_dir={output_dir}"] + (["train.stop_at=0"] if stop_at_ended else []) + ["train.resume=auto"]
    name = os.path.basename(program)
    if name != "main.py":  # the `zerotune` script, `python -m finetune.cli`, or train.main called from Python
        return shlex.join(["zerotune", "train", *kept])
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)  # torchrun's, DeepSpeed's launch.py's
    if not launched and world == 1:
        return shlex.join(["python", program, *kept])
    if local < world:
        return shlex.join(["zerotune", "launch", "--hostfile", "HOSTFILE", "--", *kept])
    return shlex.join(["deepspeed", "--num_gpus", str(local), program, *kept])
