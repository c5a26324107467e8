"""zerotune: fine-tune Mistral-7B (LoRA or full) with DeepSpeed ZeRO-0/1/2/3 on one GPU box or many."""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# Shipped with the package as finetune/_shipped/<folder> (never as top-level packages); finetune/shipped.py reads
# them there, or from the checkout in an editable install.
SHIPPED = ("ds_configs", "recipes")


def _shipped_files() -> list[str]:
    files = []
    for folder in SHIPPED:
        for dirpath, dirnames, names in os.walk(os.path.join(HERE, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            files += [os.path.relpath(os.path.join(dirpath, n), HERE) for n in names if not n.endswith(".pyc")]
    return sorted(files)


class BuildPyWithShipped(build_py):
    """Copy ds_configs/ and recipes/ into the built package, so `--config tiny` and `--deepspeed zero3` work from a
    wheel or a non-editable install."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's own folders
        target = os.path.join(self.build_lib, "finetune", "_shipped")
        shutil.rmtree(target, ignore_errors=True)  # a file deleted from the checkout must not linger in build/
        missing = [folder for folder in SHIPPED if not os.path.isdir(os.path.join(HERE, folder))]
        if missing:
            raise FileNotFoundError(f"{', '.join(missing)} missing beside setup.py: build the wheel from a checkout "
                                    f"(pip wheel . / pip install .)")
        for path in _shipped_files():
            dest = os.path.join(target, path)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(os.path.join(HERE, path), dest)


setup(
    name="zerotune",
    version="0.1.0",
    description="Fine-tune Mistral-7B with DeepSpeed ZeRO, LoRA or full, on one node or many",
    packages=find_packages(include=["finetune", "finetune.*"]),
    python_requires=">=3.10",
    # torch is not pinned: GPU users keep their CUDA build; CPU installs (CI) pin torch==2.13.0 themselves.
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.16",
        "transformers>=5.0",
        "peft>=0.17",
        "datasets>=3.0",
        "sentencepiece>=0.2",
        "protobuf>=5",
        "mistral-common>=1.8",
        "pyyaml>=6",
        "safetensors>=0.4",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "ruff>=0.6", "matplotlib>=3.8", "tensorboard>=2.15", "wandb>=0.19",
                "triton>=3.0",  # its CPU interpreter runs the LoRA dropout kernels in tests
                "trl>=1.15"],  # the preference losses are checked against TRL's trainers
        # train.log_to back-ends and `zerotune plot`: none of them is needed to train.
        "tensorboard": ["tensorboard>=2.15"],
        "wandb": ["wandb>=0.19"],
        "plot": ["matplotlib>=3.8"],
        "mpi": ["mpi4py>=4"],
        "liger": ["liger-kernel>=0.5"],
    },
    entry_points={"console_scripts": ["zerotune=finetune.cli:main"]},
    cmdclass={"build_py": BuildPyWithShipped},
)
