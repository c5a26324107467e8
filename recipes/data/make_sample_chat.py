"""Write recipes/data/sample_chat.jsonl: a few hundred varied multi-turn `messages` conversations, deterministically.

    python recipes/data/make_sample_chat.py            # rewrites recipes/data/sample_chat.jsonl (same bytes every time)

Conversations mix short arithmetic turns, one-paragraph explanations and long multi-turn talks, with and without a
system prompt, so packing and the loaders see realistic length spread. `conversations(n, seed)` is also what
benchmarks/preprocess_speed.py generates its corpus with.
"""

from __future__ import annotations

import argparse
import json
import os
import random

SYSTEMS = [
    "You are a concise assistant for machine-learning engineers.",
    "You are a patient teacher. Explain step by step and keep the tone friendly.",
    "Answer briefly. Use plain words.",
    "You help people run distributed training jobs. Be precise about numbers.",
    "You are a helpful assistant.",
]

# topic -> (questions, facts): an answer is a few facts of its topic, in order, so it reads as one paragraph.
TOPICS = {
    "ZeRO": (
        ["What does ZeRO do?", "How does ZeRO save memory?", "Explain the ZeRO stages.",
         "Why would I pick ZeRO stage 3 over stage 2?", "Is ZeRO the same as model parallelism?"],
        ["ZeRO removes the redundancy of data parallelism by partitioning training state across the ranks.",
         "Stage 1 partitions the optimizer states, which for Adam are twice the size of the fp32 weights.",
         "Stage 2 also partitions the gradients, so each rank reduces and keeps only its own slice.",
         "Stage 3 partitions the parameters too and gathers each layer just before it is used.",
         "The communication volume of stages 1 and 2 matches plain data parallelism.",
         "Stage 3 adds about fifty percent more communication in exchange for the largest memory savings.",
         "Unlike tensor parallelism, every rank still runs the whole model on its own micro-batch.",
         "Offloading to CPU memory extends the same idea when the GPUs alone are too small."],
    ),
    "packing": (
        ["What is sequence packing?", "Does packing change the loss?", "Why pack samples at all?",
         "How do you keep packed samples from attending to each other?"],
        ["Packing places several short samples in one row so fewer tokens are wasted on padding.",
         "Each sample keeps its own position ids, which restart at zero where it begins.",
         "The attention mask is block-diagonal, so a token only sees earlier tokens of its own sample.",
         "Targets are shifted inside each sample, so the last token never predicts the next sample.",
         "With a token-normalised loss, packing gives the same loss as running each sample alone.",
         "First-fit decreasing fills rows to well over ninety percent on typical chat data.",
         "Fewer rows per epoch means fewer forward passes for the same amount of data."],
    ),
    "learning rate": (
        ["How should I pick a learning rate for fine-tuning?", "What does warmup do?",
         "Why does my loss spike after a few hundred steps?", "Is cosine decay better than a constant rate?"],
        ["For LoRA a learning rate around two times ten to the minus four is a common start.",
         "Full fine-tuning usually wants a rate ten times smaller than LoRA.",
         "Warmup raises the rate linearly over the first steps while Adam's statistics settle.",
         "Cosine decay lowers the rate smoothly, which often gives a slightly better final loss.",
         "A loss spike often means the rate is too high or a batch holds unusual data.",
         "Gradient clipping at a norm of one limits the damage of a single bad batch.",
         "Plot the loss against the step and change one setting at a time."],
    ),
    "tokenizers": (
        ["What is a tokenizer?", "Why do token counts differ between models?",
         "What are BOS and EOS tokens?", "How does sentencepiece handle spaces?"],
        ["A tokenizer maps text to integer ids from a fixed vocabulary.",
         "Mistral uses a sentencepiece model with thirty-two thousand pieces.",
         "Sentencepiece marks a leading space with a special underscore-like symbol.",
         "Rare words are split into several pieces, common words are usually one.",
         "The beginning-of-sequence token starts every sample, and the end token closes every answer.",
         "Different vocabularies split the same text into different numbers of tokens.",
         "Numbers are often split digit by digit, which matters for arithmetic tasks."],
    ),
    "checkpoints": (
        ["How do I resume a training run?", "What is stored in a checkpoint?",
         "Why are ZeRO-3 checkpoints split into many files?", "How do I export a model for inference?"],
        ["A checkpoint stores the weights, the optimizer state, the scheduler and the step.",
         "With ZeRO-3 each rank writes its own partition, so saving is parallel.",
         "Resuming reads the partitions back and continues from the saved step.",
         "For inference the partitions are gathered into one set of full weights.",
         "LoRA adapters can be merged into the base weights before export.",
         "Saving the data position with the step makes a resumed run see the same batches."],
    ),
    "evaluation": (
        ["How often should I evaluate?", "What is a held-out set?", "Why is my eval loss lower than the train loss?",
         "What does perplexity mean?"],
        ["A held-out set contains samples the model never trains on.",
         "Evaluating every few hundred steps shows overfitting early without slowing training much.",
         "Perplexity is the exponential of the mean token loss.",
         "Dropout is active in training and off in evaluation, which can make the eval loss lower.",
         "A small eval set gives a noisy number, so look at the trend rather than one value.",
         "Sample a few answers by hand as well; the loss does not show every failure."],
    ),
    "memory": (
        ["Why do I run out of GPU memory?", "What is activation checkpointing?",
         "How much memory does a seven billion parameter model need?", "Does a longer sequence need more memory?"],
        ["Weights in bf16 take two bytes per parameter, so seven billion parameters need fourteen gigabytes.",
         "Adam keeps two fp32 moments and often an fp32 master copy, twelve more bytes per parameter.",
         "Activations grow with the batch size and the sequence length.",
         "Activation checkpointing recomputes each layer in the backward pass instead of storing its activations.",
         "It trades roughly a third more compute for a large cut in activation memory.",
         "LoRA trains a tiny fraction of the weights, so its optimizer state is small."],
    ),
    "data": (
        ["How should I format my fine-tuning data?", "How many samples do I need?",
         "Should I train on the prompt tokens too?", "How do I mix two datasets?"],
        ["Chat data is usually a list of messages with a role and a content field.",
         "A few thousand clean samples often teach a format better than a large noisy set.",
         "By default only the assistant's tokens are trained, so the model does not learn to write prompts.",
         "Duplicates and empty answers are worth removing before training.",
         "Mixing datasets with weights lets a small, important set count more.",
         "Tokenizing once and caching the result saves time on every restart."],
    ),
    "networking": (
        ["Why is my multi-node job slow?", "What is NCCL?", "Do I need InfiniBand?",
         "How do ranks find each other?"],
        ["NCCL is the library that moves tensors between GPUs for collective operations.",
         "Within a node GPUs talk over NVLink, across nodes over the network.",
         "A slow network makes gradient reduction the bottleneck as the number of nodes grows.",
         "The ranks meet at a master address and port before any collective runs.",
         "Firewalls and wrong interface names are the most common causes of a hang at start.",
         "Larger micro-batches or gradient accumulation reduce how often gradients are exchanged."],
    ),
    "cooking": (
        ["How do I cook rice?", "What makes bread rise?", "How long should I boil an egg?",
         "Why rest meat after cooking?"],
        ["Rinse the rice, then simmer one part rice in about one and a half parts water.",
         "Keep the lid on and let the rice rest ten minutes off the heat.",
         "Yeast eats sugar and releases gas that the gluten network traps.",
         "A soft-boiled egg takes about six minutes and a hard-boiled one about ten.",
         "Resting lets the juices settle so they stay in the meat when it is cut.",
         "Salt the water generously when cooking pasta."],
    ),
}
FOLLOW_UPS = ["Can you say more?", "Why is that?", "Give me an example.", "And what should I watch out for?",
              "Thanks. Anything else?", "Could you summarise that in one sentence?", "Is that always true?"]
NAMES = ["Ada", "Linus", "Grace", "Alan", "Barbara", "Ken", "Margaret", "Dennis"]


def _answer(rng: random.Random, facts: list[str], lo: int, hi: int) -> str:
    start = rng.randrange(len(facts))
    count = rng.randint(lo, min(hi, len(facts)))
    return " ".join(facts[(start + i) % len(facts)] for i in range(count))


def _arithmetic(rng: random.Random) -> list[dict[str, str]]:
    turns = []
    for _ in range(rng.randint(1, 4)):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        op = rng.choice(["+", "-", "*"])
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        turns += [{"role": "user", "content": f"What is {a} {op} {b}?"},
                  {"role": "assistant", "content": f"{a} {op} {b} = {value}."}]
    return turns


def _topic_talk(rng: random.Random) -> list[dict[str, str]]:
    name = rng.choice(sorted(TOPICS))
    questions, facts = TOPICS[name]
    long = rng.random() < 0.25
    turns = [{"role": "user", "content": rng.choice(questions)},
             {"role": "assistant", "content": _answer(rng, facts, 2 if long else 1, 7 if long else 4)}]
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 5] if long else [0, 0, 0, 1, 2])):
        ask = rng.choice(FOLLOW_UPS + questions)
        if rng.random() < 0.3:
            ask = f"I'm {rng.choice(NAMES)}. {ask}"
        turns += [{"role": "user", "content": ask}, {"role": "assistant", "content": _answer(rng, facts, 1, 5)}]
    return turns


def conversations(n: int, seed: int = 0) -> list[dict]:
    """`n` records {"messages": [...]} from a seeded generator: the same list for the same (n, seed)."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        turns = _arithmetic(rng) if rng.random() < 0.15 else _topic_talk(rng)
        if rng.random() < 0.4:
            turns = [{"role": "system", "content": rng.choice(SYSTEMS)}] + turns
        records.append({"messages": turns})
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_chat.jsonl"))
    p.add_argument("-n", type=int, default=400, help="conversations")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for record in conversations(args.n, args.seed):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
