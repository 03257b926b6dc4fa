"""Sequence-level distillation: the student learns next-token prediction on the teacher's text.

Kim & Rush (2016): instead of matching the teacher's distribution token by token, sample (or
greedily decode) whole continuations from the teacher and train the student with plain
cross-entropy on them. The job (`trainer = 'sequence_kd'`, distillax/configs/sequence_kd.py):

  1. takes the beginnings of train-split documents as prompts (`sequence_kd.prompt_len` tokens,
     BOS included; documents in a seeded random order),
  2. continues each with the teacher through the KV-cached sampler (models/sampler.py), batched
     and sharded on the run's mesh,
  3. writes one JSONL line `{"text": prompt + continuation}` per prompt (decoded with the run's
     tokenizer) to `<workdir>/teacher_samples.jsonl` (or `sequence_kd.output`), and
  4. trains the student with the `lm` objective on that file; eval stays on the validation split
     of the original `data.source`, so the figures compare with any other run on that data.

The teacher is loaded as the distillation trainer loads it (`teacher` section) and dropped before
training starts. A finished sample file is reused on resume (it is written to a temporary name
and renamed at the end), so a restarted run trains on the same data.
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections
import numpy as np
from absl import logging

from distillax.errors import ConfigError, UserError
from distillax.trainers.base import Trainer

SAMPLES_FILE = "teacher_samples.jsonl"


def default_sequence_kd_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.num_prompts = 256  # train documents whose beginnings become prompts
  c.prompt_len = 32  # prompt tokens per document (BOS included); shorter documents give less
  c.max_new_tokens = 96  # teacher tokens generated per prompt (fewer if it emits EOS)
  c.temperature = 1.0  # teacher sampling temperature (0 = greedy decoding)
  c.top_k = 0  # sample from the teacher's top-k tokens only (0 = off)
  c.top_p = 1.0  # nucleus sampling mass (1 = off)
  c.batch_size = 32  # prompts per generation call (rounded up to the data-parallel size)
  c.include_prompt = True  # each sample's text starts with its prompt (False: continuation only)
  c.output = ""  # the JSONL written ('' = <workdir>/teacher_samples.jsonl)
  return c


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


class SequenceKDTrainer(Trainer):
  """The `lm` trainer whose train data are teacher samples it writes first."""

  name = "sequence_kd"

  @property
  def samples_path(self) -> str:
    return os.path.abspath(self.config.sequence_kd.output or os.path.join(self.workdir,
                                                                         SAMPLES_FILE))

  def setup(self, *, with_data: bool = True) -> None:
    super().setup(with_data=False)  # every student-side config error surfaces first
    if with_data:
      self.ensure_samples()
      self.train_it = self._train_iterator()

  def samples_data_config(self) -> ml_collections.ConfigDict:
    """The `data` section with the sample file as the whole train set."""
    data = ml_collections.ConfigDict(self.config.data.to_dict())
    data.source, data.format, data.text_field = self.samples_path, "jsonl", "text"
    data.eval_source, data.validation_fraction = "", 0.0
    return data

  def _train_iterator(self):
    from distillax.data import make_train_iterator
    return make_train_iterator(self.samples_data_config(), global_batch_size=self.batch_size,
                               seq_len=self.seq_len, seed=int(self.config.seed),
                               tokenizer=self.tokenizer)

  def ensure_samples(self) -> str:
    """Writes the teacher samples unless a finished file is already there; returns its path."""
    path, sc = self.samples_path, self.config.sequence_kd
    if os.path.exists(path):
      logging.info("sequence_kd: reusing the teacher samples in %s", path)
      return path
    if jax.process_count() > 1:
      raise UserError("sequence_kd generates its samples in one process; run it without "
                      "--num_processes, or generate once and train the lm config on the file")
    for name in ("num_prompts", "prompt_len", "batch_size"):
      if int(sc[name]) < 1:
        raise ConfigError(f"sequence_kd.{name}={sc[name]} must be >= 1")
    from distillax.distill.cache_job import teacher_host
    host = teacher_host(self.config, self.workdir)
    host.mesh, host.rules = self.mesh, self.rules
    teacher = host.load_teacher(self.mesh, self.rules)
    prompts = take_prompts(self.config.data, self.tokenizer, count=int(sc.num_prompts),
                           prompt_len=int(sc.prompt_len), seed=int(self.config.seed))
    texts, stats = generate_samples(teacher, prompts, self.tokenizer, sc, mesh=self.mesh,
                                    rules=self.rules, seed=int(self.config.seed))
    write_jsonl(path, texts)
    logging.info("sequence_kd: %d teacher samples (%d generated tokens, teacher NLL %.3f per "
                 "token) in %s", stats["samples"], stats["generated_tokens"],
                 stats["teacher_nll_per_token"], path)
    return path


__all__ = ["SAMPLES_FILE", "SequenceKDTrainer", "default_sequence_kd_config", "generate_samples",
           "take_prompts", "write_jsonl"]
