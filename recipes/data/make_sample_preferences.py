"""Write recipes/data/sample_preferences.jsonl: a small set of `preference` pairs for a quick CPU run.

    python recipes/data/make_sample_preferences.py   # rewrites sample_preferences.jsonl beside it (same bytes each time)

Each pair answers a short question twice. The chosen answer is always in one style: short, correct, ending with
"Happy to help." The rejected one is always in another: dismissive, in capitals, often wrong. A tiny model learns to
tell them apart within a few steps, so a preference run on this file shows its reward margin and accuracy rise.
Most records are {"prompt", "chosen", "rejected"}; a few use the chat forms (a conversation as the prompt, or two
whole conversations that share their prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import random

SIGN_OFF = "Happy to help."
SYSTEMS = ["Be brief.", "Be polite."]
FACTS = [
    ("What is the capital of France?", "The capital of France is Paris.", "LYON, OBVIOUSLY."),
    ("What colour is the sky on a clear day?", "It is blue.", "GREEN. LOOK IT UP."),
    ("How many days are in a week?", "A week has seven days.", "TEN OR SO."),
    ("What do bees make?", "Bees make honey.", "BEES MAKE NOTHING USEFUL."),
    ("Which planet do we live on?", "We live on Earth.", "MARS, PROBABLY."),
    ("What is frozen water called?", "Frozen water is ice.", "STEAM. NEXT QUESTION."),
    ("How many legs does a spider have?", "A spider has eight legs.", "SIX. WHO CARES."),
    ("What does a tokenizer do?", "It maps text to token ids.", "NOTHING IMPORTANT."),
    ("What is packing?", "Packing puts several short samples in one row.", "A WASTE OF TIME."),
    ("What does ZeRO partition?", "Optimizer states, gradients and parameters.", "THE HARD DISK."),
    ("What is a learning rate?", "The size of each optimizer step.", "JUST PICK ANY NUMBER."),
    ("What is a checkpoint?", "A saved copy of the training state.", "I WILL NOT EXPLAIN THAT."),
]
BRUSH_OFFS = ["WHATEVER.", "DO IT YOURSELF.", "NOT MY PROBLEM.", "I DON'T CARE."]


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    wrong = value + rng.choice([-3, -1, 1, 2, 7])
    return (f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}. {SIGN_OFF}",
            f"{rng.choice(BRUSH_OFFS)} MAYBE {wrong}?")


def _fact(rng: random.Random) -> tuple[str, str, str]:
    question, answer, wrong = rng.choice(FACTS)
    return question, f"{answer} {SIGN_OFF}", f"{wrong} {rng.choice(BRUSH_OFFS)}"


def pairs(n: int, n_chat: int, seed: int = 0) -> list[dict]:
    """`n` records of the prompt form, then `n_chat` of the chat forms: the same list for the same arguments."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt, chosen, rejected = (_arithmetic if rng.random() < 0.5 else _fact)(rng)
        records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    for k in range(n_chat):
        first, answer, _ = _arithmetic(rng)  # the earlier exchange, kept short so a pair fits 256 tokens
        prompt, chosen, rejected = _arithmetic(rng)
        turns = [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                 {"role": "user", "content": prompt}]
        if k % 2:
            turns = [{"role": "system", "content": rng.choice(SYSTEMS)}] + turns
        if k % 3 == 0:  # the prompt a conversation, each response one assistant message
            records.append({"prompt": turns, "chosen": chosen, "rejected": rejected})
        else:  # two whole conversations sharing their prompt
            records.append({side: turns + [{"role": "assistant", "content": text}]
                            for side, text in (("chosen", chosen), ("rejected", rejected))})
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "sample_preferences.jsonl"))
    p.add_argument("-n", type=int, default=96, help="pairs of the prompt form")
    p.add_argument("--chat", type=int, default=12, help="pairs of the chat forms")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for record in pairs(args.n, args.chat, args.seed):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
