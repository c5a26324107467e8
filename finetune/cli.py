"""The `zerotune` command: argument dispatch only; each subcommand's logic lives in its own module.

    zerotune train --deepspeed zero3 --config tiny train.max_steps=20
"""

from __future__ import annotations

import sys

from finetune.run import console

USAGE = """usage: zerotune <command> [arguments]

commands:
  train       train in this process (use `deepspeed ... finetune/main.py` for several GPUs)
  launch      run a multi-node job from a hostfile, after preflight checks
  export      write an HF model, a LoRA adapter or a merged model from a run's checkpoint or final export
  preprocess  tokenize a recipe's data into the cache and report samples, tokens, drops and pack fill
  compare     run one recipe under several ZeRO stages; write a summary table and plots
  estimate    per-GPU memory of every ZeRO stage for a recipe, and the fastest that fits
  plot        loss, eval loss, learning rate, tokens/s and memory over steps of one or more runs, as a PNG
  chat        talk with a trained model (run folder, export or LoRA adapter), or answer one --prompt
  recipes     list the shipped recipes (--config NAME) and DeepSpeed configs (--deepspeed NAME);
              `zerotune recipes cp NAME DEST` copies one out to edit

`zerotune <command> --help` describes each command."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    console.setup(command == "train" and "--verbose" in rest)  # before any command imports DeepSpeed, which logs then
    # Each command's module is imported only when it runs: `zerotune --help` and `zerotune launch` stay fast, and no
    # command pays for another's imports (torch, DeepSpeed, matplotlib).
    if command == "train":
        from finetune.train import main as run
    elif command == "launch":
        from finetune.multinode.launcher import main as run
    elif command == "export":
        from finetune.export.weights import main as run
    elif command == "preprocess":
        from finetune.commands.preprocess import main as run
    elif command == "compare":
        from finetune.commands.compare import main as run
    elif command == "estimate":
        from finetune.commands.estimate import main as run
    elif command == "plot":
        from finetune.commands.plot import main as run
    elif command == "chat":
        from finetune.commands.chat import main as run
    elif command == "recipes":
        from finetune.commands.recipes import main as run
    else:
        print(f"zerotune: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
