"""What a run prints (finetune/run/console.py): DeepSpeed's INFO lines, its CPU notice on a machine without a GPU and the
libraries' FutureWarnings only with --verbose / ZEROTUNE_LOG=info; a recipe error printed once, by local rank 0.
The quiet output of a whole run through the launcher: tests/integration/test_docs_commands.py (the quickstart)."""

import logging
import os
import time
import warnings

import pytest
from deepspeed.utils import logger as ds_logger

from finetune import dist
from finetune.run import console
from finetune.train import main as train_main
from tests.helpers import TINY_RECIPE


class Lines(logging.Handler):
    """The messages DeepSpeed's logger lets through to its handlers."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def restore(monkeypatch):
    """DeepSpeed's logger levels, ZEROTUNE_LOG and TORCH_CPP_LOG_LEVEL as they were; pytest restores the warning
    filters itself."""
    monkeypatch.delenv(console.ENV, raising=False)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    levels = ds_logger.level, [h.level for h in ds_logger.handlers]
    yield monkeypatch
    ds_logger.setLevel(levels[0])
    for handler, level in zip(ds_logger.handlers, levels[1]):
        handler.setLevel(level)
    console.setup()


@pytest.fixture
def shown(restore):
    """What DeepSpeed's logger prints (the lines its handlers get)."""
    handler = Lines()
    ds_logger.addHandler(handler)
    yield handler.lines
    ds_logger.removeHandler(handler)


CPU_NOTICE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."


def test_default_hides_deepspeed_info_and_the_cpu_notice(restore, shown):
    restore.setattr(console, "has_nvidia_gpu", lambda: False)
    console.setup()
    ds_logger.info("engine INFO line")
    ds_logger.warning(CPU_NOTICE)
    ds_logger.warning("a warning the user can act on")
    assert shown == ["a warning the user can act on"]


def test_the_cpu_notice_stays_where_a_gpu_was_missed(restore, shown):
    restore.setattr(console, "has_nvidia_gpu", lambda: True)
    console.setup()
    ds_logger.warning(CPU_NOTICE)
    assert shown == [CPU_NOTICE]


@pytest.mark.parametrize("how", ["--verbose", "ZEROTUNE_LOG=info"])
def test_verbose_shows_deepspeed_info(restore, shown, how):
    restore.setattr(console, "has_nvidia_gpu", lambda: False)
    if how == "--verbose":
        console.setup(verbose=True)
        assert console.is_verbose()  # and the ranks and workers it starts inherit it
    else:
        restore.setenv(console.ENV, "info")
        console.setup()
    ds_logger.info("engine INFO line")
    ds_logger.warning(CPU_NOTICE)
    assert shown == ["engine INFO line", CPU_NOTICE]


def test_library_future_warnings_are_hidden_others_kept(restore):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.setup()
        warnings.warn_explicit("renamed collective", FutureWarning, "c10d_logger.py", 83,
                               module="torch.distributed.c10d_logger")
        warnings.warn_explicit("a user's own FutureWarning", FutureWarning, "my_plugin.py", 1, module="my_plugin")
        warnings.warn_explicit("a library's UserWarning", UserWarning, "modeling.py", 1, module="transformers.modeling")
    assert [str(w.message) for w in caught] == ["a user's own FutureWarning", "a library's UserWarning"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.setup(verbose=True)
        warnings.warn_explicit("renamed collective", FutureWarning, "c10d_logger.py", 83,
                               module="torch.distributed.c10d_logger")
    assert len(caught) == 1


def test_torchs_one_rank_barrier_notice_is_hidden_unless_verbose(restore):
    restore.setenv(console.ENV, "warning")  # undone after the test, with the "info" that --verbose sets
    notice = (f"{console.BARRIER_NOTICE}. You can specify `device_id` in `init_process_group` to mute this warning.")
    for verbose, shown in ((False, []), (True, [notice])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            console.setup(verbose=verbose)
            warnings.warn_explicit(notice, UserWarning, "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
        assert [str(w.message) for w in caught] == shown


def test_an_unknown_zerotune_log_value_is_named(restore, capsys):
    restore.setenv(console.ENV, "loud")
    restore.setattr(console._QUIET, "warned", False)
    assert console.setup() == logging.WARNING
    assert "ZEROTUNE_LOG='loud' is not one of warning, info, debug; using warning" in capsys.readouterr().err


def test_quiet_stdout_holds_back_library_prints_unless_verbose(restore, capsys):
    with console.quiet_stdout():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    assert capsys.readouterr().out == ""
    with pytest.raises(RuntimeError), console.quiet_stdout():
        print("what led to the error")
        raise RuntimeError("boom")
    assert capsys.readouterr().out == "what led to the error\n"  # an error brings it back
    restore.setenv(console.ENV, "info")
    with console.quiet_stdout():
        print("shown")
    assert capsys.readouterr().out == "shown\n"


def test_a_recipe_error_is_printed_at_once_by_local_rank_0_later_by_the_others(restore, capsys):
    """Every rank meets a recipe error before any process group exists: local rank 0 prints it at once; another rank
    waits, so that the launcher ends it when local rank 0 exits, and prints it only if it is still running then (no
    launcher, or local rank 0 did not meet it). Printed once through the real launcher: test_tiny_recipe.py."""
    restore.setattr(dist, "QUIET_EXIT_DELAY_S", 1.0)
    printed, waited = {}, {}
    for rank in ("0", "1"):
        restore.setenv("RANK", rank)
        restore.setenv("LOCAL_RANK", rank)
        start = time.monotonic()
        assert train_main(["--config", TINY_RECIPE, "train.max_step=3"]) == 2
        waited[rank] = time.monotonic() - start
        printed[rank] = capsys.readouterr().err
    assert printed["0"] == printed["1"] and printed["0"].count("zerotune: error:") == 1
    assert printed["0"].startswith("zerotune: error: command-line override 'train.max_step=3': unknown key")
    assert waited["0"] < 1.0 <= waited["1"]


def test_torch_cpp_warnings_are_hidden_by_default_shown_when_verbose_and_a_users_level_stays(restore):
    """c10d's C++ warnings (a loopback address without a reverse DNS entry gives one per rank) follow
    TORCH_CPP_LOG_LEVEL, which the ranks inherit from the process that starts them."""
    console.setup()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    restore.delenv("TORCH_CPP_LOG_LEVEL")
    console.setup(verbose=True)
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ
    restore.delenv(console.ENV, raising=False)
    restore.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    console.setup()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"
