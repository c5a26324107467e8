"""Write a `text`-format JSONL of long random-word documents, for throughput runs without real data.

    python benchmarks/synthetic_data.py OUT.jsonl --docs 400 --words 2200
"""

import argparse
import json
import random

WORDS = ("model data train step loss token batch layer rank shard memory gradient weight bias norm attention "
         "query key value head window sequence packing sample epoch optimizer state bucket stage offload node "
         "host slot port cache prefix adapter merge export resume checkpoint metric tensor kernel fused").split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--words", type=int, default=2200, help="words per document (~1.2 tokens each)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(args.words))}) + "\n")


if __name__ == "__main__":
    main()
