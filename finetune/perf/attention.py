"""zerotune's block-sparse attention (`model.attn_implementation: flex`): packed samples and the sliding window as a
FlexAttention block mask, so masked blocks are skipped and no S x S mask ever exists.

    install(model)                       # by perf.apply: this model's configs name KEY, nothing else changes
    out, _ = attention(module, q, k, v, None, position_ids=position_ids, scaling=..., sliding_window=4096)

The mask comes from position_ids alone, as transformers' masking_utils reads packed rows: a document starts wherever
position_ids[i] != position_ids[i-1] + 1 (a sample restarting at 0, the padding after the last one), and a query sees
the keys of its own document, causally, and, with a sliding window W, those with kv > q - W (W keys, itself
included: masking_utils.sliding_window_overlay). One addition, which transformers' own attention does not make: a
document that starts at position p > 0 continues the first p tokens of the document before it (a preference pair's
rejected response after the prompt it shares with the chosen one, laid out once: finetune/data/loader.py), so its
queries also see those keys, and the window counts positions. One mask function (`document_mask`) is evaluated on
both devices: by FlexAttention's block mask on CUDA, and as a dense boolean mask for scaled_dot_product_attention
elsewhere (FlexAttention has no CPU backward), so the CPU tests check the CUDA path's mask logic. Where that mask is
plain causal (one document per row, no window inside it), the CUDA path runs SDPA's causal kernel instead
(`plain_causal`).

How it is installed: transformers' Mistral attention looks its function up by config._attn_implementation at forward
time, and the model builds its mask through AttentionMaskInterface under the same key. KEY is added to both
interfaces (an added key changes no model that does not name it) and set on the given model's configs only. Its mask
function builds no mask for a training forward (no cache, no padding mask); with a KV cache or a 2-D padding mask
(generation, `zerotune chat`) it builds sdpa's mask, and `attention` then runs transformers' sdpa with that mask, so
generation is exactly sdpa's.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

KEY = "zerotune_flex"
"""The key in transformers' AttentionInterface and AttentionMaskInterface; only models whose config names it use it."""


def available() -> str | None:
    """Why the compiled FlexAttention path cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "FlexAttention's compiled kernels need a CUDA GPU"
    if importlib.util.find_spec("triton") is None:
        return "FlexAttention's compiled kernels need triton"
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


def resolve(name: str, device_type: str) -> str:
    """model.attn_implementation as this device runs it: `auto` is `flex` on CUDA where FlexAttention runs, `sdpa`
    elsewhere; every other value stays itself (`flex` included, which runs its exact dense path off CUDA). An
    explicit `flex` on a CUDA machine that cannot compile it is an error, not a silent fallback."""
    if name == "auto":
        return "flex" if device_type == "cuda" and available() is None else "sdpa"
    if name == "flex" and device_type == "cuda" and (why := available()):
        from finetune.config import ConfigError

        raise ConfigError(f"model.attn_implementation=flex: {why}; set model.attn_implementation=auto or sdpa")
    return name


# --- the mask ---------------------------------------------------------------------------------------------------------

def _document_breaks(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] True where a document begins: a position that is not its predecessor's plus one."""
    return torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] position_ids -> [b, s] document index per token: a new one wherever a position is not its predecessor's
    plus one (transformers' find_packed_sequence_indices, without its shortcut for unpacked rows)."""
    return _document_breaks(position_ids).cumsum(-1)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] position_ids -> [b, s] the position each token's document starts at: 0, except for a document that
    continues a shared prompt (a preference pair's rejected sequence after its chosen one: loader.collate)."""
    index = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    breaks = _document_breaks(position_ids)
    first = torch.cummax(torch.where(breaks, index, torch.zeros_like(index)), dim=-1).values  # its first token
    return position_ids - (index - first)


def document_mask(docs: torch.Tensor, window: int | None, positions: torch.Tensor | None = None,
                  starts: torch.Tensor | None = None) -> Callable:
    """The mask_mod (b, h, q, kv) -> allowed: causal, inside the sliding window, and the same document, or, for a
    document starting at position p > 0 (`starts`), the first p tokens of the document before it: the shared prompt
    it continues. `docs` (and `positions`, `starts`, given together) are [1, s] (every row alike) or [b, s]; the
    indices may be scalars (FlexAttention) or broadcasting tensors (dense path). Without positions, a token's
    position is its place in its document counted from 0, and the window counts places in the row."""
    one_row = docs.shape[0] == 1  # one row for the whole batch: b is no index into it

    def at(t, b, i):
        return t[0][i] if one_row else t[b, i]

    def mask_mod(b, h, q, kv):
        keep = at(docs, b, q) == at(docs, b, kv)
        if positions is not None:  # a continued document also sees the shared prompt before it
            keep = keep | ((at(docs, b, q) == at(docs, b, kv) + 1) & (at(positions, b, kv) < at(starts, b, q)))
        keep = keep & (q >= kv)
        if window is not None:  # in positions: a continued document's distance to its prompt is not the row's
            keep = keep & ((at(positions, b, kv) > at(positions, b, q) - window) if positions is not None
                           else (kv > q - window))
        return keep

    return mask_mod


def dense_mask(mask_mod: Callable, rows: int, length: int, device: torch.device) -> torch.Tensor:
    """[rows, 1, s, s] boolean mask of mask_mod: the exact reference, for tests and tiny CPU models only."""
    b = torch.arange(rows, device=device).view(-1, 1, 1, 1)
    idx = torch.arange(length, device=device)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    return mask_mod(b, h, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1))


# --- the attention function -------------------------------------------------------------------------------------------

def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
              position_ids: torch.Tensor | None = None, scaling: float | None = None, dropout: float = 0.0,
              sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function: query [b, hq, s, d], key/value [b, hkv, s, d] -> ([b, s, hq, d],
    None). The mask is derived from position_ids ([b, s] or [1, s]; None: one causal document per row).

    A mask from the mask interface (only built with a cache or a padding mask) or keys longer than the queries (a
    cache's past) is generation: transformers' sdpa runs it, with that mask, as it would without zerotune."""
    if attention_mask is not None or key.shape[-2] != query.shape[-2]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout > 0:
        raise ValueError(f"model.attn_implementation=flex has no attention dropout (this model's is {dropout}); "
                         "set model.attn_implementation=sdpa to train with attention dropout")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads")
    length = query.shape[-2]
    if position_ids is not None and position_ids.shape[-1] != length:
        raise ValueError(f"position_ids cover {position_ids.shape[-1]} tokens but the attention sees {length}: "
                         "pass the position_ids of the whole sequence the queries span")
    gqa = query.shape[1] != key.shape[1]
    if query.device.type == "cuda":
        block_mask = _block_mask(position_ids, length, query.device, sliding_window)
        if block_mask is CAUSAL:  # the mask is plain causal: SDPA's causal kernel skips the same blocks, faster
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                                   enable_gqa=gqa)
        else:
            out = _flex()(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    else:
        docs, positions, starts = _layout(position_ids, length, query.device)
        mask = dense_mask(document_mask(docs, sliding_window, positions, starts), docs.shape[0], length, query.device)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                               enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def _layout(position_ids: torch.Tensor | None, length: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(document ids, positions, document starts) of the rows; positions and starts are None where no document
    continues a shared prompt (every start is 0), so the mask is the plain document mask."""
    if position_ids is None:
        return torch.zeros(1, length, dtype=torch.long, device=device), None, None
    positions = position_ids.to(device).view(-1, length)
    starts = document_starts(positions)
    if not torch.compiler.is_compiling() and not bool(starts.any()):  # a host sync, once per forward on CUDA
        return document_ids(positions), None, None
    return document_ids(positions), positions, starts


# --- CUDA: compiled FlexAttention, one block mask per forward ---------------------------------------------------------

# Sequence lengths differ between micro-batches (a packed row is as long as the micro-batch's longest). Both
# compiled functions use torch.compile's default automatic dynamic shapes: the first length compiles static kernels,
# the first different length recompiles once with a symbolic length, and later lengths reuse that graph. Padding
# q/k/v internally to a multiple of the block size was the other choice: it keeps every kernel static, but costs a
# copy of q, k, v and the output per layer (sizeable at long context) and still one compile per distinct padded
# length, enough distinct lengths to pass dynamo's recompile limit and fall back to unfused eager attention.
# FlexAttention masks a last partial block itself, so lengths need not be multiples of the block size.
_COMPILED: dict[str, Callable] = {}


def _flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # inside a compiled model: its graph compiles flex_attention
        return flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention)
    return _COMPILED["flex"]


def _create_block_mask() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    if torch.compiler.is_compiling():
        return create_block_mask
    if "block_mask" not in _COMPILED:
        # compiled, the mask is evaluated block by block: eager create_block_mask materialises the S x S mask
        _COMPILED["block_mask"] = torch.compile(create_block_mask)
    return _COMPILED["block_mask"]


@dataclass
class _Cached:
    position_ids: torch.Tensor | None
    version: int
    length: int
    device: torch.device
    window: int | None
    block_mask: object


_CACHE: list[_Cached] = []
"""The last block mask built. Every layer of a forward (and its recomputation) passes the same position_ids; under
sequence parallelism each layer gets a fresh tensor of equal content, hence the comparison by value."""


def _same_positions(cached: torch.Tensor | None, version: int, position_ids: torch.Tensor | None) -> bool:
    if cached is None or position_ids is None:
        return cached is None and position_ids is None
    if cached is position_ids and position_ids._version == version:
        return True
    return (cached.shape == position_ids.shape and cached.device == position_ids.device
            and bool(torch.equal(cached, position_ids)))


CAUSAL = "causal"
"""_block_mask's answer when every row is one document and the window (if any) spans the row: the mask is exactly
is_causal's, and SDPA's causal flash kernel runs it faster than FlexAttention over the causal block mask."""


def plain_causal(docs: torch.Tensor, window: int | None, length: int) -> bool:
    """Whether document_mask(docs, window) over `length` tokens is the plain causal mask: one document in every row
    (a padded tail counts as a document of its own) and no key outside the window."""
    return (window is None or window >= length) and not bool(docs.any())


def _block_mask(position_ids: torch.Tensor | None, length: int, device: torch.device, window: int | None):
    """The block mask of this forward, or CAUSAL; one per forward (every layer and recomputation asks again)."""
    if not torch.compiler.is_compiling() and _CACHE:
        c = _CACHE[0]
        if (c.length, c.device, c.window) == (length, device, window) and _same_positions(
                c.position_ids, c.version, position_ids):
            return c.block_mask
    docs, positions, starts = _layout(position_ids, length, device)
    if not torch.compiler.is_compiling() and plain_causal(docs, window, length):  # one host sync per forward
        block_mask = CAUSAL
    else:
        block_mask = _create_block_mask()(document_mask(docs, window, positions, starts), docs.shape[0], None,
                                          length, length, device=device)
    if not torch.compiler.is_compiling():
        version = position_ids._version if position_ids is not None else 0
        _CACHE[:] = [_Cached(position_ids, version, length, device, window, block_mask)]
    return block_mask


# --- installing it on one model ---------------------------------------------------------------------------------------

def _mask_interface(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, attention_mask=None,
                    **kwargs):
    """KEY's entry in transformers' AttentionMaskInterface: no mask for a training forward (the attention derives
    it from position_ids); with a cache's offsets, keys beyond the queries or a 2-D padding mask, sdpa's mask."""
    training_forward = (attention_mask is None and q_length == kv_length
                        and _is_zero(q_offset) and _is_zero(kv_offset))
    if training_forward:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0


def register() -> None:
    """Add KEY to transformers' attention and mask interfaces (idempotent); no existing key changes."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(KEY, attention)
    AttentionMaskInterface.register(KEY, _mask_interface)


def install(model) -> int:
    """Make this model (peft-wrapped or not) use `attention`. Returns how many configs changed."""
    register()
    return name_attention(model, KEY)


def name_attention(model, key: str) -> int:
    """Set attention interface `key` on every config this model's modules carry (peft-wrapped or not), and on no
    other model's; transformers' sub-config setter carries it into their sub-configs. Returns how many changed."""
    configs = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    for config in configs.values():
        config._attn_implementation = key
    return len(configs)


def installed(model) -> bool:
    """Whether this model's attention is zerotune's."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == KEY
