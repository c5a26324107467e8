"""Activation memory of one micro-batch per GPU: what autograd saves per decoder layer, what checkpointing keeps (on the
GPU or, with `offload`, in CPU memory), and the transient working set of backward, at any sequence length.

    acts = estimate_activations(config, lora, seq_len=131072, micro_batch=1, checkpointing="full",
                                attn_implementation="flex", tiled_mlp=True, sequence_parallel=2)
    acts["kept"] + acts["transient"]        # bytes per GPU at the peak of backward; acts["cpu"]: offloaded inputs

Counted tensor by tensor from transformers' Mistral (bf16) and checked against torch's saved-tensor hooks
(tests/unit/test_estimate.py); the constants that calibration may tune are in finetune/memory/calibration.py.
"""

from __future__ import annotations

from typing import Any

from finetune.memory import calibration as cal
from finetune.memory.shapes import dims, heads, linear_shapes, lora_settings

CHECKPOINTING = ("none", "selective", "full", "offload")


def attention_kind(setting: str, cuda: bool | None = None) -> str:
    """model.attn_implementation as a run resolves it: `auto` = flex on CUDA, sdpa elsewhere. cuda=None asks this
    machine; `zerotune estimate` passes True (it estimates GPU runs on any machine)."""
    if setting != "auto":
        return setting
    if cuda:
        return "flex"
    import torch  # lazy: see shapes.lora_settings

    from finetune.perf import attention

    return attention.resolve(setting, "cuda" if cuda is None and torch.cuda.is_available() else "cpu")


def mlp_tile_tokens() -> int:
    """Tokens per tile of the tiled MLP (finetune/perf/tiled_mlp.py; the most: a micro-batch is cut into equal tiles)."""
    from finetune.perf.tiled_mlp import TILE_TOKENS  # lazy: that module imports torch

    return TILE_TOKENS


def tiled_mlp_on(setting: str, seq_len: int) -> bool:
    """model.tiled_mlp resolved as finetune/perf/tiled_mlp.py's `wanted`: `auto` = on when rows are longer than a tile."""
    from finetune.perf.tiled_mlp import wanted  # lazy: that module imports torch

    if setting not in ("auto", "on", "off"):
        raise ValueError(f"model.tiled_mlp must be auto, on or off, got {setting!r}")
    return wanted(setting, seq_len)


def kv_share(cfg: dict[str, Any], sp: int) -> float:
    """The part of k and v (per token of this rank's sequence share) that a rank holds in attention under sequence
    parallelism: 1 until the degree passes the kv heads, whose copies each rank then holds whole."""
    kv_heads = heads(cfg)[1]
    return max(1.0, sp / kv_heads)


def _layer_bytes(cfg: dict[str, Any], lora: dict[str, Any] | None, seq_len: int, d: int, attn: str, packing: bool,
                 mask_bytes: int, ad: int, first: bool = False, liger: bool = False, fused_mlp: bool = False,
                 tiled: bool = False, sp: int = 1) -> float:
    """Bytes autograd saves per token (of this rank's share of the rows) in one decoder layer (transformers' Mistral,
    traced with saved-tensor hooks).

    liger (model.kernels): liger-kernel's RMSNorm saves its 16-bit input and rstd (transformers' keeps an fp32 copy
    and the normalised x), its SwiGLU saves gate and up (transformers' also silu(gate)); from liger's autograd code.
    fused_mlp (finetune/perf/fused_mlp.py): the MLP keeps gate and up only, where down_proj is not LoRA-adapted.
    tiled (model.tiled_mlp): the MLP keeps its input only; its adapters' tensors are rebuilt a tile at a time.
    sp (sequence parallelism): attention holds the whole sequence for heads/sp, the same bytes as this rank's tokens
    for every head, except a mask (the whole sequence's, per rank) and k/v heads copied to more ranks than they are.
    """
    h, i, q, kv, _, _ = dims(cfg)
    n_heads = heads(cfg)[0]
    shapes = linear_shapes(cfg)
    fused = lora is not None and lora["fused"] and ad == d  # finetune/perf/fused_lora.py; mixed dtypes run peft's forward
    keeps_out = lora is None or ("o_proj" in lora["targets"] and (lora["dropout"] == 0 or fused))
    # o_proj's input is attention's saved output, except under sequence parallelism (the all-to-all's copy) or where
    # the output is copied to o_proj's layout
    out_copy = d * q * ((1 if sp > 1 else 0) + (cal.ATTENTION_OUTPUT_COPIES if attn == "flex" else 0)) if keeps_out else 0
    if attn == "sdpa":
        # q, k, v after RoPE, the output (also o_proj's input), fp32 log-sum-exp; with a mask, transformers repeats
        # k/v to every head, and a packed batch's block-diagonal mask is materialised per layer in the activations'
        # dtype: seq_len values per token, for the whole sequence on every rank
        kv_saved = q if packing else kv * kv_share(cfg, sp)
        attention = d * (2 * q + 2 * kv_saved) + 4 * n_heads + (d * seq_len * sp if packing else 0) + out_copy
    elif attn in ("flex", "flash_attention_2"):
        # q, k, v (GQA: k/v not repeated), the output, fp32 log-sum-exp; no mask per token (flex's block mask is one
        # per micro-batch: estimate_activations), flash's varlen needs none
        attention = d * (2 * q + 2 * kv * kv_share(cfg, sp)) + 4 * n_heads + out_copy
    else:
        # eager: q, k, v repeated to every head, the fp32 softmax plus its 16-bit copy for every (query, key) pair,
        # and o_proj's input when something keeps it (a trained o_proj, or its adapter without dropout).
        attention = d * (q + 2 * q + (q if keeps_out else 0)) + n_heads * seq_len * (4 + d)
    norm_full = 4 * h + 4 + 2 * d * h  # fp32 input, rstd, normalised x (weight grad), output (projections' input)
    if liger:
        norm_full = 2 * d * h + 4  # input, rstd, output (the projections' input)
    if lora is None:  # gate, up, silu(gate), product (down's input); tiled: none (its input is the norm's output)
        return 2 * norm_full + attention + (0 if tiled else 2 if fused_mlp else 3 if liger else 4) * d * i
    norm = d * h + 4 if liger else 4 * h + 4  # frozen weights: neither the normalised x nor the projections' input
    mlp = d * h if tiled else (2 if liger or fused_mlp else 3) * d * i  # tiled: its input; else silu(gate)'s input
    adapters = 0.0                                                       # and both factors of the product
    shared = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in", "up_proj": "mlp_in",
              "o_proj": "attn_out", "down_proj": "down_in"}
    inputs_saved = set()
    for t in lora["targets"]:
        if t == "lm_head" or (tiled and t in ("gate_proj", "up_proj", "down_proj")):
            continue
        width = shapes[t][0]
        adapters += ad * lora["rank"]  # lora_A's output, saved by lora_B
        if fused or (lora["dropout"] == 0 and ad == d):
            # x itself is kept, once per distinct input (attention keeps o_proj's); the fused function adds a bool
            # mask per adapter (native_dropout's), or only a seed with the Triton dropout (finetune/perf/lora_dropout.py)
            adapters += width if lora["dropout"] > 0 and not (fused and lora["seeded_dropout"]) else 0
            if shared[t] not in inputs_saved and shared[t] != "attn_out":
                inputs_saved.add(shared[t])
                adapters += d * width
        elif lora["dropout"] > 0:
            # each adapter drops its own copy of the input: lora_A keeps it, dropout keeps the mask (none is needed
            # in the first layer, where nothing upstream is trained)
            no_mask = first and shared[t] == "attn_in"
            adapters += ad * width + (0 if no_mask else mask_bytes * width)
        else:  # peft casts the input to the adapters' dtype, a copy per adapter
            adapters += ad * width
    norms = norm if first else 2 * norm  # the first layer's input norm: its input (the frozen embedding) needs no grad
    return norms + attention + mlp + adapters


def kept_inputs(layers: int, segment: int | None) -> int:
    """The layer inputs kept through backward under full or offload checkpointing: every layer's, or under two-level
    recomputation one per segment (finetune/model/two_level.py). model.offload_layers counts among these."""
    return -(-layers // (segment or 1))


def recomputed_layers(checkpointing: str, layers: int, recompute_layers: int | None = None) -> list[int]:
    """The decoder layers recomputed in backward: none; all (full, offload); `recompute_layers` of them spread evenly,
    layer 0 first (selective; null = every second one: 0, 2, 4...)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be none, selective, full or offload, got {checkpointing!r}")
    if checkpointing != "selective":
        return [] if checkpointing == "none" else list(range(layers))
    if recompute_layers is None:
        return list(range(0, layers, 2))
    if not 0 < recompute_layers <= layers:
        raise ValueError(f"model.recompute_layers={recompute_layers}: the model has {layers} decoder layers, so "
                         f"selective checkpointing recomputes 1 to {layers} of them")
    return [j * layers // recompute_layers for j in range(recompute_layers)]


def attention_backward_bytes(cfg: dict[str, Any], attn: str, seq_len: int, packing: bool, d: int, sp: int) -> float:
    """Per token of this rank's share: attention's gradient buffers in one layer's backward (dq, dk, dv as attention
    saved q, k, v; the fp32 row sums of dO x O; eager's score-sized gradient)."""
    h, _, q, kv, _, _ = dims(cfg)
    n_heads = heads(cfg)[0]
    if attn == "eager":
        return d * 3 * q + n_heads * seq_len * 4
    kv_saved = q if attn == "sdpa" and packing else kv * kv_share(cfg, sp)
    sets = cal.ATTENTION_GRAD_SETS + (1 if sp > 1 else 0)
    return sets * d * (q + 2 * kv_saved) + 4 * n_heads


def estimate_activations(config_dict: dict[str, Any], lora_cfg: Any, seq_len: int, micro_batch: int,
                         checkpointing: str = "full", dtype_bytes: int = 2, attn_implementation: str = "sdpa",
                         packing: bool = True, dropout_mask_bytes: int = 1,
                         adapter_dtype_bytes: int | None = None, fused_loss: bool = False,
                         liger: bool = False, recompute_layers: int | None = None,
                         fused_mlp: bool = False, tiled_mlp: bool = False,
                         sequence_parallel: int = 1, recompute_segment: int | None = None,
                         offload_layers: int | None = None) -> dict[str, float]:
    """Activation bytes of one micro-batch (rows of seq_len tokens) per GPU, at the peak of backward.

    checkpointing: none keeps every layer's activations; full keeps each layer's input and recomputes one layer at a
    time in backward; selective recomputes `recompute_layers` of them (recomputed_layers); offload is full with the
    layers' inputs in CPU memory (`cpu`), a few on the GPU at a time. The loss adds the 16-bit logits kept by the
    training loop, their fp32 copy and the fp32 log-softmax (10 bytes per vocabulary entry per token in bf16).
    dropout_mask_bytes: CUDA's dropout keeps a bool mask; the CPU kernel keeps one in the input's dtype.
    adapter_dtype_bytes: the LoRA adapters' width when it differs from the activations' (fp32 under ZeRO-0's autocast).
    fused_loss (finetune/perf/fused_loss.py): one chunk of rows' logits at a time; the gradients of the head's input
    (and of its weight, when trained: an fp32 sum while it is built) are computed in forward and held until backward.
    fused_mlp (finetune/perf/fused_mlp.py): each MLP keeps gate and up, not their product, which backward rebuilds one
    layer at a time. It applies where down_proj is a plain linear layer, not LoRA-adapted (and not under tiled_mlp).
    tiled_mlp: each MLP keeps its input; one tile's intermediates exist at a time (mlp_tile).
    sequence_parallel: each rank holds seq_len / sequence_parallel tokens of every row (_layer_bytes for attention).
    recompute_segment (under full or offload; finetune/model/two_level.py): one layer in k keeps its input; while
    backward runs through a segment, its other k - 1 inputs are rebuilt and held at once.
    offload_layers (under offload): how many of the kept inputs are in CPU memory; the others stay on the GPU.

    Keys: kept (layers + other + the loss's: held through backward) and transient (the largest of one layer's
    backward, one MLP tile, one loss chunk) make total; saved is what autograd holds after forward (the hooks' count).
    """
    lora = lora_settings(lora_cfg)
    sp = max(1, int(sequence_parallel))
    fused_mlp = fused_mlp and not tiled_mlp and (lora is None or "down_proj" not in lora["targets"])
    h, i, q, _, layers, vocab = dims(config_dict)
    tokens = seq_len * micro_batch / sp  # this rank's share
    d = dtype_bytes
    attn = attention_kind(attn_implementation, cuda=False) if attn_implementation == "auto" else attn_implementation
    layer_args = (config_dict, lora, seq_len, d, attn, packing, dropout_mask_bytes, adapter_dtype_bytes or d)
    kw = {"liger": liger, "fused_mlp": fused_mlp, "tiled": tiled_mlp, "sp": sp}
    per_layer = _layer_bytes(*layer_args, **kw)
    first = _layer_bytes(*layer_args, first=True, **kw) if lora is not None else per_layer
    recomputed = len(recomputed_layers(checkpointing, layers, recompute_layers))  # layer 0 among them, if any
    kept = layers - recomputed
    segment = recompute_segment if recompute_segment and checkpointing in ("full", "offload") else 1
    inputs = kept_inputs(layers, segment)
    rebuilt = (segment - 1) * d * h  # a segment's other inputs, rebuilt in backward
    cpu = 0.0
    if lora is not None and checkpointing == "none":
        saved_layers = first + (layers - 1) * per_layer
    elif checkpointing == "offload":
        # The offloaded inputs come back a few at a time, when backward reaches the first layers; by then the inputs
        # kept on the GPU (the last layers', model.offload_layers) are freed: the larger of the two is held at once.
        offloaded = min(offload_layers or inputs, inputs)
        saved_layers = max(inputs - offloaded, min(offloaded, cal.OFFLOAD_GPU_LAYER_INPUTS)) * d * h
        cpu = tokens * offloaded * d * h
    else:
        # a checkpointed layer keeps only its input, and under two-level only a segment's first layer
        saved_layers = kept * per_layer + (recomputed - layers + inputs) * d * h
    recompute = per_layer if recomputed else 0.0  # one layer's activations rebuilt at a time in backward
    recompute += d * i if fused_mlp else 0  # and one layer's MLP product
    rope = 2 * d * (q // heads(config_dict)[0])  # cos and sin, shared by every layer
    lm_head_trained = lora is None or "lm_head" in lora["targets"]
    # the final norm saves what a layer's does: its 16-bit input and rstd under liger, else an fp32 copy
    final_norm = (d * h if liger else 4 * h) + 4 + (2 * d * h if lm_head_trained and not fused_loss else 0)
    ids = 8 if lora is None else 0  # the embedding's backward needs the token ids
    block_mask = 0.0
    if attn == "flex":  # one block mask per micro-batch, the whole rows' on every rank
        blocks = -(-seq_len // cal.FLEX_BLOCK)
        block_mask = micro_batch * blocks * blocks * 4 * cal.FLEX_BLOCK_MASK_TENSORS
    loss_chunk = 0.0
    if fused_loss:
        from finetune.perf.fused_loss import CHUNK_ROWS  # lazy: that module imports torch (see shapes.lora_settings)

        head = vocab * h if lm_head_trained else 0
        loss_saved = tokens * d * h + d * head  # the head's input and weight gradients
        loss_chunk = min(tokens, CHUNK_ROWS) * vocab * (8 + d) + 4 * head  # a chunk's fp32 logits, softmax, 16-bit grad
        loss_kept = loss_saved  # the chunk exists in forward only
    else:
        loss_saved = tokens * 4 * vocab  # fp32 log-softmax, kept for backward
        loss_kept = loss_saved + tokens * (d + 4) * vocab  # and the 16-bit logits held by the loop, their fp32 copy
    attention_backward = tokens * attention_backward_bytes(config_dict, attn, seq_len, packing, d, sp)
    mlp_tile = 0.0
    if tiled_mlp:
        # one tile's intermediates, the gradient of the MLP's whole input, and the trained MLP parameters' gradients:
        # a tile's in 16 bits and their fp32 sums over the tiles
        mlp_targets = [] if lora is None else [t for t in lora["targets"] if t in ("gate_proj", "up_proj", "down_proj")]
        shapes = linear_shapes(config_dict)
        trained = 3 * h * i if lora is None else sum(lora["rank"] * sum(shapes[t]) for t in mlp_targets)
        mlp_tile = (min(tokens, mlp_tile_tokens()) * cal.MLP_TILE_TENSORS * d * i + tokens * d * h
                    + (d + 4) * trained)
    # One layer's backward: its activations (rebuilt, if recomputed), the residual stream's gradients and attention's
    # gradient buffers. Backward runs from the last layer to the first and frees each layer's saved tensors as it
    # leaves it, so while layer j runs backward only layers < j still hold theirs: with frozen weights (LoRA) the
    # peak is the largest of (what layers < j hold) + (layer j's backward). A fully trained layer's backward also
    # builds its weights' gradients (and ZeRO-3 gathers the next layers' weights): one more layer's activations stand
    # for that working set (docs/benchmarks/2026-11-30-2xh200-vs-peer.md).
    grads = tokens * cal.RESIDUAL_GRADS * d * h + attention_backward
    own = tokens * (recompute if lora is None else per_layer + (d * i if fused_mlp and recomputed else 0))
    held_before = [0.0]
    if lora is not None and checkpointing != "offload" and segment == 1:  # offloaded inputs are in CPU memory
        chosen = set(recomputed_layers(checkpointing, layers, recompute_layers))
        saved = [d * h if j in chosen else (first if j == 0 else per_layer) for j in range(layers)]
        held_before = [tokens * (sum(saved[:j]) - saved_layers) for j in range(layers)]  # relative to all layers
    if segment > 1 and checkpointing == "full":
        # Backward through segment s holds the kept inputs of segments <= s (later ones are freed) and s's other
        # inputs, rebuilt at once; the layer recomputed first is the segment's last, whose rebuilt input is the one
        # its input norm saves under liger (own counts it again).
        lengths = [min(segment, layers - start) for start in range(0, layers, segment)]
        shared = d * h if liger else 0
        extra = max((n - 1 - (len(lengths) - 1 - s)) * d * h - (shared if n > 1 else 0) for s, n in enumerate(lengths))
        layer_backward = max(tokens * extra + own + grads, grads)
    else:
        layer_backward = max(max(held_before) + own + grads, grads) + tokens * rebuilt
    # The caching allocator serves a multi-GiB request only from a free block as large: beside an untiled MLP's
    # [tokens, intermediate] tensors of a long row, one such block stays reserved but unused (an untiled 262,144-token
    # row ran out of memory with that much reserved and free).
    largest = tokens * d * i
    layer_backward += largest if not tiled_mlp and largest >= cal.LARGE_TENSOR_BYTES else 0
    out = {
        "tokens": tokens,
        "layers": tokens * saved_layers,
        "recompute": tokens * recompute,
        "other": tokens * (rope + final_norm + ids) + block_mask,
        "logits": loss_kept + loss_chunk,
        "attention_backward": attention_backward,
        "layer_backward": layer_backward,
        "mlp_tile": mlp_tile,
        "loss_chunk": loss_chunk,
        "cpu": cpu,
    }
    out["saved"] = out["layers"] + out["other"] + loss_saved  # what autograd holds after forward
    out["kept"] = out["layers"] + out["other"] + loss_kept  # held through backward
    out["transient"] = max(layer_backward, mlp_tile, loss_chunk)
    out["total"] = out["kept"] + out["transient"]
    return out
