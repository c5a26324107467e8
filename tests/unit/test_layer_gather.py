"""finetune/perf/layer_gather.py: which modules become DeepSpeed's ZeRO-3 leaf modules, and that layer 0's input
then requires a gradient (so the leaf's full backward hook fires after the layer's whole backward). The gradients
under ZeRO-3 with it (on by default for LoRA): tests/integration/test_parity.py, LoRA ZeRO-3 against plain PyTorch."""

import torch
from deepspeed.utils import z3_leaf_module
from peft import LoraConfig, get_peft_model
from transformers import MistralConfig, MistralForCausalLM

from finetune.perf.layer_gather import decoder_layers, install_layer_gather


def _lora_model():
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    return get_peft_model(MistralForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_the_decoder_layers_become_leaf_modules_and_nothing_else():
    model = _lora_model()
    layers = decoder_layers(model)
    assert len(layers) == 3 and all(type(m).__name__ == "MistralDecoderLayer" for m in layers)
    assert install_layer_gather(model)
    assert [m for m in model.modules() if z3_leaf_module(m)] == layers


def test_layer_zeros_input_requires_a_gradient_after_install():
    model = _lora_model()
    seen = []

    def note(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).requires_grad)

    decoder_layers(model)[0].register_forward_pre_hook(note, with_kwargs=True)
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids)
    install_layer_gather(model)
    model(input_ids=ids).logits.sum().backward()
    assert seen == [False, True]  # LoRA's frozen embeddings give no gradient until the hook asks for one
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_a_model_without_decoder_layers_is_left_alone():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 4), torch.nn.Linear(4, 4))
    assert not install_layer_gather(model)
    assert not any(z3_leaf_module(m) for m in model.modules())
