"""Typed recipe: dataclass defaults are the real Mistral-7B LoRA run; a YAML recipe and `key=value` overrides change them.

    recipe = load_recipe("recipes/tiny.yaml", ["train.max_steps=20", "lora.rank=8"])

Unknown keys and wrong types fail at once, naming the key, the valid choices and where it was written: the recipe
file, or a command-line override. The DeepSpeed JSON is resolved against the recipe in `finetune/ds_config.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

import yaml

from finetune import shipped


class ConfigError(ValueError):
    """A recipe or DeepSpeed config the user must fix; the message says what and how."""


@dataclass
class ModelConfig:
    path: str = "models/Mistral-7B-v0.1"
    """Local folder with config.json (+ safetensors weights, + tokenizer files). Download Mistral-7B there first."""
    tokenizer: str | None = None
    """Folder with tokenizer files; null = model.path; `mistral-common` = the Mistral-7B v0.1 tokenizer shipped in the mistral-common wheel."""
    random_init: bool = False
    """Build the model from config.json alone with seeded random weights (tests, benchmarks); implied when the folder holds no weights."""
    init_seed: int = 0
    """Seed of the random init (independent of train.seed, so data order and init can be varied separately); the same
    seed gives the same weights on every ZeRO stage and world size."""
    attn_implementation: str = "auto"
    """`flex`: zerotune's block-sparse attention (finetune/perf/attention.py): PyTorch's FlexAttention with a block
    mask of the packed samples' boundaries and the model's sliding window, so masked blocks are skipped and no S x S
    mask exists; `auto` = `flex` on CUDA, `sdpa` elsewhere; or transformers' own `sdpa`, `eager`,
    `flash_attention_2` (packing stays leak-free with each: masks or varlen from position_ids)."""
    rope_scaling: dict[str, Any] | None = None
    """Extends the positions beyond the model's max_position_embeddings, as transformers' config takes it, e.g.
    {rope_type: yarn, factor: 8.0, original_max_position_embeddings: 32768}; null = the model's own."""
    activation_checkpointing: Literal["auto", "none", "selective", "full", "offload"] = "auto"
    """`full` recomputes every decoder layer in backward, `selective` `recompute_layers` of them, `none` keeps all
    activations, `offload` recomputes every layer and keeps layer inputs in CPU memory instead of the GPU's
    (`offload_layers` of them); `auto`: on a GPU, the least recomputation (and the micro-batch) that fits its
    memory, from the estimator (finetune/memory/budget.py); without a GPU, `none`."""
    offload_layers: int | None = None
    """Under `offload`: how many of the kept layer inputs wait in CPU memory, the first layers' (the last that backward
    needs); the others stay on the GPU; null = all. `auto` checkpointing sets the fewest that fit the GPU."""
    tiled_mlp: Literal["auto", "on", "off"] = "auto"
    """Compute each MLP a tile of tokens at a time, forward and backward, so that its [tokens, intermediate] tensors
    never exist for a whole long row (finetune/perf/tiled_mlp.py); `auto` = on for rows longer than the tile."""
    recompute_segment: int | None = None
    """Two-level recomputation under full or offload: keep the input of one layer in k, rebuild the others' from it in
    backward (finetune/model/two_level.py): about L/k + k inputs kept instead of L, one more forward; null = off."""
    recompute_layers: int | None = None
    """Decoder layers recomputed under `selective`, spread evenly over the model; null = every second one, or under
    `auto` the fewest that fit the GPU (each layer kept costs memory, each recomputed one a layer's forward GEMMs)."""
    fused_loss: bool = True
    """Compute the output layer and the loss a chunk of tokens at a time, never holding the whole logits (finetune/perf/fused_loss.py)."""
    fused_mlp: bool = True
    """Each MLP's SwiGLU product and down projection as one function that rebuilds the product in backward instead of
    keeping it (finetune/perf/fused_mlp.py): the same gradients, one [tokens, intermediate] tensor less per layer."""
    kernels: Literal["auto", "liger", "none"] = "auto"
    """Fused Triton kernels for RMSNorm, SwiGLU and RoPE: `liger` (liger-kernel, CUDA), `auto` = liger when it is
    installed and the run is on CUDA, `none` = transformers' own modules."""
    precision: Literal["auto", "bf16", "fp8"] = "auto"
    """The linear layers' GEMMs: `fp8` = LoRA's frozen base in float8 (half its memory under ZeRO-0/1/2), or every
    decoder projection's forward and input gradient in float8 for full fine-tuning (finetune/perf/precision.py);
    `auto` = fp8 on FP8 GPUs where its quality gate passed (docs/performance.md), else bf16."""


@dataclass
class LoraConfig:
    enabled: bool = True
    """false = full fine-tuning of every weight."""
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    fused: bool = True
    """Each adapted projection as one autograd function, base GEMM and adapter together (finetune/perf/fused_lora.py);
    false = peft's own forward. Same maths; it skips a copy of the input per adapter, two passes over each output."""
    dropout_kernel: Literal["auto", "torch", "triton"] = "auto"
    """With fused and dropout > 0: `triton` draws each mask from a seed in Triton kernels, keeping none (less memory,
    faster; finetune/perf/lora_dropout.py); `torch` keeps a bool mask per adapter; `auto`: triton where it runs."""
    zero3_layer_gather: bool = True
    """Under ZeRO-3, gather and release each decoder layer's weights in one go (finetune/perf/layer_gather.py)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"])


@dataclass
class DataConfig:
    path: str = "data/train.jsonl"
    """Local JSON/JSONL/Parquet/CSV/Arrow file or a `datasets.save_to_disk` folder."""
    format: str = "alpaca"
    """A registered format: text, alpaca, instruction_output, interactions, sharegpt, messages, preference (pairs, for
    a preference train.objective: docs/preference.md), or a plugin's."""
    plugins: list[str] = field(default_factory=list)
    """Modules to import that register extra formats (`my_pkg.formats`)."""
    eval_path: str | None = None
    """Held-out file; if null, `eval_fraction` of the training data is held out."""
    eval_fraction: float = 0.0
    max_seq_len: int = 2048
    overlong: Literal["drop", "truncate"] = "drop"
    """What to do with samples longer than max_seq_len: drop (counted and reported) or truncate."""
    train_on_inputs: bool = False
    """Also train on system/user tokens (default: loss on the assistant's tokens and their EOS only)."""
    packing: bool = True
    """Pack several samples per row of max_seq_len tokens, attention isolated per sample."""
    shuffle: bool = True
    mix: list[str] = field(default_factory=list)
    """Extra sources mixed with `path` (weight 1): "PATH", "PATH:WEIGHT" or "PATH:WEIGHT:FORMAT". A weight w gives round(w x samples) per epoch (whole copies, then a subset seeded by train.seed); FORMAT defaults to `format`."""
    num_proc: int = 1
    """Worker processes that tokenize on the rank building the cache (0 or 1 = in this process); the result is identical."""


@dataclass
class OptimConfig:
    lr: float = 2e-4
    weight_decay: float = 0.1
    """Decoupled (AdamW) decay; never applied to norms and biases."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at train.max_steps."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    implementation: Literal["torch", "deepspeed"] = "torch"
    """On GPU: torch's fused AdamW (no compiler needed) or DeepSpeed's FusedAdam (JIT-built with nvcc)."""
    overflow_check: Literal["norm", "deepspeed"] = "norm"
    """How bf16 ZeRO-1/2 finds a non-finite gradient, to skip the step: `norm`, by the global gradient norm alone;
    `deepspeed`, also by DeepSpeed's test of every tensor first (same result, a host sync more)."""


@dataclass
class TrainConfig:
    output_dir: str = "runs/mistral7b-lora"
    max_steps: int = 1000
    """Optimizer steps."""
    micro_batch_size: int = 4
    """Rows per GPU per forward (a row is one sample, or several packed into max_seq_len tokens)."""
    grad_accum: int = 1
    seed: int = 42
    """Seed of data order, dropout and every rank's RNG."""
    eval_every: int = 100
    """Optimizer steps between evals (0 = only at the end, if there is eval data)."""
    log_every: int = 1
    overwrite: bool = False
    """Allow a non-empty output_dir (its old files are kept unless overwritten)."""
    save_every: int = 0
    """Optimizer steps between checkpoints (0 = none); the last step is always saved when > 0."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are removed only after a newer one is complete (0 = keep all)."""
    portable_checkpoints: bool = True
    """Also write each checkpoint's trained weights (fp32) and Adam moments by name (portable/), to resume on another
    GPU count or ZeRO stage; false saves 12 bytes per trained parameter, and resumes on the saved layout only."""
    resume: str | None = None
    """`auto` = the newest complete checkpoint in output_dir (start fresh if none), or a checkpoint / run folder path."""
    stop_at: int = 0
    """Stop after this step (saving a checkpoint if save_every > 0), to continue later with train.resume=auto; 0 = run to max_steps."""
    export: bool = True
    """At the end, write <output_dir>/export: an HF model (full) or a LoRA adapter, gathered layer by layer."""
    sample_prompt: str | None = None
    """After training, greedily answer this prompt with the trained model and print it."""
    sample_max_new_tokens: int = 64
    log_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)
    """Extra metric back-ends fed the same records as metrics.jsonl (rank 0): `tensorboard` (<output_dir>/tensorboard), `wandb`."""
    sequence_parallel: int | Literal["auto"] = "auto"
    """Split each row's sequence over this many ranks (DeepSpeed Ulysses), data-parallel size world / this. `auto` = 1,
    or with a GPU memory budget (train.gpu_memory_gib or the GPU's) the fewest ranks, in one node first, that fit."""
    gpu_memory_gib: float | None = None
    """GPU memory budget per GPU: zerotune picks checkpointing and micro-batch (with --deepspeed auto, the ZeRO stage
    and offload) that fit it by the estimator, keeping the batch per step; on CUDA it caps the allocator. null = none."""
    cpu_memory_gib: float | None = None
    """CPU memory per node that the run may use (offloaded states; the model as it loads; without a GPU, everything);
    null = the node's (MemTotal, capped by its cgroup limit)."""
    profile_step: int = 0
    """Profile this step (1-based; 0 = never): output_dir/profile_stepN.txt/.json, the time per kind of kernel."""
    nvme_path: str | None = None
    """Folder on a local NVMe disk for ds_configs/zero3_nvme.json (its nvme_path "auto")."""
    wandb_project: str = "zerotune"
    """W&B project when `wandb` is in log_to (WANDB_MODE=offline writes it locally)."""
    objective: Literal["sft", "dpo", "ipo", "orpo", "simpo"] = "sft"
    """`sft`: the next-token loss on the targets; `dpo`, `ipo`, `orpo`, `simpo`: on data.format preference pairs."""
    beta: float = 0.1
    """β: DPO/IPO's strength of the reference, SimPO's reward scale, ORPO's odds-ratio weight."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin γ."""
    reference: Literal["auto", "adapters_off", "precomputed"] = "auto"
    """dpo/ipo's reference: `adapters_off` = the LoRA model with its adapters disabled; `precomputed` = the starting
    model's log-probs, computed before step 1, kept in the run folder; `auto`: adapters_off with LoRA, else precomputed."""
    share_prompt: Literal["auto", "on", "off"] = "auto"
    """A pair's prompt once in a row, its rejected response seeing the chosen one's copy: fewer tokens, the same
    log-probs. It needs zerotune's attention (model.attn_implementation flex); `auto`: wherever that runs."""
    stall_timeout_s: float | Literal["auto"] | None = "auto"
    """End the run (exit 4) when no step ends, nor eval/save/sample/export starts, for this many s (stacks: <output_dir>/
    stall/rank_K.txt); `auto`/null: 10 x median step + 60 s, >= 300 s (1800 s before step 1, for save/sample/export); 0 = off."""


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        checks = [
            (self.train.max_steps > 0, "train.max_steps must be > 0"),
            (self.train.micro_batch_size > 0, "train.micro_batch_size must be > 0"),
            (self.train.grad_accum > 0, "train.grad_accum must be > 0"),
            (self.data.max_seq_len > 1, "data.max_seq_len must be > 1"),
            (self.train.sequence_parallel == "auto" or (isinstance(self.train.sequence_parallel, int)
                                                        and self.train.sequence_parallel >= 1),
             "train.sequence_parallel must be a whole number >= 1 (ranks that share one row's sequence), or auto"),
            (self.model.recompute_segment is None or (self.model.recompute_segment > 1 and self.model
             .activation_checkpointing in ("full", "offload")), "model.recompute_segment needs a whole number > 1 "
             "and model.activation_checkpointing full or offload (or set it to null)"),
            (self.model.recompute_layers is None or self.model.recompute_layers > 0,
             "model.recompute_layers must be > 0 (decoder layers recomputed under selective checkpointing), or null"),
            (self.model.offload_layers is None or (self.model.offload_layers > 0 and self.model
             .activation_checkpointing == "offload"), "model.offload_layers needs a whole number > 0 and "
             "model.activation_checkpointing=offload (or set it to null)"),
            (self.model.recompute_layers is None or self.model.activation_checkpointing in ("selective", "auto"),
             f"model.recompute_layers applies to activation_checkpointing selective (or auto), not "
             f"{self.model.activation_checkpointing!r}: set model.activation_checkpointing=selective, or "
             f"model.recompute_layers=null"),
            (0.0 <= self.data.eval_fraction < 1.0, "data.eval_fraction must be in [0, 1)"),
            (len(self.optim.betas) == 2, "optim.betas must be two numbers, e.g. [0.9, 0.95]"),
            (self.optim.lr > 0, "optim.lr must be > 0"),
            (self.optim.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
            (not self.lora.enabled or self.lora.rank > 0, "lora.rank must be > 0 (or set lora.enabled=false)"),
            (self.train.gpu_memory_gib is None or self.train.gpu_memory_gib > 0,
             "train.gpu_memory_gib must be > 0 (GiB per GPU), or null for no budget"),
            (self.train.cpu_memory_gib is None or self.train.cpu_memory_gib > 0,
             "train.cpu_memory_gib must be > 0 (GiB per node), or null to read it from the node"),
            (self.train.stall_timeout_s in (None, "auto") or self.train.stall_timeout_s >= 0,
             "train.stall_timeout_s must be >= 0 (seconds; 0 = off), or auto"),
            (self.train.beta > 0, "train.beta must be > 0"),
            (self.train.objective == "sft" or self.train.sequence_parallel in (1, "auto"),
             f"train.objective={self.train.objective} scores whole pairs on one rank: set train.sequence_parallel=1"),
            (self.train.reference != "adapters_off" or self.lora.enabled,
             "train.reference=adapters_off needs LoRA (lora.enabled=true): full fine-tuning has no adapters to "
             "switch off; use train.reference=precomputed or auto"),
            (not (self.model.fused_loss and self.lora.enabled and "lm_head" in self.lora.target_modules),
             "model.fused_loss computes the loss inside the output layer, which LoRA on lm_head replaces: set "
             "model.fused_loss=false or drop lm_head from lora.target_modules"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def load_recipe(path: str | None = None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (a path, a shipped name such as `tiny`, or None = the default Mistral-7B LoRA recipe) and
    apply `section.key=value` overrides."""
    try:
        path = shipped.recipe_path(path)
    except shipped.NotShipped as e:
        raise ConfigError(str(e)) from None
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections ({', '.join(_field_names(Recipe))})")
    overridden: dict[str, str] = {}  # dotted key (or a section only overrides name) -> the override as written
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"command-line override {item!r} is not section.key=value (e.g. train.max_steps=20)")
        section, _, name = key.partition(".")
        if section not in raw:
            overridden[section] = item
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping")
        try:
            raw[section][name] = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"command-line override {item!r}: {text!r} is not a YAML value ({problem}); write a "
                              f"number, true/false, null, text or a list such as [q_proj, v_proj]") from None
        overridden[key] = item
    return _with_shipped_paths(_build(Recipe, raw, _Source(path, overridden)))


def _with_shipped_paths(recipe: Recipe) -> Recipe:
    """A relative recipes/... path (tiny.yaml's `model.path: recipes/tiny_model`) that does not exist from this
    folder but does among the shipped files points at those: a shipped recipe, or a copy of one, runs from any folder."""
    m, d = recipe.model, recipe.data
    m.path, d.path = shipped.find(m.path), shipped.find(d.path)
    m.tokenizer = shipped.find(m.tokenizer) if m.tokenizer else m.tokenizer
    d.eval_path = shipped.find(d.eval_path) if d.eval_path else d.eval_path
    return recipe


recipe_to_dict = dataclasses.asdict


def sections() -> dict[str, list[str]]:
    """The recipe's sections and their keys, in order: {"model": ["path", "tokenizer", ...], ...}."""
    hints = typing.get_type_hints(Recipe)
    return {name: _field_names(hints[name]) for name in _field_names(Recipe)}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@dataclass
class _Source:
    """Where the values of a recipe were written: the YAML file, and the overrides given on the command line."""

    path: str
    overridden: dict[str, str]

    def of(self, dotted: str) -> str:
        """What an error about `dotted` blames: the override that set it, else the recipe file."""
        item = self.overridden.get(dotted)
        return f"command-line override {item!r}" if item else self.path

    def of_message(self, message: str) -> str:
        """What an error of a check across keys blames: the recipe file, with the overrides the message names."""
        named = [item for key, item in self.overridden.items() if "." in key and key in message]
        return f"{self.path} with command-line override {', '.join(map(repr, named))}" if named else self.path


def _build(cls: type, raw: dict, source: _Source, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = shipped.closest(str(key), names)
            hint = f" Did you mean '{prefix}{close}'?" if close else ""
            raise ConfigError(f"{source.of(dotted)}: unknown key {dotted!r}.{hint} "
                              f"Valid keys: {', '.join(prefix + n for n in names)}")
        hint_type = hints[key]
        if dataclasses.is_dataclass(hint_type):
            if not isinstance(value, dict):
                raise ConfigError(f"{source.path}: {dotted!r} must be a mapping of {', '.join(_field_names(hint_type))}")
            kwargs[key] = _build(hint_type, value, source, prefix=f"{dotted}.")
        else:
            kwargs[key] = _coerce(value, hint_type, dotted, source.of(dotted))
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source.of_message(str(e))}: {e}") from None


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        named = [v for a in inner[1:] if get_origin(a) is Literal for v in get_args(a)]  # beside a number: `auto`
        if isinstance(value, str) and named:
            if value in named:
                return value
            try:
                return _coerce(value, inner[0], key, source)
            except ConfigError:
                raise ConfigError(f"{source}: {key} must be a number or one of: {', '.join(named)}; got {value!r}") from None
        return _coerce(value, inner[0], key, source)
    if origin is Literal:
        if isinstance(value, bool) and "on" in args and "off" in args:
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as true/false
        if value not in args:
            raise ConfigError(f"{source}: {key} = {value!r} is not one of: {', '.join(map(str, args))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping such as {{rope_type: linear, factor: 2.0}}, "
                              f"got {type(value).__name__} {value!r}")
        return dict(value)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, args[0], key, source) for v in value]
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):  # YAML 1.1 reads 5e-3 (no dot) as a string
            return float(value)
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: {key} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value
