"""Oracles for the preference objectives (finetune/model/preference.py).

- sequence_logps on packed rows against a loop over samples (log_softmax and gather, one sample at a time);
- pair_losses of dpo, ipo, simpo and orpo against each paper's formula written out here in float64 (losses, rewards,
  gradients w.r.t. the policy log-probs), and against TRL's trainers where TRL is installed (a test-only dependency);
- PreferenceLoss on a tiny Mistral, pairs packed in one row, against a plain computation that scores every sequence
  on its own: LoRA with the adapters switched off as the reference, and full fine-tuning with a precomputed reference
  that must equal a frozen copy of the starting model.
"""

from __future__ import annotations

import copy
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import MistralConfig, MistralForCausalLM

from finetune.config import load_recipe
from finetune.data.loader import collate
from finetune.data.samples import TokenizedData
from finetune.model.preference import OBJECTIVES, PreferenceLoss, pair_losses, precompute_reference, sequence_logps

TOL = dict(rtol=1e-5, atol=1e-5)


# ---- sequence_logps -------------------------------------------------------------------------------------------------

def test_sequence_logps_matches_a_loop_over_samples():
    g = torch.Generator().manual_seed(0)
    vocab, width = 37, 24
    layout = [[7, 9, 5], [10, 8]]  # two rows, samples 0-2 and 3-4; the rest of each row is padding
    logits = torch.randn(len(layout), width, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (len(layout), width), generator=g)  # padding keeps real-looking targets
    sample_index = torch.full((len(layout), width), -1)
    s = 0
    for r, lengths in enumerate(layout):
        at = 0
        for n in lengths:
            sample_index[r, at:at + n] = s
            targets[r, at:at + 2] = -100  # the prompt is no target
            targets[r, at + n - 1] = -100  # nor the position after the sample's last token
            at, s = at + n, s + 1
    targets[1, 10:18] = -100  # sample 4 has no target at all: sum 0, count 0
    targets[0, 21] = -100  # padding with the ignore target as well
    n_samples = s

    sums, counts = sequence_logps(logits, targets, sample_index, n_samples)

    want_sums, want_counts = torch.zeros(n_samples), torch.zeros(n_samples)
    for k in range(n_samples):
        rows, cols = torch.nonzero(sample_index == k, as_tuple=True)
        for r, c in zip(rows.tolist(), cols.tolist()):
            if targets[r, c] != -100:
                want_sums[k] += torch.log_softmax(logits[r, c].float(), -1)[targets[r, c]]
                want_counts[k] += 1
    assert sums.dtype == counts.dtype == torch.float32
    assert want_counts.tolist() == [4, 6, 2, 7, 0]
    torch.testing.assert_close(counts, want_counts, rtol=0, atol=0)
    torch.testing.assert_close(sums, want_sums, rtol=1e-6, atol=1e-6)


def test_sequence_logps_scores_bf16_logits_in_fp32():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 6, 11, generator=g) * 4).bfloat16()
    targets = torch.tensor([[-100, 3, 5, 7, -100, 2]])
    index = torch.tensor([[0, 0, 0, 0, -1, -1]])
    sums, counts = sequence_logps(logits, targets, index, 1)
    want = sum(torch.log_softmax(logits[0, i].float(), -1)[targets[0, i]] for i in (1, 2, 3))
    assert sums.dtype == torch.float32 and counts.tolist() == [3.0]
    torch.testing.assert_close(sums, want.reshape(1), rtol=1e-6, atol=1e-6)


# ---- pair_losses against the papers ---------------------------------------------------------------------------------

def _pairs(seed: int, near_zero: bool = False) -> dict[str, torch.Tensor]:
    """Summed log-probs of policy and reference for 6 pairs, with their response lengths. near_zero: responses
    the policy is almost sure of (mean token log-prob down to -1e-3), where ORPO's log(1 - p) loses digits."""
    g = torch.Generator().manual_seed(seed)
    n_c = torch.randint(3, 30, (6,), generator=g).float()
    n_r = torch.randint(3, 30, (6,), generator=g).float()
    if near_zero:
        mean_c = -torch.logspace(-3, -1, 6)
        mean_r = -torch.logspace(-2.5, 0, 6).flip(0)
    else:
        mean_c = -torch.rand(6, generator=g) * 3 - 0.05
        mean_r = -torch.rand(6, generator=g) * 3 - 0.05
    return dict(chosen=mean_c * n_c, rejected=mean_r * n_r, chosen_count=n_c, rejected_count=n_r,
                ref_chosen=mean_c * n_c + torch.randn(6, generator=g) * 2,
                ref_rejected=mean_r * n_r + torch.randn(6, generator=g) * 2)


def _paper(objective: str, p: dict[str, torch.Tensor], beta: float, gamma: float, eps: float):
    """(loss, chosen reward, rejected reward) per pair, each paper's formula in float64."""
    pc, pr, rc, rr = p["chosen"], p["rejected"], p["ref_chosen"], p["ref_rejected"]
    nc, nr = p["chosen_count"], p["rejected_count"]
    if objective == "dpo":  # Rafailov et al. 2023, eq. 7; label smoothing: the conservative DPO (cDPO) loss
        z = beta * ((pc - rc) - (pr - rr))
        loss = -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
        return loss, beta * (pc - rc), beta * (pr - rr)
    if objective == "ipo":  # Azar et al. 2023, eq. 17 with tau = beta, on per-token mean log-probs
        h = (pc / nc - rc / nc) - (pr / nr - rr / nr)
        return (h - 1 / (2 * beta)) ** 2, beta * (pc - rc), beta * (pr - rr)
    if objective == "simpo":  # Meng et al. 2024, eq. 6
        mc, mr = pc / nc, pr / nr
        return -torch.log(torch.sigmoid(beta * mc - beta * mr - gamma)), beta * mc, beta * mr
    # orpo: Hong et al. 2024, eqs. 4-7: odds(y|x) = P / (1 - P), P the per-token mean probability
    mc, mr = pc / nc, pr / nr
    odds_c, odds_r = torch.exp(mc) / (1 - torch.exp(mc)), torch.exp(mr) / (1 - torch.exp(mr))
    loss = -mc - beta * torch.log(torch.sigmoid(torch.log(odds_c / odds_r)))
    return loss, beta * mc, beta * mr


def _ours(objective: str, p: dict[str, torch.Tensor], dtype=torch.float32, **kwargs):
    """pair_losses on leaf copies of the policy log-probs: (terms, chosen leaf, rejected leaf)."""
    chosen = p["chosen"].to(dtype).clone().requires_grad_()
    rejected = p["rejected"].to(dtype).clone().requires_grad_()
    rest = {k: p[k].to(dtype) for k in ("chosen_count", "rejected_count", "ref_chosen", "ref_rejected")}
    return pair_losses(objective, chosen, rejected, **rest, **kwargs), chosen, rejected


@pytest.mark.parametrize("near_zero", [False, True], ids=["typical", "near-certain"])
@pytest.mark.parametrize("objective,beta,gamma,eps", [
    ("dpo", 0.1, 0.0, 0.0), ("dpo", 0.5, 0.0, 0.2), ("ipo", 0.1, 0.0, 0.0), ("ipo", 0.7, 0.0, 0.0),
    ("simpo", 2.0, 0.5, 0.0), ("simpo", 10.0, 1.6, 0.0), ("orpo", 0.1, 0.0, 0.0), ("orpo", 1.0, 0.0, 0.0)])
def test_pair_losses_match_the_papers(objective, beta, gamma, eps, near_zero):
    p = _pairs(seed=len(objective) + int(beta * 10), near_zero=near_zero)
    terms, chosen, rejected = _ours(objective, p, beta=beta, gamma=gamma, label_smoothing=eps)
    want = {k: v.double().clone().requires_grad_() if k in ("chosen", "rejected") else v.double()
            for k, v in p.items()}
    loss, reward_c, reward_r = _paper(objective, want, beta, gamma, eps)

    assert terms.loss.dtype == torch.float32 and terms.loss.shape == (6,)
    torch.testing.assert_close(terms.loss.double(), loss.detach(), **TOL)
    torch.testing.assert_close(terms.chosen_reward.double(), reward_c.detach(), **TOL)
    torch.testing.assert_close(terms.rejected_reward.double(), reward_r.detach(), **TOL)
    assert not terms.chosen_reward.requires_grad and not terms.rejected_reward.requires_grad
    # the loss is a sum over pairs downstream: each pair's gradient reaches its own log-probs only
    ours = torch.autograd.grad(terms.loss.sum(), [chosen, rejected])
    theirs = torch.autograd.grad(loss.sum(), [want["chosen"], want["rejected"]])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, **TOL)


def test_label_smoothing_changes_dpo_only_as_cdpo_says():
    p = _pairs(seed=3)
    plain = _ours("dpo", p, beta=0.3)[0].loss
    smoothed = _ours("dpo", p, beta=0.3, label_smoothing=0.25)[0].loss
    z = 0.3 * ((p["chosen"] - p["ref_chosen"]) - (p["rejected"] - p["ref_rejected"]))
    torch.testing.assert_close(smoothed, plain + 0.25 * (F.logsigmoid(z) - F.logsigmoid(-z)), **TOL)


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_reference_objectives_need_the_reference(objective):
    p = _pairs(seed=4)
    with pytest.raises(ValueError, match="reference"):
        pair_losses(objective, p["chosen"], p["rejected"], p["chosen_count"], p["rejected_count"])
    with pytest.raises(ValueError, match="one of dpo, ipo, orpo, simpo"):
        pair_losses("kto", p["chosen"], p["rejected"], p["chosen_count"], p["rejected_count"])


# ---- pair_losses against TRL ----------------------------------------------------------------------------------------

def _accelerator():
    return types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t,
                                 unwrap_model=lambda m: m)


def _trl_dpo(loss_type: str, beta: float, pc, pr, nc: int, nr: int, rc, rr):
    """TRL's DPOTrainer._compute_loss on one pair with a precomputed reference: (loss, chosen reward, rejected
    reward). The model is a stand-in for TRL's fused LM head, returning per-token log-probs that sum to pc and pr."""
    from trl.trainer.dpo_trainer import DPOTrainer

    width = max(nc, nr) + 2
    completion = torch.zeros(2, width + 1)  # position 0 is the prompt
    completion[0, 1:1 + nc], completion[1, 1:1 + nr] = 1, 1
    shifted = completion[:, 1:]
    per_token = torch.stack([pc / nc * shifted[0], pr / nr * shifted[1]])  # zero off the completion, as TRL's head

    def model(**kwargs):
        zero = torch.zeros_like(per_token)
        return types.SimpleNamespace(log_probs=per_token, entropy=zero, mean_logits=zero, is_top1=zero.bool())

    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=0.0, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0,
        _tp_size=1)
    inputs = {"input_ids": torch.zeros(2, width + 1, dtype=torch.long), "attention_mask": torch.ones(2, width + 1),
              "completion_mask": completion, "ref_chosen_logps": rc.reshape(1), "ref_rejected_logps": rr.reshape(1)}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    logged = trainer._metrics["train"]
    return loss, logged["rewards/chosen"][0], logged["rewards/rejected"][0]


@pytest.mark.parametrize("objective,loss_type", [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_match_trl(objective, loss_type):
    pytest.importorskip("trl")
    beta = 0.2
    p = _pairs(seed=5)
    terms, chosen, rejected = _ours(objective, p, beta=beta)
    grads = torch.autograd.grad(terms.loss.sum(), [chosen, rejected])
    for i in range(len(chosen)):
        pc, pr = p["chosen"][i].clone().requires_grad_(), p["rejected"][i].clone().requires_grad_()
        loss, reward_c, reward_r = _trl_dpo(loss_type, beta, pc, pr, int(p["chosen_count"][i]),
                                            int(p["rejected_count"][i]), p["ref_chosen"][i], p["ref_rejected"][i])
        torch.testing.assert_close(terms.loss[i], loss.detach(), **TOL)
        assert terms.chosen_reward[i].item() == pytest.approx(reward_c, rel=1e-5, abs=1e-5)
        assert terms.rejected_reward[i].item() == pytest.approx(reward_r, rel=1e-5, abs=1e-5)
        theirs = torch.autograd.grad(loss, [pc, pr])
        torch.testing.assert_close(torch.stack([grads[0][i], grads[1][i]]), torch.stack(theirs), **TOL)


@pytest.mark.parametrize("near_zero", [False, True], ids=["typical", "near-certain"])
def test_orpo_matches_trl(near_zero):
    pytest.importorskip("trl")
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    beta = 0.25
    p = _pairs(seed=6, near_zero=near_zero)
    terms, chosen, rejected = _ours("orpo", p, beta=beta)
    mean_c = (p["chosen"] / p["chosen_count"]).requires_grad_()
    mean_r = (p["rejected"] / p["rejected_count"]).requires_grad_()
    trainer = types.SimpleNamespace(beta=beta, accelerator=_accelerator())
    ratio_term, reward_c, reward_r, _, _ = ORPOTrainer.odds_ratio_loss(trainer, mean_c, mean_r)
    # TRL's loss = the chosen NLL (per-token mean) - mean(ratio_term); with one pair the NLL is -mean_c
    loss = -mean_c - ratio_term
    torch.testing.assert_close(terms.loss, loss.detach(), **TOL)
    torch.testing.assert_close(terms.chosen_reward, reward_c, **TOL)
    torch.testing.assert_close(terms.rejected_reward, reward_r, **TOL)
    ours = torch.autograd.grad(terms.loss.sum(), [chosen, rejected])
    theirs = torch.autograd.grad(loss.sum(), [mean_c, mean_r])  # d/d(sum) = d/d(mean) / count
    torch.testing.assert_close(ours[0], theirs[0] / p["chosen_count"], **TOL)
    torch.testing.assert_close(ours[1], theirs[1] / p["rejected_count"], **TOL)


def test_simpo_matches_trl():
    pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    beta, gamma = 2.5, 1.4
    p = _pairs(seed=7)
    terms, chosen, rejected = _ours("simpo", p, beta=beta, gamma=gamma)
    mean_c = (p["chosen"] / p["chosen_count"]).requires_grad_()
    mean_r = (p["rejected"] / p["rejected_count"]).requires_grad_()
    trainer = types.SimpleNamespace(beta=beta, simpo_gamma=gamma, loss_type="simpo", label_smoothing=0.0, alpha=0.0,
                                    accelerator=_accelerator())
    loss, reward_c, reward_r = CPOTrainer.cpo_loss(trainer, mean_c, mean_r)
    torch.testing.assert_close(terms.loss, loss.detach(), **TOL)
    torch.testing.assert_close(terms.chosen_reward, reward_c, **TOL)
    torch.testing.assert_close(terms.rejected_reward, reward_r, **TOL)
    ours = torch.autograd.grad(terms.loss.sum(), [chosen, rejected])
    theirs = torch.autograd.grad(loss.sum(), [mean_c, mean_r])
    torch.testing.assert_close(ours[0], theirs[0] / p["chosen_count"], **TOL)
    torch.testing.assert_close(ours[1], theirs[1] / p["rejected_count"], **TOL)


# ---- PreferenceLoss on a tiny model ---------------------------------------------------------------------------------

VOCAB = 512


def _tiny_mistral(seed: int = 0) -> MistralForCausalLM:
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
                           use_cache=False, attn_implementation="sdpa")
    return MistralForCausalLM(config).float()


class _Engine:
    """What PreferenceLoss and precompute_reference use of a DeepSpeed engine: calling it, and its module."""

    def __init__(self, module):
        self.module = module

    def __call__(self, **inputs):
        return self.module(**inputs)

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()


def _pairs_batch(seed: int = 0):
    """Two pairs packed in one row (chosen 0, rejected 0, chosen 1, rejected 1, then padding) as the loader packs
    them, and the samples themselves: (micro-batch, [(token ids, number of prompt tokens)])."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for prompt_len, lengths in ((4, (6, 9)), (7, (5, 3))):
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g)
        for n in lengths:
            samples.append((torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)]), prompt_len))
    width = sum(len(ids) for ids, _ in samples) + 5
    mb = {"input_ids": torch.zeros(1, width, dtype=torch.long), "position_ids": torch.zeros(1, width, dtype=torch.long),
          "targets": torch.full((1, width), -100), "sample_index": torch.full((1, width), -1)}
    at = 0
    for k, (ids, prompt_len) in enumerate(samples):
        n = len(ids)
        mb["input_ids"][0, at:at + n] = ids
        mb["position_ids"][0, at:at + n] = torch.arange(n)
        mb["targets"][0, at + prompt_len - 1:at + n - 1] = ids[prompt_len:]  # the response's tokens only
        mb["sample_index"][0, at:at + n] = k
        at += n
    mb["position_ids"][0, at:] = torch.arange(width - at)  # padding is a sequence of its own
    mb["sample_ids"] = torch.tensor([4, 5, 0, 1])  # pairs 2 and 0 of the split's tokenized data
    mb["sample_lengths"] = torch.tensor([len(ids) for ids, _ in samples])
    return mb, samples


def test_the_loader_packs_pairs_as_the_oracle_batch():
    """collate (finetune/data/loader.py) of paired data gives the hand-built micro-batch the tests below score."""
    mb, samples = _pairs_batch()
    by_id = dict(zip(mb["sample_ids"].tolist(), samples))
    stored = []
    for i in range(6):
        ids, prompt_len = by_id.get(i, (torch.tensor([7, 8, 9]), 1))
        stored.append((ids.tolist(), [-100] * prompt_len + ids[prompt_len:].tolist()))
    batch = collate([mb["sample_ids"].tolist()], TokenizedData.from_samples(stored, paired=True), pad_id=0)
    n = int(mb["sample_lengths"].sum())
    assert batch["input_ids"].shape == (1, n)
    for key in ("input_ids", "position_ids", "targets", "sample_index"):
        assert torch.equal(batch[key], mb[key][:, :n]), key
    assert torch.equal(batch["sample_ids"], mb["sample_ids"])


def _alone(model, samples) -> torch.Tensor:
    """Each sample's summed response log-prob, scoring it by itself (no packing), by log_softmax and gather."""
    out = []
    for ids, prompt_len in samples:
        logps = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
        out.append(logps[prompt_len - 1:-1].gather(-1, ids[prompt_len:, None]).sum())
    return torch.stack(out)


def _dpo(policy, reference, beta):
    z = beta * ((policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2]))
    return -F.logsigmoid(z).sum()


def test_lora_dpo_with_adapters_off_matches_scoring_each_sequence_alone():
    beta = 0.3
    recipe = load_recipe("tiny", ["lora.enabled=true", "train.objective=dpo", f"train.beta={beta}",
                                  "train.reference=adapters_off"])
    model = get_peft_model(_tiny_mistral(), LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                                        target_modules=["q_proj", "v_proj", "down_proj"]))
    lora = [p for p in model.parameters() if p.requires_grad]
    assert lora and all(p.numel() < 4096 for p in lora)
    mb, samples = _pairs_batch()

    loss, stats = PreferenceLoss(recipe)(_Engine(model), mb, torch.device("cpu"))
    grads = torch.autograd.grad(loss, lora)

    policy = _alone(model, samples)
    with torch.no_grad(), model.disable_adapter():
        reference = _alone(model, samples)
    assert (policy - reference).abs().min() > 1e-2  # the adapters change every sequence's score
    want = _dpo(policy, reference, beta)
    torch.testing.assert_close(loss, want.detach(), **TOL)
    for got, expected in zip(grads, torch.autograd.grad(want, lora)):
        torch.testing.assert_close(got, expected, **TOL)
    reward = beta * (policy - reference).detach()
    torch.testing.assert_close(stats, torch.stack([reward[0::2].sum(), reward[1::2].sum(),
                                                   (reward[0::2] > reward[1::2]).float().sum(),
                                                   policy[0::2].sum().detach(), policy[1::2].sum().detach()]), **TOL)


def test_full_dpo_with_precomputed_reference_matches_a_frozen_copy():
    beta = 0.2
    recipe = load_recipe("tiny", ["train.objective=dpo", f"train.beta={beta}"])  # full fine-tuning: reference auto
    model = _tiny_mistral(seed=1)
    frozen = copy.deepcopy(model).requires_grad_(False)
    mb, samples = _pairs_batch(seed=1)
    engine = _Engine(model)

    table = precompute_reference(engine, 6, [mb])
    assert table.dtype == torch.float64 and table[[2, 3]].tolist() == [0.0, 0.0]  # samples this batch does not hold
    with torch.no_grad():
        reference = _alone(frozen, samples)
    torch.testing.assert_close(table[mb["sample_ids"]].float(), reference, **TOL)

    with torch.no_grad():  # the model moves on from its start, as after some steps
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.train()
    loss, _ = PreferenceLoss(recipe, {"train": table})(engine, mb, torch.device("cpu"))
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params)

    policy = _alone(model, samples)
    assert (policy - reference).abs().min() > 1e-2
    want = _dpo(policy, reference, beta)
    torch.testing.assert_close(loss, want.detach(), **TOL)
    for got, expected in zip(grads, torch.autograd.grad(want, params)):
        torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("objective", [o for o in OBJECTIVES if o not in ("dpo",)])
def test_every_objective_on_packed_pairs_matches_scoring_each_sequence_alone(objective):
    beta, gamma = 0.4, 0.3
    recipe = load_recipe("tiny", ["lora.enabled=true", f"train.objective={objective}", f"train.beta={beta}",
                                  f"train.simpo_gamma={gamma}"])
    model = get_peft_model(_tiny_mistral(seed=2), LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0,
                                                             init_lora_weights=False, target_modules=["v_proj"]))
    mb, samples = _pairs_batch(seed=2)
    loss, _ = PreferenceLoss(recipe)(_Engine(model), mb, torch.device("cpu"))

    policy = _alone(model, samples)
    with torch.no_grad(), model.disable_adapter():
        reference = _alone(model, samples)
    counts = torch.tensor([len(ids) - prompt_len for ids, prompt_len in samples], dtype=torch.float32)
    p = dict(chosen=policy[0::2].detach(), rejected=policy[1::2].detach(), chosen_count=counts[0::2],
             rejected_count=counts[1::2], ref_chosen=reference[0::2], ref_rejected=reference[1::2])
    want = _paper(objective, {k: v.double() for k, v in p.items()}, beta, gamma, 0.0)[0].sum()
    torch.testing.assert_close(loss.double(), want, **TOL)


# ---- shared prompts: each pair's prompt once per row ----------------------------------------------------------------

def _stored(samples) -> TokenizedData:
    """The samples as the tokenized data holds them (labels -100 on the prompt), paired."""
    rows = [(ids.tolist(), [-100] * prompt_len + ids[prompt_len:].tolist()) for ids, prompt_len in samples]
    return TokenizedData.from_samples(rows, paired=True)


@pytest.mark.parametrize("window", [None, 6], ids=["no-window", "window-6"])
def test_shared_prompts_score_each_sequence_as_alone(window):
    """Pairs laid out with one copy of their prompt (data.with_shared_prompts, loader.collate, zerotune's attention's
    continued documents) give every sequence the log-prob it has alone, and the DPO loss and LoRA gradients of scoring
    each sequence alone, also with a sliding window shorter than a sequence (counted in positions)."""
    from finetune.perf import attention

    beta = 0.3
    recipe = load_recipe("tiny", ["lora.enabled=true", "train.objective=dpo", f"train.beta={beta}",
                                  "train.reference=adapters_off"])
    base = _tiny_mistral(seed=3)
    base.config.sliding_window = window
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    _, samples = _pairs_batch(seed=3)
    data = _stored(samples).with_shared_prompts()
    assert data.prefix.tolist() == [4, 7]  # the prompts, exactly
    mb = collate([[0, 1, 2, 3]], data, pad_id=0)
    whole = collate([[0, 1, 2, 3]], _stored(samples), pad_id=0)
    assert mb["input_ids"].shape[1] == whole["input_ids"].shape[1] - 11  # each prompt once
    assert mb["branch_targets"].tolist() == [[0, 3, int(samples[1][0][4]), 1], [0, 25, int(samples[3][0][7]), 3]]
    assert mb["position_ids"][0, 10:15].tolist() == [4, 5, 6, 7, 8]  # the rejected rest continues the prompt

    attention.install(model)
    loss, stats = PreferenceLoss(recipe)(_Engine(model), mb, torch.device("cpu"))
    lora = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, lora)

    attention.name_attention(model, "sdpa")  # the oracle: transformers' own attention, one sequence at a time
    policy = _alone(model, samples)
    with torch.no_grad(), model.disable_adapter():
        reference = _alone(model, samples)
    want = _dpo(policy, reference, beta)
    torch.testing.assert_close(loss, want.detach(), **TOL)
    for got, expected in zip(grads, torch.autograd.grad(want, lora)):  # 1e-5 of the largest (|g| up to ~15 here)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(stats[3:], torch.stack([policy[0::2].sum(), policy[1::2].sum()]).detach(), **TOL)


def test_shared_prefix_stops_at_the_first_difference_or_target():
    """The shared prefix is the common prompt: it ends where the ids differ, or at the first target of either
    sequence even when the responses begin alike (a shared target would be scored once for two sequences)."""
    stored = TokenizedData.from_samples([
        ([1, 5, 6, 7, 9, 9], [-100, -100, -100, -100, 9, 9]),   # pair 0: prompt 1 5 6 7, responses start alike
        ([1, 5, 6, 7, 9, 8], [-100, -100, -100, -100, 9, 8]),
        ([1, 5, 3, 7, 2], [-100, -100, -100, 7, 2]),            # pair 1: the prompts differ at index 2
        ([1, 5, 6, 7, 4], [-100, -100, -100, -100, 4]),
    ], paired=True)
    data = stored.with_shared_prompts()
    assert data.prefix.tolist() == [4, 2]
    assert data.row_lengths.tolist() == [6, 2, 5, 3]
    with pytest.raises(ValueError, match="only preference pairs"):
        TokenizedData.from_samples([([1, 2], [-100, 2])]).with_shared_prompts()
