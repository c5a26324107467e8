"""The fault table: bad inputs and faults, each with the exact user-facing message and proof that nothing already
written was lost. docs/troubleshooting.md lists every row (checked below).

Each in-process row runs the real code path (recipe, DeepSpeed JSON, model folder, tokenizer, data pipeline,
hostfile, output-dir checks) against a run folder that already holds a checkpoint, metrics and an export, and then
checks that folder byte for byte. Rows whose fault needs running ranks (a NaN loss here; kill -9, a lost rank, an
unreachable host and a busy port in their own test files) name the test that proves them.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re

import pytest
import torch

from finetune import dist
from finetune.config import ConfigError
from tests.fixtures.fault_table import FAULTS
from tests.helpers import ROOT


def _snapshot(folder) -> dict[str, str]:
    out = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != ".cache"]
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def earlier_run(tmp_path):
    """A run folder holding what an earlier run wrote: a complete checkpoint, a half-written one, metrics, an export."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000006"
    ckpt.mkdir(parents=True)
    (ckpt / "zerotune.json").write_text(json.dumps({"step": 6, "world_size": 1}))
    (ckpt / "engine").mkdir()
    (ckpt / "engine" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(2048))
    (run / "checkpoints" / "step_00000009").mkdir()  # its save never finished
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 7)))
    (run / "export").mkdir()
    (run / "export" / "model.safetensors").write_bytes(os.urandom(4096))
    return run


@pytest.mark.parametrize("fault", [f for f in FAULTS if f.trigger], ids=lambda f: f.id)
def test_fault_gives_its_message_and_loses_nothing(fault, tmp_path, earlier_run, monkeypatch):
    # The rows describe a machine without a GPU (no budget for `auto`, no CUDA for liger): the same on a GPU machine.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "local_gpus", lambda: [])
    before = _snapshot(earlier_run)
    with pytest.raises((ConfigError, ValueError, OSError)) as e:
        fault.trigger(tmp_path, earlier_run)
    assert re.search(fault.message, str(e.value)), f"{fault.id}: {e.value}"
    assert _snapshot(earlier_run) == before, f"{fault.id} changed what was already written"


@pytest.mark.parametrize("fault", [f for f in FAULTS if f.covered_by], ids=lambda f: f.id)
def test_rows_proven_elsewhere_name_a_real_test(fault):
    path, test = fault.covered_by.split("::")
    module = importlib.import_module(path[:-3].replace("/", "."))
    assert callable(getattr(module, test, None)), f"{fault.id}: {fault.covered_by} does not exist"


def test_the_table_has_at_least_20_rows():
    assert len(FAULTS) >= 20 and len({f.id for f in FAULTS}) == len(FAULTS)


def test_troubleshooting_page_lists_every_row():
    """docs/troubleshooting.md has a table row for each fault, its id in the first column."""
    with open(os.path.join(ROOT, "docs", "troubleshooting.md")) as f:
        rows = set(re.findall(r"^\| `([\w-]+)` \|", f.read(), re.M))
    missing = [fault.id for fault in FAULTS if fault.id not in rows]
    assert missing == [], f"docs/troubleshooting.md has no row for {missing}"


