"""A non-editable build carries ds_configs/ and recipes/ inside the package, and the installed copy runs from a folder
outside the checkout, importing nothing from it: `estimate` with shipped names and no weights, and `recipes`. And the
environment launch/quickstart.sh installs into: the active virtual environment, else the checkout's .venv (a new one:
tests/integration/test_docs_commands.py, which runs the whole quickstart).

The wheel is built from a copy of the checkout's sources: building in place writes build/ and *.egg-info into the
checkout, and a stale build/lib there could carry a file the sources no longer have.
"""

import os
import shutil
import subprocess
import sys
import zipfile

from tests.fixtures.quickstart_install import pip_calls, write_stand_ins
from tests.helpers import ROOT

# Names matched at any depth: none of them is a folder of the package or of the shipped files.
NOT_SOURCES = shutil.ignore_patterns(".venv", ".git", ".cache", "build", "runs", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".ruff_cache", "tests", "docs", "benchmarks")
SHIPPED = ["ds_configs/zero3.json", "ds_configs/zero3_offload.json", "recipes/tiny.yaml", "recipes/mistral7b_lora.yaml",
           "recipes/mistral7b_full.yaml", "recipes/data/tiny_instruct.jsonl", "recipes/tiny_model/config.json",
           "recipes/mistral7b_shape/config.json"]


def _run(cmd: list[str], **kwargs) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_wheel_carries_the_shipped_files_and_runs_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCES)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src), "-w", str(tmp_path / "wheel")])
    (wheel,) = (tmp_path / "wheel").iterdir()
    names = zipfile.ZipFile(wheel).namelist()
    for path in SHIPPED:
        assert f"finetune/_shipped/{path}" in names, path
    top = {n.split("/")[0] for n in names}
    assert top - {"finetune"} == {d for d in top if d.endswith(".dist-info")}, top  # no top-level recipes/, launch/

    site = tmp_path / "site"
    _run(pip + ["install", "--no-deps", "--no-index", "--target", str(site), str(wheel)])
    assert (site / "bin" / "zerotune").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Only the install on the path (-P: not even the current folder); torch and the rest from this interpreter's venv.
    env = dict(os.environ, PYTHONPATH=str(site))
    python = [sys.executable, "-P"]
    where = _run(python + ["-c", "import finetune, finetune.shipped as s; from finetune.config import load_recipe; "
                                 "r = load_recipe('tiny'); print(finetune.__file__, s.ROOT, r.model.path, r.data.path, "
                                 "sep='\\n')"], cwd=elsewhere, env=env).split()
    assert where[0] == str(site / "finetune" / "__init__.py"), where
    assert where[1] == str(site / "finetune" / "_shipped")
    assert where[2:] == [str(site / "finetune" / "_shipped" / "recipes" / p) for p in ("tiny_model", "data/tiny_instruct.jsonl")]

    out = _run(python + ["-m", "finetune.cli", "estimate", "--config", "mistral7b_full", "--deepspeed", "zero3",
                         "--gpus", "8", "--gpu-memory-gib", "80", "--cpu-memory-gib", "256"], cwd=elsewhere, env=env)
    assert "has no config.json" in out and "using the shipped Mistral-7B shape" in out
    assert "7,241,732,096 parameters" in out and "| ZeRO-3 * |" in out and "recommendation: ZeRO-" in out

    out = _run(python + ["-m", "finetune.cli", "recipes"], cwd=elsewhere, env=env)
    assert f"in {site / 'finetune' / '_shipped' / 'recipes'}:" in out
    for path in SHIPPED[:5]:
        assert os.path.basename(path) in out
    assert ROOT not in out


def _quickstart_until_pip(tmp_path, env_extra: dict[str, str], venv: bool) -> tuple[str, list[tuple[str, str]], str]:
    """Run launch/quickstart.sh in a checkout-like folder with a pip that fails at once: (what it printed, pip's
    calls, the folder). The quickstart stops at the install, after choosing the environment."""
    folder, stand_in = tmp_path / "checkout", tmp_path / "bin"
    folder.mkdir()
    stand_in.mkdir()
    os.symlink(os.path.join(ROOT, "launch"), folder / "launch")
    if venv:  # made earlier, e.g. by the README's install lines
        (folder / ".venv" / "bin").mkdir(parents=True)
        (folder / ".venv" / "bin" / "activate").write_text(f'export VIRTUAL_ENV="{folder / ".venv"}"\n')
    log = write_stand_ins(str(stand_in), pip_exit=1)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(PATH=os.pathsep.join([str(stand_in), os.environ.get("PATH", "")]), **env_extra)
    done = subprocess.run(["bash", "launch/quickstart.sh"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    return done.stdout, pip_calls(log), str(folder)


def test_the_quickstart_installs_into_the_active_virtual_environment(tmp_path):
    out, calls, folder = _quickstart_until_pip(tmp_path, {"VIRTUAL_ENV": str(tmp_path / "mine")}, venv=False)
    assert out.splitlines()[0] == f"installing zerotune into the active virtual environment, {tmp_path / 'mine'}"
    assert calls == [(str(tmp_path / "mine"), "install -q --upgrade pip setuptools wheel")]
    assert not os.path.exists(os.path.join(folder, ".venv"))


def test_the_quickstart_uses_the_checkouts_venv_when_none_is_active(tmp_path):
    out, calls, folder = _quickstart_until_pip(tmp_path, {}, venv=True)
    assert out.splitlines()[0].startswith("installing zerotune into .venv, the virtual environment here (")
    assert ". .venv/bin/activate" in out.splitlines()[0]
    assert [venv for venv, _ in calls] == [os.path.join(folder, ".venv")]
