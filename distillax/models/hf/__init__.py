"""Hugging Face checkpoints in and out: config translation both ways, tensor names, safetensors
weights, tokenizers and chat templates."""
