"""Preference objectives on packed pairs: DPO, IPO, ORPO and SimPO, from per-sequence log-probabilities.

    logps, counts = sequence_logps(logits, targets, mb["sample_index"], n_samples)   # chosen at 0::2, rejected at 1::2
    terms = pair_losses("dpo", logps[0::2], logps[1::2], counts[0::2], counts[1::2], ref_c, ref_r, beta=0.1)

A micro-batch of preference data holds whole pairs, chosen then rejected, each its own document in a packed row
(finetune/data/loader.py): one forward scores both. Each sequence's log-probability is the sum of its response
tokens' log-probabilities (prompt tokens are never targets), in fp32. The formulas are each paper's, with the
log-probability choices of TRL's trainers, so that a user moving over gets the same numbers:

- dpo (Rafailov et al. 2023): -log σ(β·((π_c − ρ_c) − (π_r − ρ_r))), summed log-probs; label smoothing ε gives the
  conservative form -(1−ε)·log σ(z) − ε·log σ(−z).
- ipo (Azar et al. 2023): ((π̄_c − ρ̄_c) − (π̄_r − ρ̄_r) − 1/(2β))², with per-token mean log-probs π̄.
- simpo (Meng et al. 2024): -log σ(β·(π̄_c − π̄_r) − γ); no reference.
- orpo (Hong et al. 2024): NLL of the chosen response (per-token mean) + β·(−log σ(log-odds(π̄_c) − log-odds(π̄_r))),
  log-odds(p) = p − log(1 − e^p); no reference. The NLL is the mean over a response's tokens, then over pairs.

The step's loss is the mean over the pairs of the whole global batch: a micro-batch returns its sum, and the step
divides by the global pair count (finetune/step.py), so accumulation and world size do not change it.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from finetune import dist
from finetune.config import ConfigError

OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
NEEDS_REFERENCE = ("dpo", "ipo")


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, sample_index: torch.Tensor,
                   n_samples: int, branch_targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of target-token log-probabilities, number of target tokens) per sample, fp32, shape [n_samples].

    logits [rows, width, vocab]; targets [rows, width] (next token, -100 where nothing is predicted);
    sample_index [rows, width]: which sample (0..n_samples-1) each position belongs to, -1 on padding;
    branch_targets [n, 4] (row, position, token, sample): second targets at positions whose own target belongs to
    another sample (a shared prompt's last position predicts both responses' first tokens: loader.collate)."""
    token_logps = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                   ignore_index=-100, reduction="none")
    index = sample_index.reshape(-1)
    on = (targets.reshape(-1) != -100) & (index >= 0)
    where = index.clamp(min=0)
    sums = torch.zeros(n_samples, dtype=torch.float32, device=logits.device)
    counts = torch.zeros(n_samples, dtype=torch.float32, device=logits.device)
    sums = sums.index_add(0, where, torch.where(on, token_logps, torch.zeros_like(token_logps)))
    counts = counts.index_add(0, where, on.float())
    if branch_targets is not None and len(branch_targets):
        row, position, token, sample = branch_targets.to(logits.device).unbind(1)
        extra = -F.cross_entropy(logits[row, position].float(), token, reduction="none")
        sums = sums.index_add(0, sample, extra)
        counts = counts.index_add(0, sample, torch.ones_like(extra))
    return sums, counts


def micro_batch_logps(logits: torch.Tensor, mb, device) -> tuple[torch.Tensor, torch.Tensor]:
    """sequence_logps of a collated micro-batch (finetune/data/loader.py collate) from its logits."""
    return sequence_logps(logits, mb["targets"].to(device), mb["sample_index"].to(device), len(mb["sample_ids"]),
                          mb.get("branch_targets"))


@dataclass
class PairTerms:
    """Per pair: the loss and what the step reports (rewards are β-scaled, as TRL logs them)."""

    loss: torch.Tensor
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def pair_losses(objective: str, chosen: torch.Tensor, rejected: torch.Tensor, chosen_count: torch.Tensor,
                rejected_count: torch.Tensor, ref_chosen: torch.Tensor | None = None,
                ref_rejected: torch.Tensor | None = None, beta: float = 0.1, gamma: float = 0.5,
                label_smoothing: float = 0.0) -> PairTerms:
    """The objective's per-pair terms from summed log-probs (policy and, for dpo/ipo, reference) and token counts."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown preference objective {objective!r}: one of {', '.join(OBJECTIVES)}")
    if objective in NEEDS_REFERENCE and (ref_chosen is None or ref_rejected is None):
        raise ValueError(f"{objective} needs the reference model's log-probabilities")
    mean_c, mean_r = chosen / chosen_count.clamp(min=1), rejected / rejected_count.clamp(min=1)
    if objective == "dpo":
        reward_c, reward_r = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        z = reward_c - reward_r
        loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
        return PairTerms(loss, reward_c.detach(), reward_r.detach(), chosen.detach(), rejected.detach())
    if objective == "ipo":
        ref_mean_c = ref_chosen / chosen_count.clamp(min=1)
        ref_mean_r = ref_rejected / rejected_count.clamp(min=1)
        h = (mean_c - ref_mean_c) - (mean_r - ref_mean_r)
        loss = (h - 1 / (2 * beta)) ** 2
        # reported as TRL's DPOTrainer reports every loss type: summed log-probs, rewards β·(π − ρ)
        reward_c, reward_r = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        return PairTerms(loss, reward_c.detach(), reward_r.detach(), chosen.detach(), rejected.detach())
    if objective == "simpo":
        loss = -F.logsigmoid(beta * (mean_c - mean_r) - gamma)
        return PairTerms(loss, (beta * mean_c).detach(), (beta * mean_r).detach(), mean_c.detach(), mean_r.detach())
    # orpo: log-odds of the mean token probability; log1p(-exp(x)) for x < 0, kept finite at x -> 0
    log_odds = (mean_c - mean_r) - (_log1mexp(mean_c) - _log1mexp(mean_r))
    loss = -mean_c - beta * F.logsigmoid(log_odds)
    return PairTerms(loss, (beta * mean_c).detach(), (beta * mean_r).detach(), mean_c.detach(), mean_r.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − e^x) for x < 0, clamped just below 0 (a mean log-prob of exactly 0 would make the odds infinite)."""
    return torch.log1p(-torch.exp(x.clamp(max=-1e-6)))


@contextlib.contextmanager
def adapters_off(module):
    """The LoRA model as its base: peft's adapters disabled inside (the reference of a LoRA run, no second model).
    zerotune's fused LoRA path falls back to peft's own forward while they are (finetune/perf/fused_lora.py)."""
    with module.disable_adapter():
        yield


STATS = ("chosen_reward", "rejected_reward", "accuracy", "chosen_logps", "rejected_logps")
"""What a preference step reports beside its loss, each a sum over pairs until the step divides by the pair count."""


def reference_kind(recipe) -> str | None:
    """The reference a run uses: None (sft, orpo and simpo need none), `adapters_off` or `precomputed`."""
    t = recipe.train
    if t.objective not in NEEDS_REFERENCE:
        return None
    if t.reference != "auto":
        return t.reference
    return "adapters_off" if recipe.lora.enabled else "precomputed"


def pairs_in(mb) -> int:
    """The number of whole pairs in a micro-batch (chosen and rejected are two samples each)."""
    return len(mb["sample_ids"]) // 2


class PreferenceLoss:
    """One micro-batch's summed pair losses and STATS for a recipe's preference objective.

    `precomputed` maps a split ("train", "eval") to the starting model's summed log-probs per sample (indices into
    that split's tokenized data), when the run's reference is precomputed."""

    def __init__(self, recipe, precomputed: dict[str, torch.Tensor] | None = None):
        t = recipe.train
        self.objective, self.beta, self.gamma = t.objective, t.beta, t.simpo_gamma
        self.reference = reference_kind(recipe)
        self.precomputed = precomputed or {}

    def __call__(self, engine, mb, device, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the pairs' losses, [len(STATS)] sums), both fp32 on the device; the loss carries the graph."""
        inputs = {"input_ids": mb["input_ids"].to(device), "position_ids": mb["position_ids"].to(device)}
        logps, counts = micro_batch_logps(engine(**inputs).logits, mb, device)
        ref = self._reference(engine, inputs, mb, device, split)
        terms = pair_losses(self.objective, logps[0::2], logps[1::2], counts[0::2], counts[1::2],
                            ref[0::2] if ref is not None else None, ref[1::2] if ref is not None else None,
                            beta=self.beta, gamma=self.gamma)
        stats = torch.stack([terms.chosen_reward.sum(), terms.rejected_reward.sum(),
                             (terms.chosen_reward > terms.rejected_reward).float().sum(),
                             terms.chosen_logps.sum(), terms.rejected_logps.sum()])
        return terms.loss.sum(), stats

    def _reference(self, engine, inputs, mb, device, split: str) -> torch.Tensor | None:
        if self.reference is None:
            return None
        if self.reference == "precomputed":
            return self.precomputed[split][mb["sample_ids"]].to(device=device, dtype=torch.float32)
        with torch.no_grad(), adapters_off(engine.module):
            # the module itself, not the engine: one forward without gradients is no step of the engine's
            return micro_batch_logps(engine.module(**inputs).logits, mb, device)[0]


def precompute_reference(engine, n_samples: int, micro_batches) -> torch.Tensor:
    """The current model's summed log-probs of each of `n_samples` samples (float64, on the CPU), every rank scoring its
    share of `micro_batches` (loader.eval_micro_batches: each rank gets as many, so ZeRO-3's gathers line up), summed
    over the ranks. Run before the first step, this is the reference of a full fine-tuning run."""
    out = torch.zeros(n_samples, dtype=torch.float64)
    device = next(engine.module.parameters()).device
    engine.eval()
    with torch.no_grad():
        for mb in micro_batches:
            if len(mb["sample_ids"]) == 0:
                engine.module(input_ids=mb["input_ids"].to(device), position_ids=mb["position_ids"].to(device))
                continue
            logits = engine.module(input_ids=mb["input_ids"].to(device),
                                   position_ids=mb["position_ids"].to(device)).logits
            out[mb["sample_ids"]] = micro_batch_logps(logits, mb, device)[0].double().cpu()
    engine.train()
    return dist.all_reduce_sum(out)  # each sample was scored by one rank; the others hold 0 there


def build_preference_loss(run, engine, scoring_batches, start_step: int) -> PreferenceLoss | None:
    """The run's PreferenceLoss (None for sft), saying which reference it uses. A precomputed reference is scored
    once, before the first step, and kept in the run folder with a fingerprint of the data it scored: a resumed run
    reads it back (its model is no longer the starting one) and refuses it for other data. `scoring_batches()` gives
    {split: (this rank's scoring micro-batches, the split's TokenizedData)} for "train" and, with eval data, "eval"."""
    from finetune.run import folder as run_folder  # lazy: the formulas above are tested without the run machinery

    r = run.recipe
    if r.train.objective == "sft":
        return None
    kind = reference_kind(r)
    precomputed = None
    if kind == "precomputed":
        out, splits = r.train.output_dir, scoring_batches()
        fingerprints = {split: data_fingerprint(data) for split, (_, data) in splits.items()}
        file = run_folder.path(out, run_folder.REFERENCE)
        if start_step > 0:  # a resume: the starting model is gone, its scores are in the run folder
            if not run_folder.has(out, run_folder.REFERENCE):
                raise ConfigError(f"{file} is missing: a resumed {r.train.objective} run needs the starting model's "
                                  f"log-probabilities it wrote before its first step. Start the run again from step 0 "
                                  f"(train.overwrite=true)")
            saved = run_folder.read_tensors(out, run_folder.REFERENCE)
            if saved.get("fingerprints") != fingerprints:
                raise ConfigError(f"{file} scored other data than this run's (data.* changed since the run started): "
                                  f"resume with the data the run started with, or start again from step 0 "
                                  f"(train.overwrite=true)")
            precomputed = {split: saved[split] for split in splits}
        else:  # a fresh start (train.overwrite may leave an older run's file: it is scored anew)
            precomputed = {split: precompute_reference(engine, len(data), batches)
                           for split, (batches, data) in splits.items()}
            if dist.is_main():
                run_folder.write_tensors(out, run_folder.REFERENCE, {**precomputed, "fingerprints": fingerprints})
    shown = {None: "none (the objective needs none)", "adapters_off": "the model with its LoRA adapters off",
             "precomputed": "the starting model's log-probabilities, computed once before the first step "
                            "(no second model)"}[kind]
    dist.print0(f"objective: {r.train.objective}, beta {r.train.beta:g}; reference: {shown}")
    return PreferenceLoss(r, precomputed)


def data_fingerprint(data) -> str:
    """SHA-256 of a split's tokens, labels and sample bounds: what a precomputed reference's indices refer to."""
    h = hashlib.sha256()
    for array in (data.input_ids, data.labels, data.offsets):
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()
