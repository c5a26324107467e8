"""What this rank is doing right now, for the stall watchdog (finetune/run/watchdog.py): the step, the micro-batch, the
phase and the last collective it entered, each kept by plain assignments in memory (no I/O, no lock).

    from finetune.run.activity import ACTIVITY
    ACTIVITY.start_step(13); ACTIVITY.mark("forward", micro=0); ACTIVITY.step_done(13, seconds)

`install()` wraps torch.distributed's collectives (what zerotune and DeepSpeed call) with a recorder that notes
"entered X" before and "returned" after each call; `uninstall()` puts the originals back. The test hook
ZEROTUNE_TEST_STALL="rank=1,step=3,in=all_reduce[,phase=save]" makes that rank sleep inside that collective (after
recording its entry, before passing it to the backend), for the tests of the watchdog; it is read only here.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

# Phases whose start counts as progress: each is a unit of work of its own, not part of a step (an eval also counts
# each of its micro-batches). Steps count when they finish.
TICKING = ("eval", "save", "sample", "export", "finish")
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "reduce", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv",
)
TEST_HOOK = "ZEROTUNE_TEST_STALL"
STEP_TIMES_KEPT = 50


class Activity:
    """The record of this process. Written by the training thread, read by the watchdog thread (a read may see a
    field one assignment old, which a report a stall later does not mind)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        now = time.monotonic()
        self.step = 0
        """The step being worked on (from 1), or the last one finished while its eval or save runs."""
        self.done = 0
        """The last step finished in this run (0: none yet)."""
        self.micro: int | None = None
        self.phase = "start"
        self.phase_since = now
        self.last_progress = now
        """When a step last finished or a ticking phase (or eval micro-batch) last began."""
        self.step_times: list[float] = []
        self.collective = ""
        self.state = ""
        """entered (not yet passed to the backend), waiting (in the backend), returned, async (returned; its work
        is waited on later), raised."""
        self.issued = 0
        """Collectives passed to the backend so far: ranks that have issued fewer are behind."""
        self.depth = 0

    def start_step(self, step: int) -> None:
        self.step, self.micro = step, None

    def mark(self, phase: str, micro: int | None = None) -> None:
        now = time.monotonic()
        if phase != self.phase:
            self.phase_since = now
        self.phase, self.micro = phase, micro
        if phase in TICKING:
            self.last_progress = now

    def step_done(self, step: int, seconds: float) -> None:
        self.done = step
        self.step_times = self.step_times[1 - STEP_TIMES_KEPT:] + [seconds]
        self.last_progress = time.monotonic()

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"step": self.step, "done": self.done, "micro": self.micro, "phase": self.phase,
                "phase_for_s": round(now - self.phase_since, 1), "collective": self.collective, "state": self.state,
                "issued": self.issued, "idle_s": round(now - self.last_progress, 1)}


ACTIVITY = Activity()
_originals: dict[tuple[Any, str], Any] = {}


def install() -> None:
    """Wrap the collectives of torch.distributed (and the ones DeepSpeed's backend took references to at its start)
    with the recorder; idempotent."""
    import torch.distributed as dist  # lazy: the progress marks are set in processes that never start a group
    from torch.distributed import distributed_c10d

    if _originals:
        return
    hook = _parse_hook(os.environ.get(TEST_HOOK))
    wrapped: dict[int, Any] = {}  # one wrapper per function, however many modules hold it
    for module in (dist, distributed_c10d):
        for name in COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is not None:
                _originals[(module, name)] = fn
                setattr(module, name, wrapped.setdefault(id(fn), _recorded(name, fn, hook)))
    backend = _deepspeed_backend()
    for attr in ("all_gather_function", "reduce_scatter_function"):
        fn = getattr(backend, attr, None)
        if fn is not None and hasattr(dist, fn.__name__):
            _originals[(backend, attr)] = fn
            setattr(backend, attr, getattr(dist, fn.__name__))


def uninstall() -> None:
    for (owner, name), fn in _originals.items():
        setattr(owner, name, fn)
    _originals.clear()


def _deepspeed_backend():
    """DeepSpeed's communication backend of this process, if it started one."""
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None)


def _recorded(name: str, fn, hook: dict[str, Any] | None):
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        p = ACTIVITY
        if p.depth:  # called by another collective (all_gather_object's all_gather): recorded as that one
            return fn(*args, **kwargs)
        p.depth = 1
        p.collective, p.state = name, "entered"
        try:
            if hook is not None and _hook_matches(hook, name):
                while True:  # until the watchdog ends the process
                    time.sleep(1.0)
            p.issued += 1
            p.state = "waiting"
            out = fn(*args, **kwargs)
            p.state = "async" if kwargs.get("async_op") else "returned"
            return out
        except BaseException:
            p.state = "raised"
            raise
        finally:
            p.depth = 0

    return recorded


def _parse_hook(text: str | None) -> dict[str, Any] | None:
    """ZEROTUNE_TEST_STALL="rank=R,step=S,in=COLLECTIVE[,phase=P]" -> {"rank": R, "step": S, "in": ..., "phase": P}."""
    if not text:
        return None
    usage = f"{TEST_HOOK}={text!r}: write rank=R,step=S,in=COLLECTIVE[,phase=PHASE] (a test hook), e.g. rank=1,step=3,in=all_reduce"
    try:
        spec = dict(item.split("=", 1) for item in text.split(","))
        hook = {"rank": int(spec.pop("rank")), "step": int(spec.pop("step")), "in": spec.pop("in"),
                "phase": spec.pop("phase", None)}
    except (KeyError, ValueError):
        raise ValueError(usage) from None
    if spec or hook["in"] not in COLLECTIVES:
        raise ValueError(usage)
    return hook


def _hook_matches(hook: dict[str, Any], name: str) -> bool:
    return (name == hook["in"] and ACTIVITY.step == hook["step"] and int(os.environ.get("RANK", "0")) == hook["rank"]
            and hook["phase"] in (None, ACTIVITY.phase))
