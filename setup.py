"""zerotune: fine-tune Mistral-7B (LoRA or full) with DeepSpeed ZeRO-0/1/2/3 on one GPU box or many."""

from setuptools import find_packages, setup

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
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "matplotlib>=3.8", "tensorboard>=2.15", "wandb>=0.19",
                "triton>=3.0"],  # its CPU interpreter runs the LoRA dropout kernels in tests
        # train.log_to back-ends and `zerotune plot`: none of them is needed to train.
        "tensorboard": ["tensorboard>=2.15"],
        "wandb": ["wandb>=0.19"],
        "plot": ["matplotlib>=3.8"],
        "mpi": ["mpi4py>=4"],
        "liger": ["liger-kernel>=0.5"],
    },
    entry_points={"console_scripts": ["zerotune=finetune.cli:main"]},
)
