"""Sequence-level distillation: the student learns next-token prediction on the teacher's text.

Kim & Rush (2016): instead of matching the teacher's distribution token by token, sample (or
greedily decode) whole continuations from the teacher and train the student with plain
cross-entropy on them. The job (`trainer = 'sequence_kd'`, distillax/configs/sequence_kd.py; its
recipe is trainers/sequence_kd.py):

  1. takes the beginnings of train-split documents as prompts (`sequence_kd.prompt_len` tokens,
     BOS included; documents in a seeded random order),
  2. continues each with the teacher through the KV-cached sampler (models/sampler.py), batched
     and sharded on the run's mesh,
  3. writes one JSONL line `{"text": prompt + continuation}` per prompt (decoded with the run's
     tokenizer) to `<workdir>/teacher_samples.jsonl` (or `sequence_kd.output`), and
  4. trains the student with the `lm` objective on that file; eval stays on the validation split
     of the original `data.source`, so the figures compare with any other run on that data.

The teacher is loaded as every distillation job loads it (`teacher` section) and dropped before
training starts. A finished sample file is reused on resume (it is written to a temporary name
and renamed at the end), so a restarted run trains on the same data.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from distillax.errors import UserError

def take_prompts(data_cfg, tokenizer, *, count: int, prompt_len: int, seed: int
                 ) -> list[np.ndarray]:
  """The first `prompt_len` tokens ([BOS] + text) of `count` train documents, in a seeded order."""
  from distillax.data import resolve_data_config, split_documents
  cfg = resolve_data_config(data_cfg)
  documents = split_documents(cfg, "train")
  head = [tokenizer.bos_id] if cfg.add_bos and tokenizer.bos_id is not None else []
  prompts = []
  for index in np.random.default_rng(seed).permutation(len(documents)):
    # A token is at least one character for every tokenizer here, so this prefix is enough.
    ids = head + tokenizer.encode(documents[int(index)][:prompt_len * 32])
    if len(ids) > len(head):
      prompts.append(np.asarray(ids[:prompt_len], np.int32))
    if len(prompts) == count:
      break
  if not prompts:
    raise UserError(f"no non-empty train documents in data.source={cfg.source!r} to take "
                    f"sequence-KD prompts from")
  return prompts


def generate_samples(teacher, prompts: list[np.ndarray], tokenizer, sc, *, mesh=None, rules=None,
                     seed: int = 0) -> tuple[list[str], dict[str, float]]:
  """Teacher continuations of `prompts` as texts, and a few statistics of them."""
  from distillax.models.sampler import Sampler
  sampler = Sampler(teacher, mesh=mesh, rules=rules)
  data_parallel = int(mesh.shape.get("data", 1)) if mesh is not None else 1
  batch = -(-int(sc.batch_size) // data_parallel) * data_parallel
  width = max(len(p) for p in prompts)
  specials = {t for t in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) if t is not None}
  texts, generated, logprob_sum = [], 0, 0.0
  for start in range(0, len(prompts), batch):
    chunk = prompts[start:start + batch]
    rows = chunk + [chunk[0]] * (batch - len(chunk))  # static shapes: pad with copies, drop them
    tokens_BxP = np.full((batch, width), tokenizer.pad_id, np.int32)
    for i, p in enumerate(rows):
      tokens_BxP[i, :len(p)] = p
    out = sampler(tokens_BxP, np.asarray([len(p) for p in rows], np.int32),
                  max_new_tokens=int(sc.max_new_tokens), temperature=float(sc.temperature),
                  top_k=int(sc.top_k) or None, top_p=float(sc.top_p) if sc.top_p < 1 else None,
                  eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                  seed=jax.random.fold_in(jax.random.key(seed), start))
    new_BxT, lengths_B, logprobs_BxT = jax.device_get(
        (out.tokens_BxT, out.lengths_B, out.logprobs_BxT))
    for i, prompt in enumerate(chunk):
      continuation = new_BxT[i, :lengths_B[i]].tolist()
      ids = (prompt.tolist() if sc.include_prompt else []) + continuation
      texts.append(tokenizer.decode([t for t in ids if t not in specials]))
      generated += int(lengths_B[i])
      logprob_sum += float(np.sum(logprobs_BxT[i, :lengths_B[i]]))
  stats = {"samples": len(texts), "generated_tokens": generated,
           "teacher_nll_per_token": -logprob_sum / max(generated, 1)}
  return texts, stats


def write_jsonl(path: str, texts: list[str]) -> None:
  """One `{"text": ...}` line per sample, written to a temporary name and renamed when done."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for text in texts:
      f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


__all__ = ["generate_samples", "take_prompts", "write_jsonl"]
