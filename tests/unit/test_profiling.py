"""train.profile_step's report without a run: the categories kernel names fall into (those of the H200 profiles in
docs/benchmarks/vs_peer/), the timeline split and the idle time by host phase. Through a real training run on CPU:
tests/integration/test_profiling.py."""


import pytest



@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", "matmul"), ("aten::mm", "matmul"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("_swiglu_backward_kernel", "fused (triton)"), ("_rms_norm_forward_kernel", "fused (triton)"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", "optimizer"),
    ("Command Buffer Full", "other")])
def test_profile_categories(name, kind):
    from finetune.perf.profiling import category

    assert category(name) == kind


@pytest.mark.parametrize("name, counted", [
    ("nccl:_all_gather_base", False), ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True),
    ("Optimizer.step#AdamW.step", False), ("Command Buffer Full", False), ("record_param_comms", False),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", True), ("Memcpy DtoD (Device -> Device)", True),
    ("zerotune:backward", False)])
def test_annotations_mirroring_kernels_are_not_counted(name, counted):
    """The H200 profile of full ZeRO-3 listed `nccl:_all_gather_base` beside its kernel, with the same 0.395 s."""
    from finetune.perf.profiling import is_kernel

    assert is_kernel(name) is counted


def test_timeline_splits_the_span_into_compute_exposed_communication_and_idle():
    """Two compute kernels (0-4, 3-6), a collective overlapping the second and running on alone (5-8), a gap (8-9),
    then compute (9-10): compute 7 s, communication alone 2 s, idle 1 s, span 10 s."""
    from finetune.perf.profiling import timeline

    t = timeline([(0, 4, False), (3, 6, False), (5, 8, True), (9, 10, False)])
    assert t == {"span": 10, "compute": 7, "exposed_comm": 2, "idle": 1}
    assert timeline([]) == {"span": 0.0, "compute": 0.0, "exposed_comm": 0.0, "idle": 0.0}


def test_idle_time_is_split_by_the_host_phase_it_fell_in():
    """Kernels 0-2, 3-5, 5.5-6, 9-10: gaps 2-3, 5-5.5 and 6-9. The host was in `backward` over 1.5-3.2 and in
    `optimizer step` over 5.8-8; the gaps' other 1.5 s (5-5.5, 8-9) fell outside both."""
    from finetune.perf.profiling import idle_by_phase

    split = idle_by_phase([(0, 2), (3, 5), (5.5, 6), (9, 10), (1, 1.5)],
                          [("backward", 1.5, 3.2), ("optimizer step", 5.8, 8.0)])
    assert split == pytest.approx({"optimizer step": 2.0, "other host work": 1.5, "backward": 1.0})
    assert list(split) == ["optimizer step", "other host work", "backward"]  # largest first
    assert idle_by_phase([(0, 1), (0.5, 2)], [("forward", 0, 2)]) == {}  # no gap, no idle
