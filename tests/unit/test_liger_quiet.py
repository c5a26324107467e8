"""liger's notices about backends zerotune does not run (finetune/perf/liger.py): held back from a default run's output,
shown with --verbose / ZEROTUNE_LOG=info; a failure of its Triton backend and its other warnings always shown. The
filter's rule is checked on records in liger's own format without liger; where liger-kernel is installed, its real
registry logs through the filter."""

import importlib.util
import logging
import uuid

import pytest

from finetune.perf import liger
from finetune.run import console

NOTICE = "Backend impl '%s' for op '%s' could not be imported: %s: %s"
"""liger-kernel's registry message (liger_kernel/backends/registry.py, _discover)."""
CUTEDSL = "liger_kernel.ops.backends._cutedsl.rope"
TRITON = "liger_kernel.ops.backends._triton.rope"


@pytest.fixture
def quiet(monkeypatch, caplog):
    """The filter installed, ZEROTUNE_LOG at its default (warning), and the log captured from WARNING up."""
    monkeypatch.setenv(console.ENV, "warning")
    liger.quiet_other_backends()
    caplog.set_level(logging.WARNING)
    return caplog


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == liger.REGISTRY_LOGGER]


def test_the_filter_is_installed_once_on_ligers_registry_logger():
    liger.quiet_other_backends()
    liger.quiet_other_backends()
    registry = logging.getLogger(liger.REGISTRY_LOGGER)
    assert sum(isinstance(f, liger._OtherBackends) for f in registry.filters) == 1


def test_other_backends_are_held_back_and_triton_and_the_rest_shown(quiet):
    log = logging.getLogger(liger.REGISTRY_LOGGER)
    log.warning(NOTICE, CUTEDSL, "rope", "ImportError", "cutedsl backend requires the NVIDIA CUTLASS Python DSL")
    log.warning(NOTICE, "liger_kernel.ops.backends._ascend.rope", "rope", "ModuleNotFoundError", "torch_npu")
    log.warning(NOTICE, TRITON, "rope", "ModuleNotFoundError", "No module named 'triton'")
    log.warning("_discover('rope'): all declared paths imported but no @register_op ran.")
    assert _messages(quiet) == [
        f"Backend impl '{TRITON}' for op 'rope' could not be imported: ModuleNotFoundError: No module named 'triton'",
        "_discover('rope'): all declared paths imported but no @register_op ran."]


def test_a_verbose_run_shows_every_backend(quiet, monkeypatch):
    monkeypatch.setenv(console.ENV, "info")  # as --verbose sets it for the run (tests/unit/test_console.py)
    logging.getLogger(liger.REGISTRY_LOGGER).warning(NOTICE, CUTEDSL, "rope", "ImportError", "no cutlass")
    assert _messages(quiet) == [f"Backend impl '{CUTEDSL}' for op 'rope' could not be imported: ImportError: no cutlass"]


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
@pytest.mark.parametrize("env", ["", "info"], ids=["default", "verbose"])
def test_ligers_own_registry_goes_through_the_filter(quiet, monkeypatch, env):
    """liger's registry looks for an op's backends in the modules declared for it and logs each it cannot import: an op
    declared here (a new name each time, so liger looks again) in a CuTe DSL and a Triton module that do not exist."""
    from liger_kernel.backends import available_impls
    from liger_kernel.backends.registry import declare_op_locations

    if env:
        monkeypatch.setenv(console.ENV, env)
    op = f"zerotune_probe_{uuid.uuid4().hex}"
    missing = {backend: f"liger_kernel.ops.backends.{backend}.{op}" for backend in ("_cutedsl", "_triton")}
    declare_op_locations(op, tuple(missing.values()))
    assert available_impls(op) == []
    shown = [m for m in _messages(quiet) if "could not be imported" in m]
    expected = ["_cutedsl", "_triton"] if env else ["_triton"]
    assert [m.split("'")[1] for m in shown] == [missing[b] for b in expected]
