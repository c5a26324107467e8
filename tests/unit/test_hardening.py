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
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from finetune import dist
from finetune.config import ConfigError
from tests.helpers import ROOT, TINY_RECIPE

ZERO2 = os.path.join(ROOT, "ds_configs", "zero2.json")


@dataclass
class Fault:
    id: str
    what: str  # the situation, as docs/troubleshooting.md lists it
    message: str  # a regex the user-facing message must match
    trigger: Callable | None = None  # (tmp, run_dir) -> raises; None when covered_by a test elsewhere
    covered_by: str = ""
    fix: str = ""  # what docs/troubleshooting.md tells the user to do


def _write(path, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def _data(tmp, lines: list[str], name="data.jsonl") -> str:
    return _write(tmp / name, "\n".join(lines) + "\n")


def _build(tmp, run_dir, data_path: str, *overrides: str):
    """The training data path as train() runs it: recipe, tokenizer, plugins, tokenization into the run's cache."""
    from finetune.config import load_recipe
    from finetune.data import build_datasets
    from finetune.data.tokenizer import load_tokenizer

    recipe = load_recipe(TINY_RECIPE, [f"data.path={data_path}", *overrides])
    build_datasets(recipe.data, load_tokenizer("mistral-common"), 0, os.path.join(run_dir, ".cache"))


def _prepare(run_dir, *overrides: str, ds: str = ZERO2):
    from finetune.train import prepare

    prepare(TINY_RECIPE, ds, [f"train.output_dir={run_dir}", *overrides])


def _ds(tmp, mutate) -> str:
    with open(ZERO2) as f:
        cfg = json.load(f)
    mutate(cfg)
    return _write(tmp / "ds.json", json.dumps(cfg))


def _hostfile(tmp, text: str):
    from finetune.multinode.hostfile import load_hostfile

    load_hostfile(_write(tmp / "hosts", text))


GOOD = '{"instruction": "Say hi.", "output": "Hi!"}'

FAULTS = [
    Fault("malformed-jsonl", "a malformed JSONL line", r"data.jsonl:2: malformed JSON .*fix or remove that line",
          lambda tmp, run: _build(tmp, run, _data(tmp, [GOOD, '{"instruction": "x", "output": '])),
          fix="fix or delete the line named in the message"),
    Fault("missing-field", "a record without a field its format needs", r"data.jsonl:2: missing field 'output'.*alpaca",
          lambda tmp, run: _build(tmp, run, _data(tmp, [GOOD, '{"instruction": "x"}'])),
          fix="add the field, or pick the data.format that matches your records"),
    Fault("wrong-field-type", "a field of the wrong type", r"data.jsonl:1: field 'output' must be string, got integer",
          lambda tmp, run: _build(tmp, run, _data(tmp, ['{"instruction": "x", "output": 3}'])),
          fix="store the field as the type named"),
    Fault("empty-dataset", "an empty dataset", r"the dataset is empty",
          lambda tmp, run: _build(tmp, run, _write(tmp / "empty.jsonl", "\n"))),
    Fault("all-overlong", "every sample longer than data.max_seq_len", r"all 1 records were dropped \(1 longer than data.max_seq_len=8",
          lambda tmp, run: _build(tmp, run, _data(tmp, [GOOD]), "data.max_seq_len=8"),
          fix="raise data.max_seq_len or set data.overlong=truncate"),
    Fault("all-masked", "every sample without a trained token (e.g. truncated before the answer)", r"all 1 records were dropped .*1 with no trained tokens",
          lambda tmp, run: _build(tmp, run, _data(tmp, ['{"instruction": "' + "word " * 20 + '", "output": "Hi!"}']),
                                  "data.max_seq_len=8", "data.overlong=truncate"),
          fix="check data.format; with chat data, each conversation needs an assistant turn"),
    Fault("unknown-format", "an unknown data.format", r"unknown dataset format 'alpacca'; known formats: .*alpaca, .*sharegpt",
          lambda tmp, run: _prepare(run, "data.format=alpacca", "train.resume=auto")),
    Fault("plugin-import", "a data.plugins module that does not import", r"cannot import dataset-format plugin module 'no_such_pkg.formats'",
          lambda tmp, run: _prepare(run, "data.plugins=[no_such_pkg.formats]", "train.resume=auto"),
          fix="install the package or fix the module name in data.plugins"),
    Fault("unknown-key", "an unknown recipe key", r"unknown key 'train.max_step'. Did you mean 'train.max_steps'\?",
          lambda tmp, run: _prepare(run, "train.max_step=3")),
    Fault("wrong-type", "a recipe value of the wrong type", r"train.max_steps must be int, got str 'ten'",
          lambda tmp, run: _prepare(run, "train.max_steps=ten")),
    Fault("leftover-auto", "an \"auto\" in the DeepSpeed JSON that zerotune cannot fill", r"sub_group_size still \"auto\"",
          lambda tmp, run: _prepare(run, "train.resume=auto",
                                    ds=_ds(tmp, lambda c: c["zero_optimization"].update(sub_group_size="auto")))),
    Fault("ds-conflict", "a DeepSpeed JSON value that contradicts the recipe",
          r"sets train_micro_batch_size_per_gpu = 4 but .* gives train.micro_batch_size = 1",
          lambda tmp, run: _prepare(run, "train.resume=auto", ds=_ds(tmp, lambda c: c.update(train_micro_batch_size_per_gpu=4))),
          fix="set the field to \"auto\" in the JSON, or change the recipe"),
    Fault("missing-model", "a model.path that does not exist", r"model.path '/nonexistent/Mistral' does not exist. Download",
          lambda tmp, run: _prepare(run, "model.path=/nonexistent/Mistral")),
    Fault("missing-tokenizer", "a model folder without tokenizer files", r"tokenizer: .*tokenizer",
          lambda tmp, run: _prepare(run, f"model.tokenizer={tmp}", "train.resume=auto"),
          fix="copy tokenizer.model (and tokenizer_config.json) into the model folder, or set model.tokenizer"),
    Fault("output-not-empty", "a non-empty train.output_dir", r"is not empty: choose a new one, pass train.resume=auto",
          lambda tmp, run: _prepare(run)),
    Fault("output-unwritable", "an output dir that cannot be written", r"is not writable",
          lambda tmp, run: _prepare(os.path.join(run, "metrics.jsonl", "sub"))),
    Fault("output-full", "an output dir without room for a checkpoint", r"GiB free but one checkpoint needs about",
          lambda tmp, run: __import__("finetune.checkpoint", fromlist=["x"]).check_output_dir(str(run), 1 << 62),
          fix="free space, choose another folder, or set train.save_every=0"),
    Fault("half-written-resume", "resuming from a checkpoint whose save never finished", r"not a complete zerotune checkpoint",
          lambda tmp, run: _prepare(run, f"train.resume={run}/checkpoints/step_00000009")),
    Fault("budget-too-small", "a GPU memory budget nothing fits", r"train.gpu_memory_gib=0.001: nothing fits 90% of it; the smallest is ds_configs/",
          lambda tmp, run: _prepare(run, "train.gpu_memory_gib=0.001", "train.resume=auto", ds="auto"),
          fix="lower data.max_seq_len, use LoRA, add GPUs, or offload to NVMe (ds_configs/zero3_nvme.json)"),
    Fault("auto-without-budget", "--deepspeed auto on a machine without a GPU and no budget",
          r"set train.gpu_memory_gib \(GiB per GPU\), or pass --deepspeed ds_configs/zero3.json",
          lambda tmp, run: _prepare(run, "train.resume=auto", ds="auto")),
    Fault("sp-degree", "a train.sequence_parallel that does not divide the ranks",
          r"train.sequence_parallel=3 does not divide the 1 rank\(s\) of this run into groups: set it to one of 1, or "
          r"launch a multiple of 3 ranks",
          lambda tmp, run: _prepare(run, "train.sequence_parallel=3", "train.resume=auto"),
          fix="a divisor of the number of GPUs (and of the model's 32 attention heads), or launch a multiple of it"),
    Fault("host-memory-short", "offloaded states larger than the node's CPU memory",
          r"offloads .* GiB per node to CPU memory .* but this node has .*set train.cpu_memory_gib",
          lambda tmp, run: _prepare(run, "train.cpu_memory_gib=0.001", "train.resume=auto",
                                    ds=os.path.join(ROOT, "ds_configs", "zero2_offload.json")),
          fix="more GPUs or nodes (each holds a share), LoRA, or NVMe offload; train.cpu_memory_gib if the node really has more"),
    Fault("nvme-path-missing", "NVMe offload without train.nvme_path", r"zero3_nvme.json offloads to NVMe: set train.nvme_path=",
          lambda tmp, run: _prepare(run, "train.resume=auto", ds=os.path.join(ROOT, "ds_configs", "zero3_nvme.json")),
          fix="set train.nvme_path to a folder on a local NVMe disk"),
    Fault("liger-unavailable", "model.kernels=liger without liger-kernel or a CUDA GPU",
          r"model.kernels=liger: (liger-kernel is not installed \(pip install liger-kernel\)|liger-kernel's Triton kernels "
          r"need a CUDA GPU); set "
          r"model.kernels=auto \(liger when available\) or none",
          lambda tmp, run: _prepare(run, "train.resume=auto", "model.kernels=liger"),
          fix="pip install liger-kernel on a CUDA machine, or model.kernels=auto"),
    Fault("fused-loss-lora-head", "LoRA on lm_head with the fused loss",
          r"model.fused_loss computes the loss inside the output layer, which LoRA on lm_head replaces: set "
          r"model.fused_loss=false or drop lm_head from lora.target_modules",
          lambda tmp, run: _prepare(run, "train.resume=auto", "lora.enabled=true", "lora.target_modules=[q_proj,lm_head]"),
          fix="as the message says"),
    Fault("missing-hostfile", "a hostfile that does not exist", r"not found",
          lambda tmp, run: __import__("finetune.multinode.hostfile", fromlist=["x"]).load_hostfile(str(tmp / "nope"))),
    Fault("malformed-hostfile", "a malformed hostfile line", r"hosts:2: expected `HOST slots=N`",
          lambda tmp, run: _hostfile(tmp, "node1 slots=2\nnode2 slot=2\n")),
    Fault("duplicate-host", "a host listed twice in the hostfile", r"hosts:2: node1 is listed twice",
          lambda tmp, run: _hostfile(tmp, "node1 slots=2\nnode1 slots=4\n")),
    Fault("unreachable-host", "a host that ssh cannot reach", r"named within 10 s",
          covered_by="tests/integration/test_launcher.py::test_preflight_names_unreachable_hosts_within_10s",
          fix="check `ssh -o BatchMode=yes HOST true` from the launching machine"),
    Fault("busy-port", "a master port that is already in use", r"port",
          covered_by="tests/unit/test_launcher.py::test_preflight_refuses_a_busy_master_port",
          fix="pass another --master-port, or stop what holds it"),
    Fault("nan-loss", "a NaN or inf loss", r"non-finite loss at step 2: samples .* The state before this step is saved in",
          covered_by="tests/integration/test_hardening.py::test_nan_loss_stops_with_samples_and_a_checkpoint",
          fix="lower optim.lr or fix the samples named, then train.resume=auto"),
    Fault("kill-9-training", "kill -9 of the training processes", r"resume",
          covered_by="tests/integration/test_checkpoint.py::test_kill_9_then_resume_continues_the_uninterrupted_curve",
          fix="run again with train.resume=auto"),
    Fault("kill-9-save", "kill -9 in the middle of a checkpoint save", r"resume",
          covered_by="tests/integration/test_checkpoint.py::test_kill_9_then_resume_continues_the_uninterrupted_curve",
          fix="run again with train.resume=auto: the half-written checkpoint is ignored"),
    Fault("lost-rank", "a rank lost mid-run", r"rank .* on .* was killed",
          covered_by="tests/integration/test_launcher.py::test_killed_rank_ends_job_within_60s_naming_it",
          fix="see the named host's log; resume with train.resume=auto"),
    # Round two: one run per folder, resume checks, data input, disk, hostfiles, exports (each proven in its own file)
    Fault("run-folder-in-use", "a second run into a folder a live run holds, fresh or resumed", r"is in use by another run",
          covered_by="tests/integration/test_run_folder.py::test_two_runs_started_together_one_trains_the_other_is_refused_naming_it",
          fix="wait for that run or stop it, or choose another train.output_dir"),
    Fault("stale-run-lock", "the lock file of a run that was killed", r"took over the lock of a run that is gone",
          covered_by="tests/unit/test_folder_lock.py::test_second_run_is_refused_then_takes_over_once_the_holder_is_killed",
          fix="nothing: the new run takes the folder over"),
    Fault("resume-changes-parameters", "a resume whose recipe changes the parameters",
          r"was trained with other parameters than this recipe builds",
          covered_by="tests/integration/test_run_folder.py::test_resume_with_lora_flipped_is_refused_and_writes_nothing",
          fix="change those settings back, or start a new run in another train.output_dir"),
    Fault("resume-safe-changes", "a resume with settings changed that leave the parameters alone",
          r"with these settings changed \(none alters the parameters\)",
          covered_by="tests/integration/test_run_folder.py::test_resume_with_another_lr_is_allowed_and_the_change_listed",
          fix="nothing: the changes are listed and used"),
    Fault("data-error-ranks", "a data error in a run of several ranks", r"data.jsonl:\d+: malformed JSON",
          covered_by="tests/integration/test_data_errors.py::test_a_malformed_line_is_one_error_naming_file_and_line",
          fix="fix the line and run the same command again"),
    Fault("utf8-bom", "a UTF-8 file with a byte-order mark", r"",
          covered_by="tests/unit/test_data_input.py::test_a_byte_order_mark_is_read_as_no_mark", fix="nothing"),
    Fault("not-utf8", "bytes that are not UTF-8", r":\d+:\d+: byte 0x.. is not UTF-8",
          covered_by="tests/unit/test_data_input.py::test_bytes_that_are_not_utf8_are_named_by_line_and_column",
          fix="save the file as UTF-8"),
    Fault("json-array-as-jsonl", "a JSON array saved as .jsonl", r"rename it to .*\.json",
          covered_by="tests/unit/test_data_input.py::test_a_json_array_saved_as_jsonl_is_named_and_json_suggested",
          fix="rename the file to .json"),
    Fault("jsonl-as-json", "JSON Lines saved as .json", r"rename it to .*\.jsonl",
          covered_by="tests/unit/test_data_input.py::test_json_lines_saved_as_json_is_named_and_jsonl_suggested",
          fix="rename the file to .jsonl"),
    Fault("folder-not-dataset", "a data.path folder that save_to_disk did not write", r"is not a dataset saved by",
          covered_by="tests/unit/test_data_input.py::test_a_folder_that_is_not_a_saved_dataset_lists_what_zerotune_reads",
          fix="point data.path at a file, or save the dataset with save_to_disk"),
    Fault("unknown-data-suffix", "a data file of a type zerotune does not read", r"unknown data file type",
          covered_by="tests/unit/test_data_input.py::test_an_unknown_suffix_lists_what_zerotune_reads",
          fix="convert the file to one of the types listed"),
    Fault("unreadable-table", "a CSV, Parquet or Arrow file its reader cannot parse", r"not a readable csv file",
          covered_by="tests/unit/test_data_input.py::test_an_unreadable_csv_is_a_data_error",
          fix="fix the file or write it again"),
    Fault("disk-full-save", "the disk fills up while a checkpoint is written", r"the disk is full",
          covered_by="tests/integration/test_disk_full.py::test_a_full_disk_ends_the_save_cleanly_and_the_last_checkpoint_resumes",
          fix="free space, lower train.keep_last or move the run folder, then train.resume=auto"),
    Fault("output-full-keep-last", "a run folder without room for the checkpoints that exist at once",
          r"checkpoints need about",
          covered_by="tests/unit/test_checkpoint.py::test_space_check_counts_the_checkpoints_that_exist_at_once",
          fix="free space, another train.output_dir, a lower train.keep_last, or train.save_every=0"),
    Fault("hostfile-one-machine-twice", "two hostfile lines that reach one machine", r"are one machine",
          covered_by="tests/unit/test_launcher.py::test_one_machine_under_two_names_is_refused",
          fix="keep one line for that machine, with all its slots"),
    Fault("hostfile-brackets", "brackets around something that is not an IPv6 address", r"brackets hold an IPv6 address",
          covered_by="tests/unit/test_launcher.py::test_bracketed_ipv6_is_read_bare_and_local", fix="drop the brackets"),
    Fault("export-nothing-to-export", "zerotune export on a folder with neither a checkpoint nor a final export",
          r"has neither a complete checkpoint",
          covered_by="tests/integration/test_export_run.py::test_a_folder_with_neither_says_what_it_lacks",
          fix="give the folder of a finished run"),
    Fault("merge-full-fine-tune", "zerotune export --merge of a full fine-tune", r"there is no adapter to merge",
          covered_by="tests/integration/test_export_run.py::test_merge_of_a_full_run_is_refused",
          fix="drop --merge: the export is already a complete HF model"),
    Fault("merge-random-init-base", "--merge of a LoRA run on a random-init base without checkpoints", r"has no weights",
          covered_by="tests/integration/test_export_run.py::test_merge_onto_a_random_init_base_is_refused",
          fix="train with train.save_every>0 and export a checkpoint with --merge"),
    Fault("doctor-node-down", "zerotune launch --doctor with a node whose sshd is down", r"FAIL .* reach",
          covered_by="tests/integration/test_launcher.py::test_doctor_names_a_node_whose_sshd_is_down_within_30s",
          fix="start sshd on that node or fix its name"),
    Fault("doctor-lost-rank", "a doctor rank that never answers or is lost", r"no answer|was lost",
          covered_by="tests/unit/test_doctor.py::test_silent_and_lost_ranks_are_named",
          fix="look at the named rank's node; --doctor-timeout changes the wait"),
    Fault("doctor-wrong-ifname", "NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME naming no interface of the node",
          r"names no interface of this node",
          covered_by="tests/unit/test_doctor.py::test_interface_names_as_nccl_and_gloo_read_them",
          fix="set it to the interface that reaches the other nodes, or unset it"),
    Fault("doctor-tcp-fallback", "NCCL on TCP sockets between nodes that have InfiniBand/RoCE devices",
          r"fell back to TCP sockets",
          covered_by="tests/unit/test_doctor.py::test_socket_fallback_between_nodes_is_flagged",
          fix="fix the IB stack or NCCL_IB_HCA"),
    Fault("stalled-rank", "a rank that stops responding mid-run", r"stalled: no progress",
          covered_by="tests/integration/test_stall.py::test_stopped_rank_ends_the_run_named_with_its_phase",
          fix="look at the named process (ps, py-spy dump), then train.resume=auto"),
    Fault("rank-behind-in-collective", "a rank that never reaches a collective the others wait in", r"is behind",
          covered_by="tests/integration/test_stall.py::test_checkpoint_resumes_and_a_rank_asleep_in_a_collective_is_named",
          fix="read the named rank's stack file, then train.resume=auto"),
    Fault("damaged-checkpoint", "a checkpoint file truncated or changed after its save (a copy cut short, a disk error)",
          r"skipping checkpoint .*: it does not match its manifest.json: .*: truncated \(.* of .* bytes\); checking the one before",
          covered_by="tests/integration/test_verified_resume.py::test_resume_auto_skips_the_truncated_checkpoint_and_continues_the_one_before",
          fix="nothing for train.resume=auto (it resumes the checkpoint before); if none verifies, restore the named files or move those checkpoints aside"),
]


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


