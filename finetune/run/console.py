"""What a run prints: zerotune's own lines (plan, data, model, progress, samples, the end) and the warnings a user can
act on. DeepSpeed's INFO logging, its CPU-accelerator notice on a machine without a GPU, its shm op's build line, torch's
barrier notice on one GPU, torchao's import notices and the libraries' FutureWarnings about their own internals appear only with `--verbose` or
`ZEROTUNE_LOG=info`.

    from finetune.run import console
    console.setup(verbose="--verbose" in sys.argv)   # once, first thing: before deepspeed is imported where possible

The DeepSpeed launcher (`deepspeed ...`) is a process of its own: its INFO lines follow its `--log_level` flag, which
launch/quickstart.sh sets.
"""

from __future__ import annotations

import contextlib
import glob
import io
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Iterator

ERROR_PREFIX = "zerotune: error: "
"""The start of every error line zerotune prints (error() and error_line() are its only writers)."""
ENV = "ZEROTUNE_LOG"
LEVELS = {"warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
# DeepSpeed's notice when it finds no GPU: harmless on a machine that has none, worth seeing on one that has.
CPU_NOTICE = "Setting accelerator to CPU"
# FutureWarnings raised inside these libraries about their own internals (torch.distributed's renamed collectives
# that DeepSpeed calls, ...): the user's code does not call them and cannot change them.
LIBRARIES = r"(torch|transformers|deepspeed|peft|accelerate|datasets)(\.|$)"
BARRIER_NOTICE = "barrier(): using the device under current context"
# Loggers that warn about their own import: torchao (imported by transformers' quantizers wherever it is installed)
# on each of its GPU kernels libraries that cannot load here, torch's pytree on torchao's enums.
IMPORT_NOTICES = ("torchao", "torch.utils._pytree")


def level(verbose: bool = False) -> int:
    """The logging level asked for: INFO with --verbose, else ZEROTUNE_LOG's (warning, info, debug), else WARNING."""
    if verbose:
        return logging.INFO
    return LEVELS.get(os.environ.get(ENV, "").strip().lower(), logging.WARNING)


def is_verbose(verbose: bool = False) -> bool:
    return level(verbose) < logging.WARNING


class _Quiet(logging.Filter):
    """On DeepSpeed's logger: drops INFO and below, and the CPU notice where there is no GPU to miss."""

    def __init__(self) -> None:
        super().__init__()
        self.level = logging.WARNING
        self.warned = False  # about an unknown ZEROTUNE_LOG value, once

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level:
            return False
        if self.level >= logging.WARNING and record.getMessage().startswith(CPU_NOTICE) and not has_nvidia_gpu():
            return False
        return True


_QUIET = _Quiet()


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver's device node or tool is present (whatever torch makes of it)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def setup(verbose: bool = False) -> int:
    """Apply the verbosity to this process, and through ZEROTUNE_LOG to the runs it starts; returns the level. Safe to
    call again: a call after deepspeed's import also lowers DeepSpeed's own level to INFO where that is asked for."""
    lvl = level(verbose)
    name = os.environ.get(ENV, "").strip().lower()
    if name and name not in LEVELS and not _QUIET.warned:
        _QUIET.warned = True
        print(f"zerotune: {ENV}={name!r} is not one of {', '.join(LEVELS)}; using warning", file=sys.stderr)
    if verbose:
        os.environ[ENV] = "info"
    _QUIET.level = lvl
    ds = logging.getLogger("DeepSpeed")  # deepspeed.utils.logging's logger; its import keeps a filter added before it
    if _QUIET not in ds.filters:
        ds.addFilter(_QUIET)
    if lvl < logging.WARNING:
        # DeepSpeed sets its logger (and handler) to WARNING when it is imported: a call after that import lowers it.
        ds.setLevel(lvl)
        for handler in ds.handlers:
            handler.setLevel(lvl)
    else:
        warnings.filterwarnings("ignore", category=FutureWarning, module=LIBRARIES)
        # torch's notice that barrier() runs on the current device: DeepSpeed binds no device to a one-rank process
        # group, and finetune.dist.init has set it, so every one-GPU run would print it.
        warnings.filterwarnings("ignore", message=re.escape(BARRIER_NOTICE), category=UserWarning)
        # torch's C++ warnings (c10d's "hostname of the client socket cannot be retrieved" where a loopback address
        # has no reverse DNS entry, once per rank) follow TORCH_CPP_LOG_LEVEL, read when torch is first imported:
        # this process's, if it has not imported torch yet, and every process it starts. Set by hand, it stays.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name in IMPORT_NOTICES:
        logging.getLogger(name).setLevel(logging.ERROR if lvl >= logging.WARNING else logging.NOTSET)
    return lvl


@contextlib.contextmanager
def quiet_stdout(stderr: bool = False) -> Iterator[None]:
    """Hold back what a library prints (DeepSpeed's `... built successfully` of its CPU shm op, once per rank; with
    `stderr`, also what it writes there: its checkpoint loader's progress bars) unless the run is verbose; an
    exception inside still propagates, and what was held back is printed with it."""
    if is_verbose():
        yield
        return
    held, held_err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held_err if stderr else sys.stderr):
            yield
    except BaseException:
        print(held.getvalue(), end="", flush=True)
        print(held_err.getvalue(), end="", file=sys.stderr, flush=True)
        raise


def error_line(message: object) -> str:
    """`zerotune: error: MESSAGE`: the one form of an error a user reads, whichever command or rank met it."""
    return f"{ERROR_PREFIX}{message}"


def error(message: object) -> None:
    """Print error_line(message) on standard error. A run's progress and messages go to standard output, its errors
    here: `> log` keeps the steps, the terminal still shows why a run stopped, `> log 2>&1` keeps both in order."""
    print(error_line(message), file=sys.stderr, flush=True)
