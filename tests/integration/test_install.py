"""A non-editable build carries ds_configs/ and recipes/ inside the package, and the installed copy runs from a folder
outside the checkout, importing nothing from it: `estimate` with shipped names and no weights, and `recipes`.

The wheel is built from a copy of the checkout's sources: building in place writes build/ and *.egg-info into the
checkout, and a stale build/lib there could carry a file the sources no longer have.
"""

import os
import shutil
import subprocess
import sys
import zipfile

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
