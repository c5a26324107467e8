"""Sequence parallelism (`train.sequence_parallel: N`): each row's sequence split over N ranks, DeepSpeed Ulysses.

    degree = parallel.resolve_degree(recipe, world, model_config=cfg)   # prepare: validated, before any rank starts
    groups = parallel.groups.build(degree)                              # after dist.init: the groups, DeepSpeed's mpu
    parallel.ulysses.install(model, groups)                             # this model's attention: all-to-all around it
    mb = parallel.split.split_rows(mb, degree, groups.sp_rank, pad_id)  # each rank's slice (the loader calls it)

The N ranks of one group take the same rows (the loader sees the data-parallel world, world / N) and each keeps a
contiguous slice of every row. Around attention an all-to-all turns [slice, all heads] into [whole row, heads / N]
and back (ulysses.py), so every layer but attention runs on the slice alone. The ZeRO partitions and the gradient
reduction span all ranks (DeepSpeed's sequence-data-parallel group), the batch per step is the data-parallel one.

This module imports no torch: the launcher (finetune/multinode) checks the degree against the world size with it.
"""

from finetune.parallel.degree import check_world, data_parallel_size, degree_of, layout, resolve_degree

__all__ = ["check_world", "data_parallel_size", "degree_of", "layout", "resolve_degree"]
