"""Profile one training step (train.profile_step=N): where the step's time goes, by kind of kernel.

    with step_profiler(step + 1 == t.profile_step, t.output_dir, step + 1):
        ... one optimizer step ...

Rank 0 writes `<output_dir>/profile_step{N}.json` and `.txt`: the step's wall time, the device time of each category
(matmul, attention, communication, fused Triton kernels, optimizer, other elementwise/copies) and the top kernels. On
CPU the same is written from CPU op times, so the path is tested without a GPU.

The train loop marks its host phases (`with phase("forward"): ...`: forward, backward, optimizer step). On a GPU
the report says how long the host spent in each, and how much of the device's idle time fell while the host was in
it: the device idles only when the host has not yet queued its next kernel, so that phase is what kept it waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

CATEGORIES = (  # first match wins; lower-case substrings of CUDA kernel names (CPU: aten op names)
    ("communication", ("nccl", "all_reduce", "reduce_scatter", "all_gather", "gloo")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "matmul")),
    ("optimizer", ("adam", "multi_tensor")),
    ("elementwise", ("elementwise", "at::native", "aten::")),
)


PHASE_PREFIX = "zerotune:"
# Device-timeline entries that are not kernels but mirror them (the profiler's annotation of a collective, of an
# optimizer step, of one of zerotune's host phases) or mark a wait (the launch queue full): counting them would
# double the kernels' time.
NOT_KERNELS = ("nccl:", "Optimizer.", "record_param_comms", "Command Buffer Full", PHASE_PREFIX)


def phase(name: str):
    """Mark a host phase of the step for the profiler (a record_function: about a microsecond when none runs)."""
    from torch.profiler import record_function

    return record_function(PHASE_PREFIX + name)


def is_kernel(name: str) -> bool:
    return not name.startswith(NOT_KERNELS)


def category(name: str) -> str:
    """The kind of a kernel; Triton kernels (liger's) are plain function names ending in `_kernel`."""
    low = name.lower()
    found = next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), None)
    if found:
        return found
    return "fused (triton)" if low.endswith("_kernel") and not low.startswith("void ") else "other"


@contextlib.contextmanager
def step_profiler(enabled: bool, output_dir: str, step: int, is_main: bool = True):
    if not enabled:
        yield
        return
    # torch is imported only for a profiled step: the report functions below are pure Python (and tested so)
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if is_main:
        write_report(prof, wall, cuda, output_dir, step)


def _union(intervals) -> list[list[float]]:
    """Overlapping (start, end) intervals merged, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def timeline(kernels: list[tuple[float, float, bool]]) -> dict[str, float]:
    """Where the device's time went, from (start, end, is_communication) intervals in seconds: `compute` while any
    computing kernel runs; `exposed_comm` while only communication runs (overlapped communication costs nothing here,
    though its kernels take SMs from the compute beside them); `idle` while nothing runs (the host is late: launches,
    synchronisations, Python); `span` from the first kernel's start to the last one's end."""
    if not kernels:
        return {"span": 0.0, "compute": 0.0, "exposed_comm": 0.0, "idle": 0.0}
    compute = _union([(s, e) for s, e, comm in kernels if not comm])
    busy = _union([(s, e) for s, e, _ in kernels])
    span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)
    compute_s, busy_s = sum(e - s for s, e in compute), sum(e - s for s, e in busy)
    return {"span": span, "compute": compute_s, "exposed_comm": busy_s - compute_s, "idle": span - busy_s}


def idle_by_phase(kernels: list[tuple[float, float]], phases: list[tuple[str, float, float]]) -> dict[str, float]:
    """The device's idle time (gaps between kernels, from the first kernel's start to the last one's end) split by the
    host phase (name, start, end) that was running during it; idle outside every phase is `other host work`. Phases
    that nest (none of zerotune's do) would count a gap twice."""
    busy = _union(kernels)
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:])]
    split: dict[str, float] = {}
    for start, end in gaps:
        inside = 0.0
        for name, p_start, p_end in phases:
            overlap = min(end, p_end) - max(start, p_start)
            if overlap > 0:
                split[name] = split.get(name, 0.0) + overlap
                inside += overlap
        if end - start - inside > 0:
            split["other host work"] = split.get("other host work", 0.0) + (end - start - inside)
    return dict(sorted(split.items(), key=lambda kv: -kv[1]))


def write_report(prof, wall_s: float, cuda: bool, output_dir: str, step: int) -> dict:
    from torch.autograd import DeviceType  # as in step_profiler: torch only once a step is profiled

    rows = []
    for e in prof.key_averages():
        if cuda:  # the kernels themselves (an op's device time is its kernels': counting both would double it)
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0 and is_kernel(e.key):
                rows.append((e.key, e.self_device_time_total / 1e6, e.count))
        elif e.key.startswith("aten::") and e.self_cpu_time_total > 0:  # CPU ops nest: aten ops only
            rows.append((e.key, e.self_cpu_time_total / 1e6, e.count))
    by_category: dict[str, float] = {}
    for name, seconds, _ in rows:
        by_category[category(name)] = by_category.get(category(name), 0.0) + seconds
    busy = sum(by_category.values())
    events = prof.events()
    device_kernels = [] if not cuda else [
        (e.time_range.start / 1e6, e.time_range.end / 1e6, category(e.name) == "communication")
        for e in events if e.device_type == DeviceType.CUDA and is_kernel(e.name)]
    phases = [(e.name[len(PHASE_PREFIX):], e.time_range.start / 1e6, e.time_range.end / 1e6)
              for e in events if e.device_type == DeviceType.CPU and e.name.startswith(PHASE_PREFIX)]
    host: dict[str, float] = {}
    for name, start, end in phases:
        host[name] = host.get(name, 0.0) + end - start
    report = {
        "step": step, "wall_s": wall_s, "device": "cuda" if cuda else "cpu", "busy_s": busy,
        "timeline_s": timeline(device_kernels),
        "host_phases_s": host,
        "idle_by_phase_s": idle_by_phase([(s, e) for s, e, _ in device_kernels], phases) if device_kernels else {},
        "categories_s": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top": [{"name": n, "s": s, "calls": c, "category": category(n)} for n, s, c in sorted(rows, key=lambda r: -r[1])[:25]],
        # what the host spends its own time on (on CPU the op times above are that already)
        "top_host_ops": [] if not cuda else [
            {"name": e.key, "s": e.self_cpu_time_total / 1e6, "calls": e.count}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
            if e.device_type == DeviceType.CPU and not e.key.startswith(PHASE_PREFIX)],
    }
    base = os.path.join(output_dir, f"profile_step{step}")
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=2)
    lines = [f"profile of step {step}: wall {wall_s:.3f} s, {report['device']} busy {busy:.3f} s "
             f"({busy / wall_s:.0%} of the wall time; kernels on several streams can overlap)", ""]
    lines += [f"  {cat:<16} {s:8.3f} s  {s / wall_s:6.1%}" for cat, s in report["categories_s"].items()]
    t = report["timeline_s"]
    if t["span"]:
        lines += ["", f"device timeline: {t['span']:.3f} s from the first kernel to the last = compute "
                      f"{t['compute']:.3f} s + communication alone {t['exposed_comm']:.3f} s + idle {t['idle']:.3f} s "
                      f"(the profiler slows the host, so idle reads high)"]
    if host:
        lines += ["", "host phases (host time; device idle while the host was in it):"]
        lines += [f"  {name:<16} {seconds:8.3f} s   idle {report['idle_by_phase_s'].get(name, 0.0):.3f} s"
                  for name, seconds in host.items()]
        if "other host work" in report["idle_by_phase_s"]:
            lines += [f"  {'(outside them)':<16} {'':8}     idle {report['idle_by_phase_s']['other host work']:.3f} s"]
    lines += ["", "top kernels (self time):"]
    lines += [f"  {r['s']:8.4f} s  {r['calls']:6d}x  [{r['category']}] {r['name'][:110]}" for r in report["top"]]
    if report["top_host_ops"]:
        lines += ["", "top host ops (self CPU time):"]
        lines += [f"  {r['s']:8.4f} s  {r['calls']:6d}x  {r['name'][:110]}" for r in report["top_host_ops"]]
    with open(base + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    return report
