"""Export from a run: Hugging Face safetensors, the LoRA adapter or the merged model (weights), and the tokenizer with
the chat template the run trained on (tokenizer).

    zerotune export runs/x --out exports/x
"""
