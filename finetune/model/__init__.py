"""What trains: the Mistral model and its LoRA adapters (build), the random init drawn the same under every ZeRO
stage, the token loss, activation recomputation and its offload, the optimizer's parameter groups, and generation.

    from finetune.model.build import build_model
"""
