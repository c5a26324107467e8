"""Shared fixtures: the repo root on sys.path (tests.plugins imports), loopback-only networking for every rank."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

# The files whose multi-rank runs take longest (seconds on 2 cores, alone), run first: with `pytest -n 2 --dist
# loadfile` each file goes whole to the worker that is free, so starting with the longest lets the two workers end
# together instead of one finishing a long file alone. The other files keep their order, after these.
LONGEST_FIRST = ["test_checkpoint.py",  # ~250 s
                 "test_parity.py",  # ~180 s
                 "test_offload.py",  # ~110 s
                 "test_launcher.py",  # ~90 s
                 "test_tiny_recipe.py",  # ~80 s
                 "test_compare.py",  # ~55 s
                 "test_chat.py"]  # ~40 s


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
