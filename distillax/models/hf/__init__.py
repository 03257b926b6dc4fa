"""Hugging Face checkpoints in and out: config translation both ways, tensor names, safetensors
weights, tokenizers and chat templates.

The stable import for Python users (docs/python-api.md):

    from distillax.models import hf
    model = hf.load("path/to/hf_dir", mesh=mesh, rules=rules)  # a sharded distillax model
    hf.save(model, "out/hf_dir", tokenizer=tokenizer)            # what transformers loads

`load` and `save` live in checkpoint.py; they are looked up when first used, so importing one
of this room's light modules (names, config) does not load the weight readers.
"""

from __future__ import annotations

__all__ = ["load", "save"]


def __getattr__(name: str):
  if name in __all__:
    from distillax.models.hf import checkpoint
    return getattr(checkpoint, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
