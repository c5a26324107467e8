"""The `zerotune` subcommands that are tools around training: compare, estimate, preprocess, chat, plot, recipes.

Each module has a `main(argv)`; only finetune/cli.py imports them.
"""
