"""Shared setup: loopback-only networking for every rank, tiers by folder.

tests/ is a package, so pytest puts the repository root on sys.path before it imports this file (tests.* imports).
Each test is marked by its folder: tests/unit (`unit`), tests/integration (`integration`), tests/gpu (`gpu`, skipped
without CUDA). `python -m pytest tests/unit` runs one tier, `-m "not integration"` another selection. Fixtures that
several modules of one tier use live in that tier's conftest.py; shared constants and helpers in tests/fixtures/.
"""

import os

import pytest

from tests.fixtures.paths import ROOT

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each pytest worker gets one core's worth of threads: two workers each running torch on all cores only contend.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

TIERS = ("unit", "integration", "gpu")

# Under `pytest -n 2 --dist loadfile`, the integration files whose multi-rank runs take longest run first: each file
# goes whole to the worker that is free, so starting with the longest lets the two workers end together instead of one
# finishing a long file alone. The other files keep their order, after these. One process keeps the command line's order.
LONGEST_FIRST = ["test_parity.py", "test_checkpoint.py", "test_offload.py", "test_docs_commands.py", "test_launcher.py",
                 "test_stall.py", "test_tiny_recipe.py", "test_compare.py", "test_chat.py", "test_sigterm_group.py",
                 "test_preference.py", "test_export_run.py"]


def _tier(item) -> str | None:
    parts = os.path.relpath(str(item.fspath), os.path.join(ROOT, "tests")).split(os.sep)
    return parts[0] if parts[0] in TIERS else None


def pytest_collection_modifyitems(session, config, items):
    cuda = None
    for item in items:
        tier = _tier(item)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu":
            if cuda is None:
                import torch  # only when GPU tests were collected

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))

    def rank(item):
        name = os.path.basename(str(item.fspath))
        if _tier(item) == "integration" and name in LONGEST_FIRST:
            return LONGEST_FIRST.index(name)
        return len(LONGEST_FIRST) + (1 if _tier(item) == "unit" else 0)

    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None):
        items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
