"""Completions of many token prompts, a fixed batch at a time, through one `Sampler`.

lm-eval's generate_until (eval/harness.py), `distillax eval --generate` and the trainer's
generation eval (trainers/generation_eval.py) all decode here, so the same weights and prompts
give the same tokens whichever of them asks: a run's logged eval_bleu is the one `eval
--generate` prints for its checkpoint. Prompts are cut on the left to leave room for the new
tokens, right-padded to a power-of-two length bucket (few compiled shapes) in rows of
`batch_size` (empty rows fill the last batch, so one shape serves every call), and each row's
ids are cut before its first stop id.
"""

from __future__ import annotations

import numpy as np

from distillax.errors import UserError
from distillax.models.scoring import length_bucket


def complete_batch(sampler, prompts: list[list[int]], *, batch_size: int, max_new_tokens: int,
                   pad_id: int, stop_ids: tuple[int, ...], vocab_limit: int | None,
                   temperature: float = 0.0, top_p: float | None = None,
                   top_k: int | None = None, seed: int = 0) -> list[list[int]]:
  """The new ids of each of at most `batch_size` prompts (token id lists), up to the first
  stop id (the first of `stop_ids` is the sampler's EOS)."""
  if len(prompts) > batch_size:
    raise ValueError(f"{len(prompts)} prompts for a batch of {batch_size}")
  max_len = int(sampler.config.max_seq_len)
  room = max_len - max_new_tokens
  if room < 1:
    raise UserError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the "
                    f"model's max_seq_len={max_len}; lower it")
  prompts = [list(p)[-room:] for p in prompts]
  width = length_bucket(max(len(p) for p in prompts), 16, room)
  prompt_BxP = np.zeros((batch_size, width), np.int32)
  lengths_B = np.ones((batch_size,), np.int32)
  for b, ids in enumerate(prompts):
    prompt_BxP[b, :len(ids)], lengths_B[b] = ids, len(ids)
  result = sampler(prompt_BxP, lengths_B, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, top_k=top_k, eos_id=stop_ids[0] if stop_ids else None,
                   pad_id=pad_id, seed=seed, vocab_limit=vocab_limit)
  tokens_BxT = np.asarray(result.tokens_BxT)
  out = []
  for b in range(len(prompts)):
    ids = tokens_BxT[b].tolist()
    out.append(ids[:next((t for t, i in enumerate(ids) if i in stop_ids), len(ids))])
  return out


def greedy_completions(sampler, prompts: list[list[int]], *, batch_size: int,
                       max_new_tokens: int, pad_id: int, stop_ids: tuple[int, ...],
                       vocab_limit: int | None) -> list[list[int]]:
  """Every prompt's greedy continuation, `batch_size` prompts per sampler call."""
  out = []
  for start in range(0, len(prompts), batch_size):
    out += complete_batch(sampler, prompts[start:start + batch_size], batch_size=batch_size,
                          max_new_tokens=max_new_tokens, pad_id=pad_id, stop_ids=stop_ids,
                          vocab_limit=vocab_limit)
  return out
