"""Export a trained model: an HF folder (sharded safetensors) for full runs, a LoRA adapter, or LoRA merged into the base.

    export_module(engine.module, "runs/x/export", tokenizer, lora=True)          # inside training, every rank calls it
    zerotune export runs/x --out /tmp/merged --merge                           # offline, from a finished run
    zerotune export runs/x --out /tmp/merged --merge --overwrite               # replace what /tmp/merged holds

`zerotune export RUN` takes the run's newest complete checkpoint, else its final export (RUN/export, written at the end
of training while train.export is on: the HF model of a full run, the adapter of a LoRA run), so a run trained with
train.save_every=0 exports too. A checkpoint's files are checked against its manifest.json before any is read: a
damaged one is refused, naming its bad files. Parameters are gathered one decoder layer at a time (ZeRO-3
`GatheredParameters`), copied to CPU by rank 0 and written in shards, so no rank ever holds the whole model at once.
The folder is written under `<out>.tmp` and renamed into place when complete; its tokenizer loads with AutoTokenizer
and carries the chat template the run trained on (finetune/export/tokenizer.py). `zerotune export` refuses an --out
folder that holds anything unless --overwrite; then what was there stays until the new export is complete, and a
failed export leaves it as it was. What DeepSpeed's and transformers' loaders print (DeepSpeed's checkpoint lines, the
progress bars) appears only with --verbose.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
from collections import defaultdict

import deepspeed
import torch
import yaml
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import save_file

from finetune import dist
from finetune.checkpoint import ENGINE_TAG, MARKER, STEP_DIR, complete_checkpoints, find_latest, manifest, saved_meta
from finetune.config import ConfigError, load_recipe
from finetune.data.tokenizer import load_tokenizer
from finetune.ds_config import bf16_enabled, zero_stage
from finetune.export.tokenizer import write_tokenizer
from finetune.model.build import build_model
from finetune.model.folder import has_weights
from finetune.run import console, folder as run_folder

SHARD_BYTES = 2 * 2**30
LAYER = re.compile(r"\.layers\.(\d+)\.")


def hf_name(name: str) -> str:
    """peft's wrapped parameter name -> the plain transformers name."""
    return name.replace("base_model.model.", "", 1).replace(".base_layer.", ".")


def _groups(module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    by_layer: dict[str, list] = defaultdict(list)
    for name, p in module.named_parameters():
        m = LAYER.search(name)
        by_layer[m.group(1) if m else "rest"].append((name, p))
    return [by_layer[k] for k in sorted(by_layer, key=lambda k: (k == "rest", int(k) if k.isdigit() else 0))]


def _gathered(params):
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class _ShardWriter:
    def __init__(self, folder: str, prefix: str):
        self.folder, self.prefix = folder, prefix
        self.current: dict[str, torch.Tensor] = {}
        self.size, self.files, self.weight_map = 0, [], {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.current[name] = tensor.contiguous()
        self.size += tensor.numel() * tensor.element_size()
        if self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.current:
            return
        path = os.path.join(self.folder, f"part-{len(self.files):05d}.safetensors")
        save_file(self.current, path, metadata={"format": "pt"})
        self.files.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> None:
        self.flush()
        if len(self.files) == 1:
            os.rename(self.files[0][0], os.path.join(self.folder, f"{self.prefix}.safetensors"))
            return
        n = len(self.files)
        for i, (path, names) in enumerate(self.files, start=1):
            final = f"{self.prefix}-{i:05d}-of-{n:05d}.safetensors"
            os.rename(path, os.path.join(self.folder, final))
            self.weight_map.update({name: final for name in names})
        with open(os.path.join(self.folder, f"{self.prefix}.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": self.weight_map}, f, indent=2)


def export_module(module, out: str, tokenizer, lora: bool, merge: bool = False, dtype: torch.dtype | None = None) -> str:
    """Write `out` from a (possibly ZeRO-3 partitioned) model; every rank must call this."""
    if lora and merge and any("weight_fp8" in m._buffers for m in module.modules()):
        # model.precision=fp8 kept only the base's FP8 copy (finetune/perf/precision.py): never merge into that
        raise ConfigError(f"cannot write {out!r}: this model's LoRA base weights are held in FP8 only; merge from the "
                          f"bf16 base instead: zerotune export RUN_FOLDER --out {out} --merge")
    tmp = f"{out}.tmp"
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    try:
        _write_module(module, tmp, tokenizer, lora, merge, dtype)
    except BaseException:
        if dist.is_main():  # a failed export leaves no half-written folder, and `out` as it was
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_main():
        _put_in_place(tmp, out)
    dist.barrier()
    return out


def _write_module(module, tmp: str, tokenizer, lora: bool, merge: bool, dtype: torch.dtype | None) -> None:
    """The export's files in `tmp` (rank 0 writes; every rank takes part in the ZeRO-3 gathers)."""
    adapter_only = lora and not merge
    writer = _ShardWriter(tmp, "adapter_model" if adapter_only else "model")
    for group in _groups(module):
        if adapter_only:  # never gather the frozen base just to write the adapters
            group = [(name, p) for name, p in group if "lora_" in name]
        with _gathered([p for _, p in group]):
            if not dist.is_main():
                continue
            tensors = {name: p.detach().to("cpu", copy=True) for name, p in group}
            if adapter_only:
                for name, t in tensors.items():
                    if "lora_" in name:  # peft's file format drops the adapter name
                        writer.add(name.replace(".default.", "."), t if dtype is None else t.to(dtype))
                continue
            if lora:
                _merge_lora(module, tensors)
            for name, t in tensors.items():
                if "lora_" not in name:
                    writer.add(hf_name(name), t if dtype is None else t.to(dtype))
    if dist.is_main():
        writer.close()
        base = module.base_model.model if lora else module
        if adapter_only:
            module.peft_config["default"].save_pretrained(tmp)
        else:
            config = base.config
            config.use_cache = True
            config.save_pretrained(tmp)
        write_tokenizer(tokenizer, tmp)


def _put_in_place(tmp: str, out: str) -> None:
    """Rename the complete `tmp` to `out`. An `out` already there (--overwrite, or a run's own export/ written again) is
    moved aside first and removed only once the new folder is in place: an error in between leaves it where it was."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    old = f"{out}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    else:
        os.remove(old)


def _merge_lora(module, tensors: dict[str, torch.Tensor]) -> None:
    """W <- W + scaling * B @ A for every LoRA pair of this layer, in float32, in the base weight's dtype."""
    for name in [n for n in tensors if n.endswith("lora_A.default.weight")]:
        prefix = name[: -len(".lora_A.default.weight")]
        base_key = f"{prefix}.base_layer.weight"
        a, b = tensors[name].float(), tensors[f"{prefix}.lora_B.default.weight"].float()
        scaling = module.get_submodule(prefix).scaling["default"]
        merged = tensors[base_key].float() + scaling * (b @ a)
        tensors[base_key] = merged.to(tensors[base_key].dtype)


def export_engine(engine, out: str, tokenizer, lora: bool, merge: bool = False) -> str:
    """Export from a live engine. ZeRO-3 may still hold parameters gathered (or prefetched, in flight) by the last
    forward, e.g. a sample generation; they are released first, or gathering them again fails."""
    if hasattr(engine, "empty_partition_cache"):
        engine.empty_partition_cache()
    return export_module(engine.module, out, tokenizer, lora, merge=merge)


def export_checkpoint(checkpoint_path: str, out: str, merge: bool) -> str:
    """Offline export of a saved checkpoint, in this one process, from the engine's own fp32 master weights. Its
    files are checked against its manifest first: a damaged checkpoint is refused, naming its bad files."""
    _verify(checkpoint_path)
    meta = saved_meta(checkpoint_path)
    recipe, ds = meta["recipe"], meta["ds_config"]
    if merge and not recipe["lora"]["enabled"]:
        raise ConfigError(_nothing_to_merge(checkpoint_path))
    tmp_recipe = os.path.join(os.path.dirname(checkpoint_path), f".export-recipe-{os.getpid()}.yaml")
    with open(tmp_recipe, "w") as f:
        yaml.safe_dump(recipe, f)
    try:
        r = load_recipe(tmp_recipe, ["model.activation_checkpointing=none"])
    finally:
        os.remove(tmp_recipe)
    plain = {"bf16": {"enabled": False}, "zero_optimization": {"stage": 0}}
    with console.quiet_stdout(stderr=True):  # the loaders' lines and progress bars: --verbose shows them
        model, _ = build_model(r.model, r.lora, plain)
        if zero_stage(ds) == 0:
            state = torch.load(os.path.join(checkpoint_path, ENGINE_TAG, "mp_rank_00_model_states.pt"),
                               map_location="cpu", weights_only=False)["module"]
        else:
            state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_path, tag=ENGINE_TAG)
        missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if r.lora.enabled is False or "lora_" in m]:
        raise RuntimeError(f"{checkpoint_path}: checkpoint does not match the recipe's model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    tokenizer = load_tokenizer(r.model.tokenizer or r.model.path)
    dtype = torch.bfloat16 if bf16_enabled(ds) else torch.float32
    return export_module(model, out, tokenizer, r.lora.enabled, merge=merge, dtype=dtype)


def _verify(checkpoint_path: str) -> None:
    """Every file of the checkpoint as its save wrote it (size and checksum), else a ConfigError naming the bad ones."""
    problems = manifest.verify(checkpoint_path)
    if not problems:
        if not manifest.has_manifest(checkpoint_path):
            print(manifest.unverified_note(checkpoint_path), file=sys.stderr, flush=True)
        return
    run_dir = os.path.dirname(os.path.dirname(os.path.normpath(checkpoint_path)))
    steps = [s for s, p in complete_checkpoints(run_dir) if os.path.normpath(p) != os.path.normpath(checkpoint_path)]
    raise ConfigError(f"{checkpoint_path!r} does not match its {manifest.MANIFEST}, its files changed after the save: "
                      f"{manifest.summary(problems)}. Restore the files named from a copy, or export another checkpoint "
                      f"with --step N (other complete checkpoints: {', '.join(map(str, steps)) or 'none'})")


def export_final(run_dir: str, out: str, merge: bool) -> str:
    """The run's final export (RUN/export) copied to `out`; with `merge`, its LoRA adapter merged into the base model
    the run trained on (model.path of RUN/recipe.yaml), in the run's dtype."""
    src = os.path.join(run_dir, "export")
    lora = os.path.isfile(os.path.join(src, "adapter_config.json"))
    if merge and not lora:
        raise ConfigError(_nothing_to_merge(src))
    if os.path.realpath(out) == os.path.realpath(src):
        raise ConfigError(f"--out {out!r} is the run's export itself: choose another folder")
    if not merge:
        tmp = f"{out}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(src, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _put_in_place(tmp, out)
        return out
    r, ds = _run_recipe(run_dir)
    if r.model.random_init or not has_weights(r.model.path):
        raise ConfigError(f"{src!r}: the run's base model {r.model.path!r} has no weights (it was a random init), so "
                          f"the adapter cannot be merged into the base it trained on; export a checkpoint instead "
                          f"(train.save_every > 0)")
    # Lazy: peft is slow to import and only a merge of an adapter folder needs it here.
    from peft import PeftModel

    plain = {"bf16": {"enabled": False}, "zero_optimization": {"stage": 0}}
    with console.quiet_stdout(stderr=True):  # the loaders' progress bars: --verbose shows them
        base, _ = build_model(r.model, dataclasses.replace(r.lora, enabled=False), plain)
        model = PeftModel.from_pretrained(base, src)
    tokenizer = load_tokenizer(r.model.tokenizer or r.model.path)
    dtype = torch.bfloat16 if bf16_enabled(ds) else torch.float32
    return export_module(model, out, tokenizer, lora=True, merge=True, dtype=dtype)


def _run_recipe(run_dir: str):
    """The recipe and DeepSpeed JSON a run folder was trained with (train.py writes both at its start)."""
    recipe_file, ds_file = run_folder.path(run_dir, run_folder.RECIPE), run_folder.path(run_dir, run_folder.DS_CONFIG)
    for path in (recipe_file, ds_file):
        if not os.path.isfile(path):
            raise ConfigError(f"{path!r} is missing: a run writes it at its start, and a merge needs it to rebuild "
                              f"the base model")
    with open(ds_file) as f:
        ds = json.load(f)
    return load_recipe(recipe_file, ["model.activation_checkpointing=none"]), ds


def _nothing_to_merge(what: str) -> str:
    return (f"--merge: {what!r} is a full fine-tune (lora.enabled=false): its weights are the whole model and there "
            f"is no adapter to merge; export it without --merge")


def _source(run_dir: str, step: int | None) -> tuple[str, bool]:
    """(the checkpoint to export, True), or (the run folder, False) when its final export is what there is."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir!r} does not exist: give a run folder (train.output_dir) or one of its "
                          f"checkpoints/step_* folders")
    if step is not None:
        path = os.path.join(run_dir, "checkpoints", f"step_{step:08d}")
        if not os.path.isfile(os.path.join(path, MARKER)):
            steps = [s for s, _ in complete_checkpoints(run_dir)]
            raise ConfigError(f"--step {step}: {run_dir!r} has no complete checkpoint of that step (complete "
                              f"checkpoints: {', '.join(map(str, steps)) or 'none'})")
        return path, True
    if STEP_DIR.match(os.path.basename(os.path.normpath(run_dir))):
        if not os.path.isfile(os.path.join(run_dir, MARKER)):
            raise ConfigError(f"{run_dir!r} is not a complete checkpoint (no {MARKER}: its save never finished); "
                              f"give the run folder to take its newest complete one")
        return run_dir, True
    latest = find_latest(run_dir)
    if latest is not None:
        return latest, True
    if os.path.isdir(os.path.join(run_dir, "export")):
        return run_dir, False
    if any(os.path.isfile(os.path.join(run_dir, f)) for f in ("adapter_config.json", "config.json")):
        raise ConfigError(f"{run_dir!r} is already an exported model (AutoModelForCausalLM or peft load it as it "
                          f"is); to copy or merge it, give its run folder, the folder above it")
    raise ConfigError(f"{run_dir!r} has neither a complete checkpoint (checkpoints/step_*/{MARKER}) nor a final "
                      f"export (export/): a run writes export/ when it finishes (train.export=true) and "
                      f"checkpoints every train.save_every steps; give the folder of a finished run")


def _check_out(out: str, sources: list[str], overwrite: bool) -> None:
    """Refuse an --out that would lose something: a folder that holds files (unless --overwrite), a file, or the
    folder of what is exported or one above it (even with --overwrite)."""
    real = os.path.realpath(out)
    for source in sources:
        if os.path.realpath(source) == real or os.path.realpath(source).startswith(real + os.sep):
            raise ConfigError(f"--out {out!r} holds {source!r}, which this export reads; writing there would replace "
                              f"it: choose another folder")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out!r} is a file, not a folder: choose a folder to write (a new one, or an empty "
                          f"one)")
    if not os.path.isdir(out) or overwrite:
        return
    held = sorted(os.listdir(out))
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(f"--out {out!r} is not empty (it holds {shown}): choose another folder, or pass --overwrite "
                          f"to replace it (its files stay until the new export is complete)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotune export", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a run folder (its newest complete checkpoint, else its final export/) or a "
                                   "checkpoint folder")
    p.add_argument("--step", type=int, default=None, help="export the checkpoint of this step")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--merge", action="store_true", help="LoRA runs: write the base model with the adapters merged in")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what the --out folder holds (kept until the new export is complete)")
    p.add_argument("--verbose", action="store_true",
                   help="also print what DeepSpeed's and transformers' loaders print (the same as ZEROTUNE_LOG=info)")
    args = p.parse_args(argv)
    console.setup(args.verbose)
    try:
        path, is_checkpoint = _source(args.run_dir, args.step)
        _check_out(args.out, [args.run_dir, path if is_checkpoint else os.path.join(path, "export")], args.overwrite)
        if is_checkpoint:
            done, origin = export_checkpoint(path, args.out, args.merge), path
        else:
            done, origin = export_final(path, args.out, args.merge), os.path.join(path, "export")
    except ConfigError as e:
        console.error(e)
        return 2
    print(f"exported {done} from {origin}")
    return 0
