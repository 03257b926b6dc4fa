"""Transformers models as the parity tests use them (the hf extra: torch and transformers)."""

import numpy as np
import torch


def torch_logits(model, tokens) -> np.ndarray:
  """transformers' logits of `tokens` (a (B, L) int array), as numpy."""
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens)).logits.numpy()


def saved_with_logits(model, path, tokens) -> tuple:
  """(path, logits): `model` saved there with save_pretrained, and its logits of `tokens`."""
  model.save_pretrained(path)
  return path, torch_logits(model, tokens)
