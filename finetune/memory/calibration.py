"""The estimator's tunable constants, in one place: each says what it stands for. Calibrating the estimates against
GPU peaks (`zerotune estimate --seq-lens ... --json` gives every term per length, for the lead's runs to compare
with) changes these and nothing else. Everything not here is counted tensor by tensor from the model's shape.
"""

FIT_FRACTION = 0.9
"""A plan fits when its estimated peak is at most this part of the GPU: the rest goes to the CUDA context, NCCL
buffers and the caching allocator's fragmentation."""

RESIDUAL_GRADS = 2
"""[tokens, hidden] gradient tensors alive while one decoder layer runs backward: the residual stream's gradient
entering the layer and the one it is building."""

LARGE_TENSOR_BYTES = 2**30
"""From this size on, an activation tensor's request leaves one block of its size reserved and unused at the peak
(the caching allocator cannot serve it from smaller freed blocks); counted for the untiled MLP's largest tensor."""

ATTENTION_GRAD_SETS = 1
"""Sets of attention-core gradients (dq, dk, dv: the q/k/v shapes attention saved) alive at once in its backward.
Under sequence parallelism one more set exists: the all-to-all's copies (activations.py adds it)."""

ATTENTION_OUTPUT_COPIES = 0
"""Extra [tokens, q width] copies of flex attention's output that o_proj keeps besides the one attention saves: 0
when FlexAttention writes its output in the query's [b, s, heads, d] layout (transformers' q is a transposed view),
so that finetune/perf/attention.py's transpose(1, 2).contiguous() copies nothing; 1 if it copies."""

MLP_TILE_TENSORS = 7
"""[tile tokens, intermediate] tensors alive at once in one tile of the tiled MLP's backward: gate, up, silu(gate)
and their product recomputed, and the gradients of the product, gate and up."""

OFFLOAD_GPU_LAYER_INPUTS = 2
"""Decoder-layer inputs on the GPU at once under `activation_checkpointing: offload`: the layer being recomputed and
the next one copied back from CPU memory ahead of it."""

FLEX_BLOCK = 128
"""FlexAttention's block size (tokens per side): the block mask has (row length / FLEX_BLOCK) squared entries."""

FLEX_BLOCK_MASK_TENSORS = 4
"""int32 [rows, query blocks, key blocks] tensors a block mask keeps for a step (partial and full blocks, for forward
and for backward); all layers share one mask."""
