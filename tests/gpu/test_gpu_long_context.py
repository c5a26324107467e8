"""Long rows on a GPU: checkpoint offload (finetune/model/activation_offload.py) moves each layer's input off the device and
changes no gradient; the tiled MLP (finetune/perf/tiled_mlp.py) cuts the step's peak memory, keeps the gradients of
the untiled bf16 model and runs no tile in a layer's recomputation. Needs CUDA; CI (CPU) skips it. The lead's GPU call runs it:

    .venv/bin/python -m pytest -q tests/gpu/test_gpu_long_context.py
"""

import copy

import pytest
import torch

from finetune.perf.fused_mlp import install_fused_mlp
from finetune.perf.tiled_mlp import install_tiled_mlp
from tests.fixtures.tile_log import log_tiles

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HIDDEN, INTERMEDIATE, LAYERS, TOKENS = 1024, 3584, 4, 16384


def _model(checkpointing: str):
    from transformers import MistralConfig, MistralForCausalLM

    from finetune.model.build import _enable_checkpointing

    cfg = MistralConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=TOKENS,
                        sliding_window=None, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).to(torch.bfloat16).cuda().train()
    if checkpointing != "none":
        _enable_checkpointing(model, list(range(LAYERS)), offload=checkpointing == "offload")
    return model


def _ids():
    return torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(1)).cuda()


def test_offload_keeps_layer_inputs_in_host_memory_with_the_same_gradients():
    ids, after_forward, results = _ids(), {}, {}
    for mode in ("full", "offload"):
        model = _model(mode)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        after_forward[mode] = torch.cuda.memory_allocated() - base
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        del model, loss
        torch.cuda.empty_cache()
    layer_input = TOKENS * HIDDEN * 2
    assert after_forward["full"] - after_forward["offload"] >= 0.9 * LAYERS * layer_input, after_forward
    assert torch.equal(results["full"][0], results["offload"][0])
    # CUDA's embedding and attention backward add in no fixed order, in bf16: compare each gradient as a whole
    for name, grad in results["full"][1].items():
        err = (results["offload"][1][name].float() - grad.float()).norm() / grad.float().norm().clamp_min(1e-12)
        assert err < 1e-2, (name, err.item())


def test_tiled_mlp_lowers_the_peak_and_keeps_the_bf16_gradients():
    ids, peaks, grads = _ids(), {}, {}
    plain = _model("full")
    install_fused_mlp(plain, zero_stage=0, liger=False)
    tiled = copy.deepcopy(plain)
    install_tiled_mlp(tiled, zero_stage=0, max_tokens=TOKENS, tile_tokens=HIDDEN)
    logs = [log_tiles(m) for n, m in tiled.named_modules() if n.endswith(".mlp")]
    for name, model in (("plain", plain), ("tiled", tiled)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters()}
    # one layer's recomputed MLP keeps gate and up (and rebuilds the product): 2 x tokens x intermediate bf16 values
    assert peaks["plain"] - peaks["tiled"] >= TOKENS * INTERMEDIATE * 2 * 2 * 0.8, peaks
    # Every layer recomputed: its tiles run in forward and in backward, not in the layer's recomputation, which runs
    # on autograd's device thread (finetune/model/recompute.py marks it there)
    tiles = [n for log in logs for n in log]
    assert tiles == [HIDDEN] * (TOKENS // HIDDEN) * 2 * LAYERS, len(tiles)
    for name, g in grads["plain"].items():
        err = (grads["tiled"][name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 2e-2, (name, err.item())
