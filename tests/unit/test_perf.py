"""The speed-up switchboard (finetune/perf/__init__.py): each switch turns its speed-up on and off and nothing else, the
names returned and reported are what the model carries, and a speed-up changes only the model it is applied to.

Tiny Mistrals (vocab 256, hidden 64, 2 layers) built by finetune.model.build.build_model from a config.json, fp32 on CPU.
liger's kernels need CUDA: here stand-in kernels (transformers' own maths, counted) go through the same per-instance
installation (finetune/perf/liger.py), and the real kernels are checked by the last test where CUDA and liger-kernel
are present.

apply_engine: a real DeepSpeed ZeRO-1/2 engine starts a process group, so its decision is tested here on optimizer
objects made without one. The real engines (NaN gradient skipped, clean steps identical) are tests/integration/test_overflow_check.py,
whose driver (tests/drivers/overflow_driver.py) goes through perf.apply_engine: an integration test of apply_engine needs
deepspeed.initialize on a 1-rank gloo group, as that driver does.
"""

import importlib.util
import os
import re
import typing
from types import SimpleNamespace

import pytest
import torch

from finetune import perf
from finetune.config import ConfigError, Recipe, load_recipe
from finetune.model.build import build_model
from finetune.perf import attention, liger
from finetune.perf.fused_lora import fused_class
from finetune.perf.fused_loss import _LossHead
from finetune.perf.precision import Fp8FrozenLinear
from finetune.perf.fused_mlp import fused_forward
from finetune.perf.tiled_mlp import tiled_forward
from tests.helpers import ROOT, TINY_RECIPE

STAGE2_FP32 = {"bf16": {"enabled": False}, "zero_optimization": {"stage": 2}}
MODEL_NAMES = [s.name for s in perf.SPEEDUPS if not s.engine and not s.data and not s.zero3]
ALL_ON = ["model.kernels=liger", "lora.enabled=true", "lora.fused=true", "lora.dropout=0.1",
          "lora.dropout_kernel=triton", "model.precision=fp8", "model.fused_mlp=true", "model.fused_loss=true", "model.attn_implementation=flex"]
ALL_ON.append("model.tiled_mlp='on'")  # quoted: YAML reads a bare on/off as a boolean
ALL_OFF = [f"{s.switch}={str(s.off).lower() if isinstance(s.off, bool) else repr(s.off)}" for s in perf.SPEEDUPS]
CALLS = []  # the stand-in kernels' calls


def _mm():
    from transformers.models.mistral import modeling_mistral

    return modeling_mistral


def _rms(self, x):
    CALLS.append("rms_norm")
    return _mm().MistralRMSNorm.forward(self, x)


def _mlp(self, x):
    CALLS.append("mlp")
    return _mm().MistralMLP.forward(self, x)


def _rope(*args, **kwargs):
    CALLS.append("rope")
    return _ORIGINAL_ROPE(*args, **kwargs)


_ORIGINAL_ROPE = _mm().apply_rotary_pos_emb
STAND_IN = liger.Kernels(_rms, {"casting_mode": "stand-in"}, _mlp, _rope)


@pytest.fixture
def usable(monkeypatch):
    """Every model speed-up usable on this CPU: liger's kernels replaced by the stand-ins, and the Triton dropout
    in Triton's CPU interpreter (lora.dropout_kernel=triton is then allowed)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(liger, "available", lambda: None)
    monkeypatch.setattr(liger, "load_kernels", lambda: STAND_IN)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import MistralConfig

    path = str(tmp_path_factory.mktemp("tiny_mistral"))
    MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, use_cache=False).save_pretrained(path)
    return path


def _recipe(model_dir: str, *overrides: str) -> Recipe:
    # LoRA on attention only: a plain down_proj, so the fused MLP applies too
    return load_recipe(TINY_RECIPE, [f"model.path={model_dir}", "model.activation_checkpointing=none",
                                     "lora.target_modules=[q_proj,v_proj]", "lora.rank=4", *overrides])


def _build(model_dir: str, *overrides: str):
    recipe = _recipe(model_dir, *overrides)
    model, _ = build_model(recipe.model, recipe.lora, STAGE2_FP32)
    return model, recipe


def _marks(model) -> set[str]:
    """The speed-ups the model carries, read from its modules: classes, instance forwards, the output layer."""
    mm, found = _mm(), set()
    for m in model.modules():
        if isinstance(m, (mm.MistralRMSNorm, mm.MistralAttention)) and "forward" in vars(m):
            found.add("liger")
        if isinstance(m, mm.MistralMLP) and "forward" in vars(m):
            forward = m.forward
            if forward.__func__ is tiled_forward:  # the tiles run the forward the MLP had before
                found.add("tiled_mlp")
                forward = m._tiled_mlp_inner
            if forward.__func__ is not type(m).forward:
                found.add("fused_mlp" if forward.__func__ is fused_forward else "liger")
        if type(m) is Fp8FrozenLinear:
            found.add("fp8")
        if type(m) is fused_class():
            found.add("fused_lora")
            if m.seeded_dropout:
                found.add("lora_dropout_kernel")
        if isinstance(m, _LossHead):
            found.add("fused_loss")
    if attention.installed(model):
        found.add("flex_attention")
    return found


def _assert_plain(model) -> None:
    """transformers', peft's and torch's own modules: no swapped class, no forward bound to an instance."""
    for name, m in model.named_modules():
        assert "forward" not in vars(m), name
        assert type(m).__module__.split(".")[0] in ("transformers", "peft", "torch"), (name, type(m))


def _library_state() -> dict[str, object]:
    """Every global of transformers' Mistral module and every attribute of the classes a speed-up touches."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    mm = _mm()
    state = {f"modeling_mistral.{k}": v for k, v in vars(mm).items()}
    for cls in (mm.MistralRMSNorm, mm.MistralMLP, mm.MistralAttention, mm.MistralDecoderLayer, mm.MistralForCausalLM,
                torch.nn.Linear, torch.nn.Module, LoraLinear):
        state.update({f"{cls.__module__}.{cls.__qualname__}.{k}": v for k, v in vars(cls).items()})
    return state


def _assert_same(before: dict, after: dict) -> None:
    assert after.keys() == before.keys()
    changed = [k for k, v in before.items() if after[k] is not v]
    assert not changed, changed


def test_the_table_lists_every_switch_with_its_off_value():
    assert len(set(perf.NAMES)) == len(perf.NAMES)
    hints = {section: typing.get_type_hints(type(getattr(Recipe(), section))) for section in ("model", "lora", "optim", "train")}
    for s in perf.SPEEDUPS:
        section, key = s.switch.split(".")
        hint = hints[section][key]
        assert isinstance(s.off, str) if hint is str else s.off in (typing.get_args(hint) or (True, False)), s
        assert perf.switch_value(Recipe(), s.switch) != s.off, f"{s.name} is off in the default recipe"
    assert MODEL_NAMES == ["liger", "fp8", "fused_lora", "lora_dropout_kernel", "fused_mlp", "tiled_mlp", "fused_loss",
                           "flex_attention"]


def test_all_on_applies_each_in_order_and_the_model_carries_exactly_those(model_dir, usable):
    model, recipe = _build(model_dir, *ALL_ON)
    applied = perf.apply(model, recipe, STAGE2_FP32)
    assert applied == MODEL_NAMES
    assert _marks(model) == set(applied)
    mlps = [m for m in model.modules() if isinstance(m, _mm().MistralMLP)]
    assert mlps and all(m._fused_mlp_liger for m in mlps)  # the fused MLP uses liger's SwiGLU product with liger on
    norms = [m for m in model.modules() if isinstance(m, _mm().MistralRMSNorm)]
    assert len(norms) == 5 and all(m.forward.__func__ is _rms and m.casting_mode == "stand-in" for m in norms)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_a_switch_turned_off_removes_that_speed_up_only(model_dir, usable, name):
    s = next(s for s in perf.SPEEDUPS if s.name == name)
    off = f"{s.switch}={str(s.off).lower() if isinstance(s.off, bool) else repr(s.off)}"
    model, recipe = _build(model_dir, *ALL_ON, off)
    applied = perf.apply(model, recipe, STAGE2_FP32)
    gone = {name, "lora_dropout_kernel"} if name == "fused_lora" else {name}  # the dropout kernels are fused LoRA's
    assert applied == [n for n in MODEL_NAMES if n not in gone]
    assert _marks(model) == set(applied)
    if name == "fused_loss":
        assert type(model.get_output_embeddings()) is torch.nn.Linear
    if name == "flex_attention":
        assert model.config._attn_implementation == "sdpa"
    if name == "fused_lora":
        from peft.tuners.lora.layer import Linear as LoraLinear

        assert {type(m) for m in model.modules() if isinstance(m, LoraLinear)} == {LoraLinear}


def test_what_this_machine_runs_by_default(model_dir):
    """The recipe's defaults without the stand-ins: liger and the Triton dropout where CUDA has them, the rest
    everywhere."""
    from finetune.perf import lora_dropout

    gpu = ["liger"] if liger.available() is None else []
    dropout = ["lora_dropout_kernel"] if lora_dropout.uses_kernels("auto") else []
    flex = ["flex_attention"] if attention.resolve("auto", "cuda" if torch.cuda.is_available() else "cpu") == "flex" else []
    for lora, expected in ((True, gpu + ["fused_lora", *dropout, "fused_mlp", "fused_loss", *flex]),
                           (False, gpu + ["fused_mlp", "fused_loss", *flex])):
        model, recipe = _build(model_dir, f"lora.enabled={str(lora).lower()}")
        applied = perf.apply(model, recipe, STAGE2_FP32)
        assert applied == expected and _marks(model) == set(expected)
        assert {r["name"] for r in perf.report(recipe, applied) if r["on"]} == set(expected)
    # an adapted down_proj keeps its LoRA path: no MLP to fuse
    model, recipe = _build(model_dir, "lora.enabled=true", "lora.target_modules=[q_proj,down_proj]")
    assert perf.apply(model, recipe, STAGE2_FP32) == gpu + ["fused_lora", *dropout, "fused_loss", *flex]


def test_explicit_liger_without_cuda_is_an_error(model_dir):
    if liger.available() is None:
        pytest.skip("liger-kernel runs here")
    model, recipe = _build(model_dir, "model.kernels=liger")
    with pytest.raises(ConfigError, match="model.kernels=liger: .*set model.kernels=auto"):
        perf.apply(model, recipe, STAGE2_FP32)
    _assert_plain(model)


def test_report_lists_every_speed_up_with_its_switch(model_dir):
    recipe = _recipe(model_dir)
    records = perf.report(recipe, ["fused_mlp", "overflow_check"])
    assert [r["name"] for r in records] == list(perf.NAMES)
    assert all(set(r) == {"name", "switch", "on"} for r in records)
    assert {r["switch"] for r in records} == {"model.kernels", "model.precision", "lora.fused", "lora.dropout_kernel", "model.fused_mlp",
                                              "model.tiled_mlp", "model.fused_loss", "model.attn_implementation",
                                              "train.share_prompt", "optim.overflow_check",
                                              "lora.zero3_layer_gather"}
    assert [r["name"] for r in records if r["on"]] == ["fused_mlp", "overflow_check"]
    assert not any(r["on"] for r in perf.report(recipe, []))
    with pytest.raises(ValueError, match="unknown speed-up"):
        perf.report(recipe, ["fused_mlpp"])
    with pytest.raises(ValueError, match="model.fused_mlp=False turns it off"):
        perf.report(_recipe(model_dir, "model.fused_mlp=false"), ["fused_mlp"])


def _zero_optimizer(stage3: bool = False, **flags):
    """A DeepSpeed ZeRO optimizer object with the flags install_overflow_check reads, made without an engine."""
    if stage3:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as cls
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as cls
    opt = cls.__new__(cls)
    opt.check_grad_overflow, opt.compute_grad_norm, opt.cpu_offload = True, True, False
    vars(opt).update(flags)
    return opt


def test_apply_engine_decides_per_engine_and_changes_only_that_optimizer(model_dir):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from finetune.perf.overflow_check import _norm_decides

    norm, deepspeed_check = _recipe(model_dir), _recipe(model_dir, "optim.overflow_check=deepspeed")
    class_method = DeepSpeedZeroOptimizer.check_overflow
    opt, other = _zero_optimizer(), _zero_optimizer()
    assert perf.apply_engine(SimpleNamespace(optimizer=opt), norm) == ["overflow_check"]
    assert vars(opt)["check_overflow"] is _norm_decides
    assert DeepSpeedZeroOptimizer.check_overflow is class_method and "check_overflow" not in vars(other)
    not_applied = {
        "optim.overflow_check=deepspeed": (_zero_optimizer(), deepspeed_check),
        "ZeRO-0 (a torch optimizer)": (torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]), norm),
        "ZeRO-3": (_zero_optimizer(stage3=True), norm),
        "bf16.check_grad_overflow=false": (_zero_optimizer(check_grad_overflow=False), norm),
        "no gradient norm": (_zero_optimizer(compute_grad_norm=False), norm),
        "CPU offload": (_zero_optimizer(cpu_offload=True), norm),
    }
    for case, (optimizer, recipe) in not_applied.items():
        assert perf.apply_engine(SimpleNamespace(optimizer=optimizer), recipe) == [], case
        assert "check_overflow" not in vars(optimizer), case


def test_liger_stand_ins_compute_what_transformers_computes(model_dir):
    """The per-instance installation itself: every norm, MLP and attention of the model runs the given kernels (RoPE
    through the attention forward's own globals, its deprecate_kwarg wrapper kept), with transformers' result."""
    plain, _ = _build(model_dir, "lora.enabled=false")
    patched, _ = _build(model_dir, "lora.enabled=false")
    before = _library_state()
    assert liger.install(patched, STAND_IN) == 5 + 2 + 2  # norms (2 per layer and the final one), MLPs, attentions
    _assert_same(before, _library_state())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    CALLS.clear()
    expected = plain(input_ids=ids, labels=ids).loss
    assert CALLS == []
    got = patched(input_ids=ids, labels=ids).loss
    assert torch.equal(got, expected)
    assert sorted(CALLS) == sorted(["rms_norm"] * 5 + ["mlp"] * 2 + ["rope"] * 2)
    attn = patched.model.layers[0].self_attn
    rebuilt = attn.forward.__func__
    assert rebuilt is not type(attn).forward and getattr(rebuilt, "__wrapped__", rebuilt).__globals__ is not vars(_mm())


def test_two_models_in_one_process_are_independent(model_dir, usable):
    """A model with every speed-up, then a plain one: the plain one is transformers' and peft's own and trains, and
    no library module or class changed."""
    fast, recipe = _build(model_dir, *ALL_ON)
    before = _library_state()
    assert perf.apply(fast, recipe, STAGE2_FP32) == MODEL_NAMES
    _assert_same(before, _library_state())
    mm = _mm()
    assert (mm.apply_rotary_pos_emb is _ORIGINAL_ROPE and before["modeling_mistral.MistralRMSNorm"] is mm.MistralRMSNorm
            and before["modeling_mistral.MistralMLP"] is mm.MistralMLP)

    plain, plain_recipe = _build(model_dir, "lora.enabled=true", *ALL_OFF)
    assert perf.apply(plain, plain_recipe, STAGE2_FP32) == []
    _assert_same(before, _library_state())
    _assert_plain(plain)
    assert _marks(plain) == set() and plain.config._attn_implementation == "sdpa"
    plain.train()
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    CALLS.clear()
    losses = []
    for _ in range(5):
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert CALLS == []  # not one stand-in kernel ran in the plain model


def test_readme_names_each_speed_up_its_switch_and_an_existing_parity_test():
    with open(os.path.join(ROOT, "finetune", "perf", "README.md")) as f:
        text = f.read()
    for s in perf.SPEEDUPS:
        assert f"`{s.name}`" in text and f"`{s.switch}`" in text, s.name
    for path, test in set(re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", text)):
        with open(os.path.join(ROOT, path)) as f:
            assert re.search(rf"^def {test}\(", f.read(), re.M), f"{path}::{test}"
    for page in set(re.findall(r"\((?:\.\./\.\./)?(docs/benchmarks/[\w.-]+\.md)", text)):
        assert os.path.isfile(os.path.join(ROOT, page)), page


@pytest.mark.skipif(liger.available() is not None, reason=str(liger.available()))
def test_real_liger_kernels_per_model_on_cuda(model_dir):
    """liger-kernel's kernels through perf.apply: the same loss as transformers' modules (fp32), and neither
    transformers' module nor a model built afterwards is touched."""
    plain, recipe_off = _build(model_dir, "lora.enabled=false", *ALL_OFF)
    fast, recipe = _build(model_dir, "lora.enabled=false", "model.kernels=liger", "model.fused_mlp=false",
                          "model.fused_loss=false", "model.attn_implementation=sdpa")
    before = _library_state()
    assert perf.apply(fast, recipe, STAGE2_FP32) == ["liger"]
    _assert_same(before, _library_state())
    later, _ = _build(model_dir, "lora.enabled=false")
    _assert_plain(later)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    losses = [m.cuda()(input_ids=ids, labels=ids).loss for m in (plain, fast)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
