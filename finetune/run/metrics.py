"""Training FLOPs counted exactly for Mistral, throughput, memory, the progress line, and metrics.jsonl (written
and read: the one reader of the file is `read_metrics`).

    log = MetricsLog(output_dir, max_steps, enabled=True); log.write({"step": 1, "loss": 2.3, ...})
    records = read_metrics("runs/x/metrics.jsonl")

FLOPs follow the usual convention (a multiply-add is 2 FLOPs, backward is twice forward, recomputation by
activation checkpointing is not counted, attention scores are counted over the full sample length).
torch is imported only by the functions that ask the device: `zerotune plot` and `compare` read metrics.jsonl
through this module without loading it.
"""

from __future__ import annotations

import json
import os
import resource
import time
from typing import Any

from finetune.run import folder as run_folder
from finetune.run.trackers import build_backends

METRICS_FILE = run_folder.METRICS
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16


def matmul_params(cfg) -> int:
    """Weights used in matrix multiplies per token: grouped-query attention, SwiGLU MLP, lm_head (not the embedding lookup)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q = h * cfg.num_attention_heads * head_dim
    kv = 2 * h * cfg.num_key_value_heads * head_dim
    o = cfg.num_attention_heads * head_dim * h
    mlp = 3 * h * cfg.intermediate_size  # gate, up, down
    return layers * (q + kv + o + mlp) + h * cfg.vocab_size


def training_flops(cfg, sample_lengths: list[int]) -> float:
    """FLOPs of forward + backward over samples of these lengths: 6N per token plus attention scores and values."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    window = getattr(cfg, "sliding_window", None) or 1 << 62
    dense = 6 * matmul_params(cfg) * sum(sample_lengths)
    # QK^T and AV: 2 x 2 x heads x head_dim FLOPs per (query, key) pair, forward; x3 with backward.
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * sum(n * min(n, window) for n in sample_lengths)
    return float(dense + attn)


def peak_tflops() -> float | None:
    """Dense bf16 peak of this GPU, if we know it (MFU is left out otherwise)."""
    import torch  # lazy: see the module docstring

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def rank_unit() -> str:
    """What each rank trains on, for per-rank figures such as tokens/s: a `GPU` under CUDA, else a CPU process
    (`rank`), so that a CPU run's figures are not read as a GPU's."""
    import torch  # lazy: see the module docstring

    return "GPU" if torch.cuda.is_available() else "rank"


def peak_memory_gib() -> float:
    """Peak accelerator memory allocated by this process, or peak resident memory on CPU."""
    import torch  # lazy: see the module docstring

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return peak_host_gib()


def peak_reserved_gib() -> float:
    import torch  # lazy: see the module docstring

    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / 2**30
    return peak_memory_gib()


def peak_host_gib() -> float:
    """Peak resident host memory of this process (KiB on Linux): what checkpoint offload, pinned buffers and CPU Adam
    took from the node."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLog:
    """metrics.jsonl in the run folder (rank 0), the same records to the `log_to` back-ends (TensorBoard, W&B; see
    finetune/run/trackers.py), plus a one-line progress report with tokens/s and ETA. Call close() at the end."""

    def __init__(self, output_dir: str | None, max_steps: int, enabled: bool, start_step: int = 0,
                 log_to: list[str] | None = None, run_config: dict[str, Any] | None = None,
                 wandb_project: str = "zerotune"):
        self.enabled, self.max_steps, self.start_step = enabled, max_steps, start_step
        self.path = os.path.join(output_dir, METRICS_FILE) if output_dir else None
        self.backends = []
        if enabled and log_to and output_dir:
            self.backends = build_backends(log_to, output_dir, run_config, start_step, wandb_project)
        self.t0 = time.perf_counter()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled or self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for backend in self.backends:
            backend.log(record)

    def close(self) -> None:
        """Flush and close the back-ends (TensorBoard buffers events; W&B finishes its run)."""
        for backend in self.backends:
            backend.close()
        self.backends = []

    def progress(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.max_steps - step)
        norm = f"{record['grad_norm']:.3f}" if record.get("grad_norm") is not None else "n/a"
        mfu = f" | MFU {100 * record['mfu']:.1f}%" if record.get("mfu") is not None else ""
        pairs = (f"reward acc {record['accuracy']:.2f} margin {record['reward_margin']:.3f} | "
                 if "accuracy" in record else "")  # a preference objective's step
        print(
            f"step {step}/{self.max_steps} | loss {record['loss']:.4f} | {pairs}lr {record['lr']:.2e} | "
            f"grad_norm {norm} | {record['tokens_per_s']:,.0f} tok/s ({record['tokens_per_s_per_gpu']:,.0f}/{rank_unit()}){mfu} | "
            f"mem {record['peak_mem_gib']:.1f} GiB | ETA {_duration(eta)}",
            flush=True,  # stdout, with every other line of the run: `> train.log` keeps the steps
        )


class MetricsError(ValueError):
    """A metrics.jsonl line that is not JSON; the message names the file and the line."""


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl in file order: step records, and eval records ({"step", "eval_loss"}).
    Blank lines are skipped; a line that is not JSON raises MetricsError naming `path:line`."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise MetricsError(f"{path}:{n}: not a JSON line") from None
    return records


def truncate_metrics(path: str, keep_until: int) -> None:
    """Keep the records of steps <= keep_until (none when 0): a resumed run rewrites what came after its checkpoint."""
    kept = [r for r in read_metrics(path) if r["step"] <= keep_until] if keep_until > 0 and os.path.exists(path) else []
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
