"""The peer zerotune is measured against: Hugging Face Trainer + DeepSpeed (what axolotl and LLaMA-Factory run
underneath) on Mistral-7B's shape, at its defaults or at hand-tuned settings. One run per launch:

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 benchmarks/peer_hf_trainer.py --model /tmp/init --zero 2 \
        --micro-batch 8 --grad-accum 1 --checkpointing on --liger off --steps 12 --skip 4 --out peer.json

Work per step is the same as zerotune's in benchmarks/vs_peer.py: rows of --seq tokens (no padding), the same rows
per GPU per step, bf16, AdamW (the Trainer's default, torch's fused AdamW), lr 1e-5. Rank 0 writes the step times,
tokens/s per GPU and the peak memory of each GPU to --out.

A step's time is the wall time from the end of the step before to its own end, as zerotune's is (from the top of
its step loop, data included, to the step's reduced sums): the Trainer fetches and collates a step's micro-batches
and counts (and gathers) their target tokens before `on_step_begin`, so begin-to-end timing would leave that work
out for the peer only. The begin-to-end times are kept too (`step_times_callback`).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def ds_config(stage: int) -> dict:
    """The DeepSpeed JSON of the transformers documentation's examples, with "auto" values filled by the Trainer."""
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9,
                    stage3_gather_16bit_weights_on_model_save=True)
    else:
        zero.update(allgather_bucket_size=2e8, reduce_scatter=True)
    return {"bf16": {"enabled": "auto"}, "zero_optimization": zero, "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}


class StepClock:
    """Step times from the Trainer's step callbacks: `times` from the end of the step before to this step's end (the
    first step: from its begin), `callback_times` from on_step_begin to on_step_end."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.callback_times: list[float] = []
        self._begin: float | None = None
        self._last_end: float | None = None

    def begin(self, now: float) -> None:
        self._begin = now

    def end(self, now: float) -> None:
        self.callback_times.append(now - self._begin)
        self.times.append(now - (self._last_end if self._last_end is not None else self._begin))
        self._last_end = now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a saved Mistral-7B-shaped model folder")
    p.add_argument("--zero", type=int, choices=(2, 3), required=True)
    p.add_argument("--lora", action="store_true", help="LoRA r16 on all seven projections (else full fine-tuning)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--checkpointing", choices=("on", "off"), default="on")
    p.add_argument("--liger", choices=("on", "off"), default="off")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=4, help="steps left out of the averages (warm-up)")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # TrainingArguments first: with a ZeRO-3 config it makes from_pretrained build the model under zero.Init.
    targs = TrainingArguments(
        output_dir="/tmp/peer_out", per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=1e-5, warmup_steps=2,
        bf16=True, gradient_checkpointing=args.checkpointing == "on",
        gradient_checkpointing_kwargs={"use_reentrant": False}, use_liger_kernel=args.liger == "on",
        deepspeed=ds_config(args.zero), logging_steps=10**6, save_strategy="no", report_to=[],
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]))
    rows = args.micro_batch * args.grad_accum * world * args.steps
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (rows, args.seq), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]

    clock = StepClock()

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            torch.cuda.synchronize()
            clock.begin(time.perf_counter())

        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            clock.end(time.perf_counter())

    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Timer()],
                      data_collator=lambda b: {k: torch.stack([x[k] for x in b]) for k in b[0]})
    trainer.train()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    gathered = [torch.zeros_like(peak) for _ in range(world)]
    torch.distributed.all_gather(gathered, peak)
    if int(os.environ.get("RANK", "0")) == 0:
        kept = clock.times[args.skip:]
        tokens_per_gpu = args.micro_batch * args.grad_accum * args.seq
        step_time = sum(kept) / len(kept)
        with open(args.out, "w") as f:
            json.dump({"step_times": clock.times, "step_times_callback": clock.callback_times, "step_time_s": step_time,
                       "tokens_per_s_per_gpu": tokens_per_gpu / step_time,
                       "peak_mem_gib": max(float(t) for t in gathered), "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
