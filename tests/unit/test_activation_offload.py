"""model.activation_checkpointing: offload (finetune/model/activation_offload.py): every layer recomputed as under `full`,
the same loss and gradients bit for bit (full fine-tune and LoRA with dropout), and what each layer keeps for
backward is its input alone, packed by the offload hooks into CPU memory.

On a GPU: the inputs really leave the device (pinned copies) and the device memory after forward drops by one
[tokens, hidden] tensor per layer (tests/gpu/test_gpu_checkpoint_offload.py)."""

import pytest
import torch

from finetune.model import activation_offload
from finetune.config import load_recipe
from finetune.model.build import build_model
from tests.helpers import SMALL_VOCAB_LAYERS as LAYERS, TINY_RECIPE, save_tiny_model

FP32 = {"bf16": {"enabled": False}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("offload") / "model"))


def _run(model_dir, checkpointing, lora, packed=None, inputs=None):
    recipe = load_recipe(TINY_RECIPE, [f"model.path={model_dir}", f"model.activation_checkpointing={checkpointing}",
                                       f"lora.enabled={str(lora).lower()}", "lora.dropout=0.1", "lora.rank=4"])
    model, _ = build_model(recipe.model, recipe.lora, FP32)
    model.train()
    layers = model.get_decoder().layers
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        if inputs is not None:
            layer.input_layernorm.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone()))
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)  # LoRA dropout: the same masks in both runs
    loss = model(input_ids=ids, labels=ids).loss
    if packed is not None:
        packed.append("forward done")
    loss.backward()
    return loss.detach(), calls, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
def test_losses_and_gradients_equal_full_recomputation(model_dir, lora):
    loss_full, calls_full, grads_full = _run(model_dir, "full", lora)
    loss_off, calls_off, grads_off = _run(model_dir, "offload", lora)
    assert calls_full == calls_off == [2] * LAYERS  # every layer recomputed (recomputed_layers' full)
    assert torch.equal(loss_off, loss_full)
    assert grads_off.keys() == grads_full.keys() and len(grads_full) > LAYERS
    for name, grad in grads_full.items():
        assert torch.equal(grads_off[name], grad), name


def test_each_layer_keeps_only_its_input_and_it_goes_through_the_offload_hooks(model_dir, monkeypatch):
    """The hooks pack exactly one tensor per layer in forward, the layer's input hidden state, and hand back a CPU
    tensor (a CPU tensor stays itself; a device tensor becomes a CPU copy: test_device_tensors_are_copied_to_the_host);
    backward unpacks each once."""
    events, inputs = [], []
    pack, unpack = activation_offload.to_host, activation_offload.to_device

    def recording_pack(t):
        packed = pack(t)
        events.append(("pack", t.shape, (packed if isinstance(packed, torch.Tensor) else packed[1]).device.type))
        return packed

    def recording_unpack(packed):
        events.append(("unpack",))
        return unpack(packed)

    monkeypatch.setattr(activation_offload, "to_host", recording_pack)
    monkeypatch.setattr(activation_offload, "to_device", recording_unpack)
    _run(model_dir, "offload", False, packed=events, inputs=inputs)
    cut = events.index("forward done")
    # Some transformers versions hand the checkpoint an extra empty tensor per layer: packed too, it costs nothing.
    packed = [e for e in events[:cut] if e[1].numel() > 0]
    assert packed == [("pack", torch.Size([2, 40, 128]), "cpu")] * LAYERS
    assert events[cut + 1:] == [("unpack",)] * cut
    assert len(inputs) == 2 * LAYERS  # forward, then the recomputation's, which restores the offloaded inputs
    for first, again in zip(inputs[:LAYERS], reversed(inputs[LAYERS:])):
        assert torch.equal(first, again)


def test_device_tensors_are_copied_to_the_host():
    """The pack keeps a CPU tensor as it is and moves anything else; unpack returns it to its device."""
    t = torch.randn(3, 5)
    assert activation_offload.to_host(t) is t and activation_offload.to_device(t) is t
    if not torch.cuda.is_available():
        pytest.skip("the device copy needs CUDA (tests/gpu/test_gpu_checkpoint_offload.py)")
    d = t.cuda()
    device, host = activation_offload.to_host(d)
    assert host.device.type == "cpu" and host.is_pinned() and device == d.device
    assert torch.equal(activation_offload.to_device((device, host)), d)
