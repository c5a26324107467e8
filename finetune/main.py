"""What `deepspeed finetune/main.py ...` runs.

Python puts `finetune/` itself first on `sys.path` when this file is run as a script, so a module of
ours named like a library would shadow it; put the repository root first instead and import the package.
"""

import os
import sys

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0]) == here:
        sys.path[0] = os.path.dirname(here)
    # Imported after the sys.path fix, so that they and every library they import resolve without our shadows.
    from finetune.run import console

    console.setup("--verbose" in sys.argv[1:])  # before DeepSpeed's import, which logs
    from finetune.dist import exit_process
    from finetune.train import main

    exit_process(main())
