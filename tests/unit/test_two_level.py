"""model.recompute_segment (finetune/model/two_level.py): two-level recomputation gives `full` checkpointing's loss and
gradients bit for bit in fp32 (LoRA with dropout, whose masks the rebuild must draw again; full fine-tuning; the
inputs in CPU memory; the tiled MLP), and costs what it should: one more forward of each layer that is not the first
of its segment, and one kept hidden state per segment.

ZeRO-2 and ZeRO-3 engines on 2 ranks: tests/integration/test_two_level.py."""

import pytest
import torch

from finetune.config import ConfigError, load_recipe
from finetune.model.build import _enable_checkpointing
from finetune.model.two_level import segment_checkpoints
from tests.fixtures.fused_lora_checks import TARGETS
from tests.helpers import TINY_RECIPE

LAYERS = 5


def _model(lora: bool, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg)
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=TARGETS))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.2)
    return model


def _base(model):
    from peft import PeftModel

    return model.base_model.model if isinstance(model, PeftModel) else model


def _step(model, segment, offload=False, tiled=False, offload_layers=None):
    """Loss, every gradient, and how many times each decoder layer's forward ran, for one training step."""
    base = _base(model)
    _enable_checkpointing(base, list(range(LAYERS)), offload=offload, segment=segment, offload_layers=offload_layers)
    if tiled:
        from finetune.perf import tiled_mlp

        assert tiled_mlp.install_tiled_mlp(model, 0, max_tokens=48, tile_tokens=16) == LAYERS
    runs = [0] * LAYERS
    for i, layer in enumerate(base.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    model.train()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, runs


@pytest.mark.parametrize("lora,offload,tiled", [(True, False, False), (False, False, False), (True, True, False),
                                                (True, False, True)], ids=["lora-dropout", "full", "offload", "tiled"])
def test_two_level_gives_full_checkpointings_loss_and_gradients(lora, offload, tiled):
    dropout = 0.3 if lora else 0.0
    ref_loss, ref, _ = _step(_model(lora, dropout), None, offload, tiled)
    for segment in (2, 3):
        loss, grads, runs = _step(_model(lora, dropout), segment, offload, tiled)
        assert loss == ref_loss
        assert grads.keys() == ref.keys() and len(grads) > 0
        assert all(torch.equal(grads[n], ref[n]) for n in ref), [n for n in ref if not torch.equal(grads[n], ref[n])]
        # layer forwards through the module: once in forward, and once more for each layer whose output is the input
        # of the next layer of its segment (the rebuild); a segment's last layer's output is rebuilt by no one
        last = {min(s + segment, LAYERS) - 1 for s in range(0, LAYERS, segment)}
        assert runs == [1 if i in last else 2 for i in range(LAYERS)], (segment, runs)


def test_a_layer_called_with_hidden_states_by_keyword_keeps_one_input_per_segment_too():
    """Some transformers versions call each decoder layer with hidden_states=...: the checkpoint would then hold it in
    the function it is given, out of the hooks' reach. It is passed positionally instead, and the rebuild still runs."""
    model = _model(lora=True, dropout=0.3)
    ref_loss, ref, _ = _step(_model(lora=True, dropout=0.3), None)
    base = _base(model)
    for layer in base.model.layers:  # the model's loop, as such a version writes it
        forward = layer.forward
        layer.forward = lambda hidden_states, *a, _f=forward, **k: _f(*a, hidden_states=hidden_states, **k)
    loss, grads, runs = _step(model, 2)
    assert loss == ref_loss and all(torch.equal(grads[n], ref[n]) for n in ref)
    assert runs == [2, 1, 2, 1, 1]


def test_a_layer_checkpointed_through_its_bound_call_as_older_transformers_do():
    """Older transformers versions checkpoint partial(nn.Module.__call__ bound to the layer, **kwargs) with
    hidden_states positional: the rebuild replays that bound call (hooks included), not the layer's own __call__, which
    would checkpoint again."""
    from functools import partial

    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    class OlderLayer(MistralDecoderLayer):
        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(partial(torch.nn.Module.__call__.__get__(self), **kwargs), *args)
            return torch.nn.Module.__call__(self, *args, **kwargs)

    OlderLayer.forward = getattr(MistralDecoderLayer.forward, "__wrapped__", MistralDecoderLayer.forward)
    model = _model(lora=True, dropout=0.3)
    ref_loss, ref, _ = _step(_model(lora=True, dropout=0.3), None)
    for layer in _base(model).model.layers:
        layer.__class__ = OlderLayer
    loss, grads, runs = _step(model, 2)
    assert loss == ref_loss and all(torch.equal(grads[n], ref[n]) for n in ref)
    # through the module's call: forward, the rebuild (layers 0 and 2) and the checkpoint's recompute of every layer
    assert runs == [3, 2, 3, 2, 2]


@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offload"])
def test_after_forward_only_each_segments_first_input_is_alive(offload):
    """What the memory saving rests on: between forward and backward nothing holds the inputs of a segment's later
    layers (autograd keeps the saved-tensor hooks until backward, so they must not hold them either). Under offload the
    first input lives on in CPU memory only, a copy; the layer's own input tensor is freed too."""
    import weakref

    model = _model(lora=True, dropout=0.3)
    base = _base(model)
    _enable_checkpointing(base, list(range(LAYERS)), offload=offload, segment=2)
    inputs = []
    for layer in base.model.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: inputs.append(weakref.ref(a[0] if a else kw["hidden_states"]))
                                        if torch.is_grad_enabled() else None, with_kwargs=True)
    model.train()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    alive = [r() is not None for r in inputs]
    # the CPU "copy" of a CPU tensor is the tensor itself (to_host): under offload the firsts stay alive here too
    assert alive == [True, False, True, False, True], alive
    loss.backward()


@pytest.mark.parametrize("segment", [None, 2], ids=["every-input", "two-level"])
def test_only_the_first_offload_layers_inputs_go_to_cpu_memory(segment, monkeypatch):
    """model.offload_layers = 2 of 5 layers (plain offload: every layer keeps its input) or of 3 segments (two-level,
    segments of 2): the first two kept inputs, which backward needs last, go through the offload hooks' copy to CPU
    memory, the others stay where they are; the loss and gradients are `full` checkpointing's bit for bit."""
    from finetune.model import activation_offload, two_level

    copied = []

    def recording(to_host):
        return lambda t: (copied.append(t.data_ptr()), to_host(t))[1]

    monkeypatch.setattr(activation_offload, "to_host", recording(activation_offload.to_host))
    monkeypatch.setattr(two_level, "to_host", recording(two_level.to_host))
    ref_loss, ref, _ = _step(_model(True, 0.3), None)
    model = _model(True, 0.3)
    inputs = []
    for layer in _base(model).model.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: inputs.append(a[0].data_ptr()) if torch.is_grad_enabled()
                                        else None, with_kwargs=True)
    loss, grads, _ = _step(model, segment, offload=True, offload_layers=2)
    assert loss == ref_loss and all(torch.equal(grads[n], ref[n]) for n in ref)
    kept = [0, 1, 2, 3, 4] if segment is None else [0, 2, 4]
    assert copied == [inputs[i] for i in kept[:2]], (copied, inputs)


def test_one_hidden_state_is_kept_per_segment():
    """What the checkpoints save for their layers' inputs: the first of each segment the tensor, the others a handle."""
    saved = []
    plain = segment_checkpoints(list(range(7)), 3, lambda f, *a, **k: torch.utils.checkpoint.checkpoint(
        f, *a, use_reentrant=False, **k))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.w(x))

    from functools import partial

    layers = [Layer() for _ in range(7)]
    x = torch.randn(3, 4, requires_grad=True)

    def spy(pack):
        def wrapped(t):
            packed = pack(t)
            if isinstance(packed, tuple) and isinstance(packed[0], str):  # ours, not the checkpoint's own hooks
                saved.append(packed[0])
            return packed
        return wrapped

    original = torch.autograd.graph.saved_tensors_hooks.__init__

    def spying_init(self, pack, unpack):
        original(self, spy(pack), unpack)

    torch.autograd.graph.saved_tensors_hooks.__init__ = spying_init
    try:
        h = x
        for i, layer in enumerate(layers):
            h = plain[i](partial(Layer.forward, layer), h)
    finally:
        torch.autograd.graph.saved_tensors_hooks.__init__ = original
    # layers 0-2, 3-5, 6: three segments; the inner tensors of each layer are the checkpoint's own, not seen here
    assert saved.count("start") == 3 and saved.count("rebuild") == 4 and saved.count("other") == 0, saved
    h.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_segment_needs_full_or_offload_and_two_layers():
    load_recipe(TINY_RECIPE, ["model.recompute_segment=4"])  # the tiny recipe recomputes every layer
    with pytest.raises(ConfigError, match="model.recompute_segment"):
        load_recipe(TINY_RECIPE, ["model.recompute_segment=4", "model.activation_checkpointing=selective"])
    with pytest.raises(ConfigError, match="model.recompute_segment"):
        load_recipe(TINY_RECIPE, ["model.recompute_segment=1"])


def test_offload_layers_needs_offload_and_a_count():
    load_recipe(TINY_RECIPE, ["model.activation_checkpointing=offload", "model.offload_layers=2"])
    for wrong in (["model.offload_layers=2"], ["model.activation_checkpointing=offload", "model.offload_layers=0"]):
        with pytest.raises(ConfigError, match="model.offload_layers needs a whole number > 0 and "
                                              "model.activation_checkpointing=offload"):
            load_recipe(TINY_RECIPE, wrong)


def test_the_estimate_keeps_one_input_per_segment_and_holds_a_segments_rebuilt_inputs():
    """Mistral-7B's 32 layers at 524,288 tokens in segments of 6 (6, 6, 6, 6, 6, 2 layers): 6 kept inputs instead of 32
    (on the GPU under full, in CPU memory under offload). Backward through the fifth segment holds the kept inputs of
    the first five (the sixth's is freed) and its 5 rebuilt ones: 4 more than the 6 counted as kept. Under liger the
    input norm of the layer being recomputed saves that layer's rebuilt input itself, so it is counted once: 3."""
    import json
    import os

    from finetune.memory.activations import estimate_activations
    from tests.helpers import ROOT

    with open(os.path.join(ROOT, "recipes", "mistral7b_shape", "config.json")) as f:
        cfg = json.load(f)
    one_input = 524288 * 4096 * 2
    for lora in (None, {"enabled": True, "rank": 16, "target_modules": TARGETS}):
        for liger in (False, True):
            full, two = (estimate_activations(cfg, lora, 524288, 1, "full", liger=liger, recompute_segment=k)
                         for k in (None, 6))
            assert full["layers"] - two["layers"] == (32 - 6) * one_input
            # LoRA's full checkpointing counts its last layer's input once, among the kept ones (-1 in layer_backward)
            held = (3 if liger else 4) + (1 if lora else 0)
            assert two["layer_backward"] - full["layer_backward"] == held * one_input, (lora, liger)
            assert two["total"] < full["total"] - 20 * one_input  # 26 fewer kept, at most 5 more held in backward
    off_full, off_two = (estimate_activations(cfg, None, 524288, 1, "offload", recompute_segment=k) for k in (None, 6))
    assert (off_full["cpu"], off_two["cpu"]) == (32 * one_input, 6 * one_input)
    # model.offload_layers: 4 kept inputs in CPU memory, the others on the GPU; those are freed before backward
    # reaches the first layers, whose inputs come back 2 at a time: the larger of the two is held
    for k, kept in ((None, 32), (6, 6)):
        part = estimate_activations(cfg, None, 524288, 1, "offload", recompute_segment=k, offload_layers=4)
        every = off_full if k is None else off_two
        assert (part["cpu"], every["layers"]) == (4 * one_input, 2 * one_input)
        assert part["layers"] == max(kept - 4, 2) * one_input
        assert part["total"] - every["total"] == part["layers"] - every["layers"]
