"""zerotune: fine-tune Mistral (LoRA or full) with DeepSpeed ZeRO-0/1/2/3.

    deepspeed --num_gpus 8 finetune/main.py --deepspeed ds_configs/zero3.json
"""

__version__ = "0.1.0"
