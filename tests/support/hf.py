"""Transformers models as the parity tests use them (the hf extra: torch and transformers)."""

from pathlib import Path

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


def cached_decode_delta(hf_model, ours, prompt, steps: int) -> float:
  """Max |Δlogit| between transformers and `ours` (a distillax model) over a KV-cached greedy
  decode: the prompt's prefill, then `steps` single-token steps, each feeding both models the
  token transformers picked (so they walk one path), every step's logits compared."""
  import jax.numpy as jnp

  from distillax.models.attention.layer import KVCache
  from tests.support.models import forward

  B, P = prompt.shape
  cache = KVCache.zeros(ours.config, B, P + steps)
  worst, feed = 0.0, np.asarray(prompt)
  with torch.no_grad():
    out = hf_model(input_ids=torch.tensor(feed), use_cache=True)
  for step in range(steps + 1):
    mine = forward(ours, jnp.asarray(feed, jnp.int32), cache=cache)
    cache = mine.cache
    want = out.logits.numpy()[:, -1]
    worst = max(worst, float(np.max(np.abs(np.asarray(mine.logits_BxLxV)[:, -1] - want))))
    if step == steps:
      return worst
    feed = want.argmax(-1)[:, None]
    with torch.no_grad():
      out = hf_model(input_ids=torch.tensor(feed), cache=out.cache, use_cache=True)


def packed_documents_delta(hf_model, ours, tokens, cuts) -> float:
  """Max |Δlogit| between `ours` over packed rows and transformers over each document alone:
  row i of `tokens` (B, L) holds two documents split at cuts[i] (positions restart, segment ids
  1 and 2)."""
  import jax.numpy as jnp

  from tests.support.models import forward

  L = tokens.shape[1]
  seg = jnp.asarray([[1] * c + [2] * (L - c) for c in cuts], jnp.int32)
  pos = jnp.asarray([list(range(c)) + list(range(L - c)) for c in cuts], jnp.int32)
  got = np.asarray(forward(ours, jnp.asarray(tokens, jnp.int32), pos, seg).logits_BxLxV)
  worst = 0.0
  for row, cut in enumerate(cuts):
    for doc in (slice(0, cut), slice(cut, L)):
      want = torch_logits(hf_model, tokens[row:row + 1, doc])[0]
      worst = max(worst, float(np.max(np.abs(got[row, doc] - want))))
  return worst


def blocks_state(model, layers) -> dict:
  """A transformers model's state dict with only blocks `layers`, renumbered 0.. in that order
  (embeddings, final norm and head as they are): the weights of the model those blocks make."""
  state = model.state_dict()
  out = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
  for i, t in enumerate(layers):
    prefix = f"model.layers.{t}."
    out.update({f"model.layers.{i}." + k[len(prefix):]: v for k, v in state.items()
                if k.startswith(prefix)})
  return out


def widened_qwen35(model):
  """A random-init Qwen3.5(-MoE) in eval mode with weights wide enough that a misplaced one
  shows in the logits; A_log and dt_bias keep the decay init the delta rule needs."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if not name.endswith(("A_log", "dt_bias")):
        p.normal_(0.0, 0.3 if "norm" in name else 0.1)
  return model.eval()


def assert_export_is_the_checkpoint(checkpoint_dir, exported_dir, tokens, want_logits) -> None:
  """An export written back to Hugging Face: the same tensor names and values, bit for bit, as
  the checkpoint it was imported from, and transformers' logits of it within 1e-5 of `want`."""
  import transformers
  from safetensors.numpy import load_file
  theirs = load_file(str(Path(checkpoint_dir) / "model.safetensors"))
  mine = load_file(str(Path(exported_dir) / "model.safetensors"))
  assert sorted(mine) == sorted(theirs)
  for name, array in theirs.items():
    np.testing.assert_array_equal(mine[name], array, err_msg=name)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      exported_dir, attn_implementation="eager").eval()
  assert np.max(np.abs(torch_logits(reloaded, tokens) - want_logits)) <= 1e-5
