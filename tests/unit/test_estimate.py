"""The memory estimator against the ZeRO paper's formulas (Mistral-7B's shape and the tiny model, LoRA and full), its
activation count against torch's saved tensors, and the `zerotune estimate` table. Against the bytes real DeepSpeed
engines hold on each of 2 ranks: tests/integration/test_estimate.py."""

import dataclasses
import json
import os

import pytest

from finetune.config import LoraConfig
from finetune.memory.estimate import (GIB, count_parameters, estimate_activations, estimate_model_states, lora_parameters)
from finetune.commands.estimate import main
from tests.fixtures.estimate_cases import LORA
from tests.fixtures.model_shapes import MISTRAL, TINY
from tests.helpers import SMALL_VOCAB, ROOT

UNFUSED = LoraConfig(rank=16, fused=False)  # peft's own forward
COUNTS = {"mistral": (MISTRAL, 7_241_732_096, 41_943_040), "tiny": (TINY, 8_930_432, 149_504)}


@pytest.mark.parametrize("model", COUNTS)
def test_parameter_counts_are_exact(model):
    cfg, total, adapters = COUNTS[model]
    assert count_parameters(cfg) == total
    # rank x (in + out) per projection and layer: q, o (h, h), k, v (h, kv), gate, up, down (h, intermediate)
    assert lora_parameters(cfg, LORA) == adapters
    assert lora_parameters(cfg, LoraConfig(rank=8, target_modules=["q_proj", "v_proj"])) == \
        8 * cfg["num_hidden_layers"] * (2 * cfg["hidden_size"] + cfg["hidden_size"] + cfg["num_key_value_heads"] * cfg["head_dim"])
    assert lora_parameters(cfg, LoraConfig(enabled=False)) == 0


@pytest.mark.parametrize("model", COUNTS)
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_follow_2_2_12_partitioned_per_stage(model, lora, stage):
    cfg, total, adapters = COUNTS[model]
    n = 2
    trained = adapters if lora else total
    weights = total + adapters if lora else total  # LoRA: a frozen 16-bit base plus the adapters
    got = estimate_model_states(cfg, LORA if lora else None, stage, n, dtype_bytes=2)
    assert got["params"] == 2 * weights / (n if stage == 3 else 1)
    assert got["grads"] == 2 * trained / (n if stage >= 2 else 1)
    assert got["optimizer"] == 12 * trained / (n if stage >= 1 else 1)
    assert got["total"] == got["params"] + got["grads"] + got["optimizer"] and got["cpu"] == 0


def test_full_7b_figures_and_offload():
    n = 7_241_732_096
    assert estimate_model_states(MISTRAL, None, 0, 8)["total"] == 16 * n  # 2 + 2 + 12 bytes per parameter, 115.9 GB
    assert estimate_model_states(MISTRAL, None, 3, 8)["total"] == 16 * n / 8
    off = estimate_model_states(MISTRAL, None, 2, 2, offload_optimizer=True)
    # the master, m and v (12) and the fp32 gradient partition (4) move to the CPU; bf16 weights stay
    assert (off["params"], off["grads"], off["optimizer"], off["cpu"]) == (2 * n, 0, 0, 16 * n / 2)
    off3 = estimate_model_states(MISTRAL, None, 3, 2, offload_optimizer=True, offload_params=True)
    assert (off3["total"], off3["cpu"]) == (0, 16 * n / 2 + 2 * n / 2)
    # zerotune's ZeRO-0 is bf16 autocast over fp32 weights: 4 + 4 + 8 (no separate master)
    assert estimate_model_states(MISTRAL, None, 0, 2, dtype_bytes=4)["optimizer"] == 8 * n
    with pytest.raises(ValueError, match="needs ZeRO-1, 2 or 3"):
        estimate_model_states(MISTRAL, None, 0, 2, offload_optimizer=True)


def _saved_bytes(lora: LoraConfig | None, attn: str, packed: bool, fp32_adapters: bool,
                 fused_mlp: bool = False, tiled_mlp: bool = False) -> tuple[float, dict]:
    """Bytes autograd keeps after a bf16 forward + loss of the tiny model (parameters excluded), per token. The
    small-vocabulary one: the estimate counts the logits from the config's vocabulary like every other tensor, and a
    32,000-wide bf16 output layer is slow on CPUs that emulate bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(SMALL_VOCAB)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn)
    if lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(model, PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=lora.target_modules, task_type="CAUSAL_LM"))
        if not fp32_adapters:  # as ZeRO-0/1/2's bf16 engine casts every parameter; ZeRO-3 leaves peft's fp32 adapters
            model.to(torch.bfloat16)
        if lora.fused:
            from finetune.perf.fused_lora import install_fused_lora

            install_fused_lora(model, zero_stage=2, dropout_kernel=lora.dropout_kernel)  # as the estimate resolves it
    if fused_mlp:
        from finetune.perf.fused_mlp import install_fused_mlp

        install_fused_mlp(model, zero_stage=2, liger=False)
    if tiled_mlp:  # after the fused MLP, as perf.apply installs it; tiles of 64 tokens
        from finetune.perf.tiled_mlp import install_tiled_mlp

        assert install_tiled_mlp(model, zero_stage=2, max_tokens=2 * 256, tile_tokens=64) == cfg.num_hidden_layers
    model.train()
    rows, seq = 2, 256
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).repeat(rows, 1) if not packed else torch.arange(seq // 2).repeat(rows, 2)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, position_ids=positions).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1))
    adapter_bytes = 4 if fp32_adapters else 2  # the CPU's dropout mask has the adapters' input dtype (CUDA's: bool)
    est = estimate_activations(cfg.to_dict(), lora, seq, rows, "none", 2, attn, packed, dropout_mask_bytes=adapter_bytes,
                               adapter_dtype_bytes=adapter_bytes, fused_mlp=fused_mlp, tiled_mlp=tiled_mlp)
    return sum(saved.values()), est


@pytest.mark.parametrize("lora,attn,packed,fp32_adapters", [
    (None, "sdpa", False, False), (None, "sdpa", True, False), (None, "eager", False, False),
    (LORA, "sdpa", True, False), (LoraConfig(rank=16, dropout=0.0), "sdpa", False, False), (LORA, "eager", False, False),
    (LORA, "sdpa", True, True), (LoraConfig(rank=16, dropout=0.0), "sdpa", False, True),
    (UNFUSED, "sdpa", True, False), (UNFUSED, "eager", False, False), (UNFUSED, "sdpa", True, True)])
def test_activation_estimate_matches_saved_tensors(lora, attn, packed, fp32_adapters):
    measured_bytes, est = _saved_bytes(lora, attn, packed, fp32_adapters)
    assert est["saved"] == pytest.approx(measured_bytes, rel=1e-3), (measured_bytes, est)


@pytest.mark.parametrize("lora", [None, dataclasses.replace(LORA, target_modules=["q_proj", "gate_proj", "up_proj"]),
                                  LORA],
                         ids=["full", "lora-without-down_proj", "lora"])
def test_fused_mlp_estimate_matches_saved_tensors(lora):
    """finetune/perf/fused_mlp.py keeps gate and up only; with LoRA on down_proj it is not installed and nothing changes."""
    measured_bytes, est = _saved_bytes(lora, "sdpa", True, False, fused_mlp=True)
    assert est["saved"] == pytest.approx(measured_bytes, rel=1e-3), (measured_bytes, est)
    unfused_bytes, _ = _saved_bytes(lora, "sdpa", True, False)
    assert (measured_bytes < unfused_bytes) == (lora is not LORA)


@pytest.mark.parametrize("lora", [None, LORA, UNFUSED, LoraConfig(rank=16, dropout=0.0, fused=False)],
                         ids=["full", "lora", "lora-unfused", "lora-unfused-no-dropout"])
def test_tiled_mlp_estimate_matches_saved_tensors(lora):
    """finetune/perf/tiled_mlp.py keeps each MLP's input only (over the fused MLP where that applies)."""
    measured_bytes, est = _saved_bytes(lora, "sdpa", True, False, fused_mlp=True, tiled_mlp=True)
    assert est["saved"] == pytest.approx(measured_bytes, rel=1e-3), (measured_bytes, est)


def test_checkpointing_keeps_only_layer_inputs_plus_one_layer():
    none = estimate_activations(MISTRAL, None, 2048, 4, "none")
    full = estimate_activations(MISTRAL, None, 2048, 4, "full")
    selective = estimate_activations(MISTRAL, None, 2048, 4, "selective")
    layer = none["layers"] / 32
    assert full["layers"] == 32 * 2 * 4096 * 2048 * 4 and full["recompute"] == layer
    assert selective["layers"] == 16 * layer + 16 * 2 * 4096 * 2048 * 4
    assert full["logits"] == 10 * 32000 * 2048 * 4  # bf16 logits, their fp32 copy, the fp32 log-softmax
    assert full["total"] < selective["total"] < none["total"]


def _cli(capsys, gpu_gib: str, cpu_gib: str, *extra: str) -> str:
    args = ["--config", os.path.join(ROOT, "recipes", "mistral7b_full.yaml"), "--deepspeed",
            os.path.join(ROOT, "ds_configs", "zero3.json"), "--gpus", "2", "--gpu-memory-gib", gpu_gib,
            "--cpu-memory-gib", cpu_gib, f"model.path={os.path.join(ROOT, 'recipes', 'mistral7b_shape')}", *extra]
    assert main(args) == 0
    return capsys.readouterr().out


def test_cli_table_and_recommendation(capsys):
    out = _cli(capsys, "141", "256")
    assert "7,241,732,096 parameters" in out and "| ZeRO-3 * |" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ZeRO")}
    assert len(rows) == 7  # the seven shipped configurations (zero3_nvme.json is estimated with --deepspeed)
    assert rows["ZeRO-0"].rstrip().endswith("| yes |")  # 114 GiB <= 90% of 141
    assert "recommendation: ZeRO-2 (--deepspeed " in out
    # 80 GiB GPUs: ZeRO-1/2 peak at ~81 GiB in the optimizer step (measured 81.5 on 2xH200), so ZeRO-3
    assert "recommendation: ZeRO-3 (--deepspeed " in _cli(capsys, "80", "256")
    # 60 GiB GPUs: only offloading fits, if the node has the CPU memory for it
    assert "recommendation: ZeRO-2 + offload" in _cli(capsys, "60", "256")
    assert "recommendation: nothing fits" in _cli(capsys, "60", "64")
    zero3 = next(r for r in json.loads(_cli(capsys, "80", "256", "--json")) if r["config"] == "ZeRO-3")
    assert zero3["params"] == 2 * 7_241_732_096 / 2 and zero3["total"] / GIB < 72


# Peak GiB allocated per GPU, measured by `zerotune compare` on 2xH200 (2026-11-30): Mistral-7B's shape, random init,
# micro-batch 4 x 2048 packed tokens, full activation checkpointing, sdpa, the shipped ds_configs; compare --steps 6
# (LoRA) and 5 (full). See docs/memory.md, "Which ZeRO stage? Compare", for the command.
MEASURED_H200 = {"lora": {"zero0": 35.78, "zero1": 19.71, "zero2": 19.41, "zero3": 15.47},
                 "full": {"zero0": 110.52, "zero1": 81.48, "zero2": 81.48, "zero3": 61.59}}


@pytest.mark.parametrize("kind", MEASURED_H200)
def test_peak_estimate_matches_h200_measurements(kind):
    from finetune.config import load_recipe
    from finetune.ds_config import resolve_ds_config
    from finetune.memory.estimate import estimate_run

    recipe = load_recipe(os.path.join(ROOT, "recipes", f"mistral7b_{kind}.yaml"),
                         [f"model.path={os.path.join(ROOT, 'recipes', 'mistral7b_shape')}", "train.micro_batch_size=4",
                          "model.activation_checkpointing=full", "model.fused_loss=false",
                          "model.fused_mlp=false", "lora.dropout_kernel=torch"])  # what ran
    for name, measured in MEASURED_H200[kind].items():
        ds = resolve_ds_config(os.path.join(ROOT, "ds_configs", f"{name}.json"), recipe, 2, MISTRAL["hidden_size"])
        estimated = estimate_run(MISTRAL, recipe, ds, 2)["total"] / GIB
        # within 10% (LoRA ZeRO-1: +9%, its 0.9 GiB reduce bucket is not all allocated); full within 4%
        assert estimated == pytest.approx(measured, rel=0.10 if kind == "lora" else 0.04), (kind, name, estimated)


def test_cli_needs_gpu_memory_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["--config", os.path.join(ROOT, "recipes", "tiny.yaml"), "--gpus", "2"]) == 2
    assert "--gpu-memory-gib" in capsys.readouterr().err


# --- long rows: attention implementation, tiled MLP, checkpoint offload, sequence parallelism --------------------------

H, INTER, Q, KV, LAYERS = 4096, 14336, 4096, 1024, 32


def _acts(seq_len: int, checkpointing: str = "none", lora=None, **kw) -> dict:
    return estimate_activations(MISTRAL, lora, seq_len, 1, checkpointing, 2, **{"fused_loss": True, **kw})


def test_flex_drops_the_packed_mask_and_the_repeated_kv():
    """sdpa over a packed row materialises a [S, S] mask per layer and repeats k/v to all 32 heads; flex keeps q, k, v
    (8 kv heads), the output and the log-sum-exp, and one block mask per micro-batch."""
    seq = 32768
    sdpa, flex = _acts(seq, attn_implementation="sdpa"), _acts(seq, attn_implementation="flex")
    per_layer_token = 2 * seq + 2 * 2 * (Q - KV)  # the mask's row, k and v at 32 heads instead of 8
    assert sdpa["layers"] - flex["layers"] == LAYERS * seq * per_layer_token
    blocks = seq // 128
    assert flex["other"] - sdpa["other"] == blocks * blocks * 4 * 4  # int32 block indices, 4 tensors
    assert flex["attention_backward"] < sdpa["attention_backward"]  # dk, dv at the kv heads' width


def test_tiled_mlp_keeps_only_the_mlp_input():
    """Full fine-tune: the MLP's [tokens, 14336] tensors go (its input is the norm's output, already kept); LoRA: its
    input is kept instead of the intermediates and the adapters' tensors; one tile's intermediates are transient."""
    seq = 65536
    plain = _acts(seq, attn_implementation="flex", fused_mlp=False)
    tiled = _acts(seq, attn_implementation="flex", fused_mlp=False, tiled_mlp=True)
    assert plain["layers"] - tiled["layers"] == LAYERS * seq * 4 * 2 * INTER  # gate, up, silu(gate), product
    assert tiled["mlp_tile"] == 4096 * 7 * 2 * INTER + seq * 2 * H + 6 * 3 * H * INTER  # a tile; grad of x; weight grads
    lora = LoraConfig(rank=16, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                      dropout_kernel="torch")
    lora_plain = _acts(seq, lora=lora, attn_implementation="flex")
    lora_tiled = _acts(seq, lora=lora, attn_implementation="flex", tiled_mlp=True)
    # fused LoRA without dropout on the MLP inputs: x (once for gate/up), down's input, 3 ranks' outputs; dropout on:
    # a bool mask per adapter (CUDA's) -- all replaced by the MLP's input
    mlp_plain = 3 * 2 * INTER + 2 * H + 2 * INTER + 3 * 2 * 16 + (2 * H + INTER)
    assert lora_plain["layers"] - lora_tiled["layers"] == pytest.approx(LAYERS * seq * (mlp_plain - 2 * H))


def test_offload_moves_the_layer_inputs_to_cpu_memory():
    seq = 131072
    full = _acts(seq, "full", attn_implementation="flex", tiled_mlp=True)
    offload = _acts(seq, "offload", attn_implementation="flex", tiled_mlp=True)
    layer_input = seq * 2 * H
    assert full["layers"] == LAYERS * layer_input and full["cpu"] == 0
    assert offload["layers"] == 2 * layer_input and offload["cpu"] == LAYERS * layer_input  # 2 on the GPU at a time
    assert offload["transient"] == full["transient"]  # the same layer recomputed in backward
    from finetune.memory.estimate import recomputed_layers

    assert recomputed_layers("offload", LAYERS) == recomputed_layers("full", LAYERS) == list(range(LAYERS))


def test_sequence_parallel_halves_what_a_rank_holds_but_the_whole_rows_mask():
    seq = 262144
    one = _acts(seq, "full", attn_implementation="flex", tiled_mlp=True)
    two = _acts(seq, "full", attn_implementation="flex", tiled_mlp=True, sequence_parallel=2)
    assert two["tokens"] == seq / 2 and two["layers"] == one["layers"] / 2  # layer inputs: tokens / 2
    assert two["logits"] < one["logits"] / 2 + 1 * GIB
    blocks = (seq // 128) ** 2 * 16
    assert two["other"] - blocks == pytest.approx((one["other"] - blocks) / 2)  # the block mask is the whole row's
    # a packed sdpa mask is the whole sequence's on every rank: per rank the same bytes at any degree
    sdpa1, sdpa2 = (_acts(8192, "none", attn_implementation="sdpa", sequence_parallel=n) for n in (1, 2))
    mask = LAYERS * 8192 * 8192 * 2
    assert sdpa2["layers"] - mask / 1 == pytest.approx((sdpa1["layers"] - mask) / 2 + LAYERS * 4096 * 2 * Q)
    # past the 8 kv heads, every rank holds a whole kv head: k and v no longer shrink with the degree
    kv16, kv8 = (_acts(seq, "none", attn_implementation="flex", tiled_mlp=True, sequence_parallel=n) for n in (16, 8))
    assert kv8["layers"] / kv16["layers"] < 2


def test_transient_is_the_largest_working_set():
    """Short rows: the fused loss's chunk (and the head's fp32 weight gradient) is the largest transient; long rows
    under checkpointing: one recomputed layer, attention's gradients and the residual stream's."""
    short = _acts(2048, "none", attn_implementation="flex")
    assert short["transient"] == short["loss_chunk"] > short["layer_backward"]
    long = _acts(131072, "full", attn_implementation="flex", tiled_mlp=True)
    assert long["transient"] == long["layer_backward"] > max(long["mlp_tile"], long["loss_chunk"])
    assert long["total"] == long["kept"] + long["transient"]


def test_estimate_run_resolves_auto_attention_for_the_gpu_when_asked():
    from finetune.config import load_recipe
    from finetune.ds_config import resolve_ds_config
    from finetune.memory.estimate import estimate_run

    recipe = load_recipe(os.path.join(ROOT, "recipes", "mistral7b_lora.yaml"),
                         ["model.path=recipes/mistral7b_shape", "data.max_seq_len=32768", "train.micro_batch_size=1",
                          "model.activation_checkpointing=full"])
    assert recipe.model.attn_implementation == "auto" and recipe.model.tiled_mlp == "auto"
    ds = resolve_ds_config(os.path.join(ROOT, "ds_configs", "zero2.json"), recipe, 2, 4096)
    gpu, cpu = estimate_run(MISTRAL, recipe, ds, 2, cuda=True), estimate_run(MISTRAL, recipe, ds, 2, cuda=False)
    assert (gpu["attention"], cpu["attention"], gpu["tiled_mlp"]) == ("flex", "sdpa", True)
    assert cpu["total"] > gpu["total"]  # the packed mask of sdpa
    assert gpu["total"] == max(gpu["backward"], gpu["init"], gpu["step"] + gpu["params"] + gpu["optimizer"]
                               + gpu["buffers"])
    assert gpu["backward"] == gpu["params"] + gpu["grads"] + gpu["optimizer"] + gpu["activations"] + \
        gpu["transient"] + gpu["buffers"]


def test_cli_memory_against_sequence_length(capsys):
    out = _cli(capsys, "80", "512", "train.micro_batch_size=1", "--gpus", "8", "--seq-lens", "8192,131072")
    rows = [line for line in out.splitlines() if line.startswith("| 8,192 |") or line.startswith("| 131,072 |")]
    assert len(rows) == 2 and "memory against sequence length" in out
    assert "| zero" in rows[1] and "tiled MLP on" in rows[1]  # the plan at 131K tiles the MLP
    sweep = json.loads(_cli(capsys, "80", "512", "--seq-lens", "8192,131072", "--json"))["seq_lens"]
    assert [r["seq_len"] for r in sweep] == [8192, 131072] and sweep[1]["total"] > sweep[0]["total"]
    assert set(sweep[1]["terms"]) >= {"layers", "layer_backward", "attention_backward", "mlp_tile", "loss_chunk"}
    # a long recipe sweeps by default, up to its max_seq_len; `none` keeps the plain output
    default = _cli(capsys, "141", "512", "data.max_seq_len=65536", "train.micro_batch_size=1")
    assert [line.split("|")[1].strip() for line in default.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().replace(",", "").isdigit()] == ["8,192", "32,768", "65,536"]
    assert "memory against" not in _cli(capsys, "141", "512", "data.max_seq_len=65536", "--seq-lens=none")


def test_cli_says_which_cpu_memory_the_offload_rows_were_held_to(capsys, monkeypatch):
    """Offloading rows fit only within the CPU memory per node: by default this machine's (what a run here is held
    to), which the output names, with the option that sets the nodes' own."""
    import finetune.commands.estimate as estimate_command

    def offload_fits(out: str) -> list[str]:
        return [line.split("|")[-2].strip() for line in out.splitlines() if line.startswith("| ZeRO") and "offload" in line]

    out = _cli(capsys, "141", "256")
    assert "CPU memory 256.0 GiB per node (--cpu-memory-gib): an offloading configuration fits" in out
    assert offload_fits(out) == ["yes", "yes", "yes"]  # 135 and 148 GiB per node

    args = ["--config", "mistral7b_full", "--deepspeed", "zero3", "--gpus", "2", "--gpu-memory-gib", "141",
            f"model.path={os.path.join(ROOT, 'recipes', 'mistral7b_shape')}"]
    monkeypatch.setattr(estimate_command, "host_memory", lambda: (100 * GIB, 60 * GIB))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "CPU memory 100.0 GiB per node (this machine's: MemTotal, capped by its cgroup limit; --cpu-memory-gib " \
           "sets another)" in out
    assert offload_fits(out) == ["no", "no", "no"]

    monkeypatch.setattr(estimate_command, "host_memory", lambda: (None, None))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "CPU memory per node: unknown" in out and "pass --cpu-memory-gib" in out
    assert offload_fits(out) == ["yes", "yes", "yes"]  # not checked against an unknown figure
