"""Sequence-level distillation: the student learns next-token prediction on the teacher's text.

Kim & Rush (2016): instead of matching the teacher's distribution token by token, sample (or
greedily decode) whole continuations from the teacher and train the student with plain
cross-entropy on them. The job (`trainer = 'sequence_kd'`, distillax/configs/sequence_kd.py; its
recipe is trainers/sequence_kd.py):

  1. takes prompts from train-split documents in a seeded random order: the first
     `sequence_kd.prompt_len` tokens (BOS included) of a text document; the turns before a
     chat's last assistant answer, rendered with the chat template and its generation prompt;
     a prompt/completion record's prompt (whole prompts longer than prompt_len are skipped),
  2. continues each with the teacher through the KV-cached sampler (models/sampler.py), batched
     and sharded on the run's mesh, drawing only ids the tokenizer has (never a padded row),
  3. writes one JSONL record per prompt to `<workdir>/teacher_samples.jsonl` (or
     `sequence_kd.output`), decoded with the run's tokenizer: `{"text": prompt + continuation}`
     for text, `{"prompt": turns or text, "completion": the teacher's answer}` for chats and
     prompts (the answer ends at EOS or any special token, e.g. the end of the turn), so that
     only the teacher's answer is trained, and
  4. trains the student with the `lm` objective on that file; eval stays on the validation split
     of the original `data.source`, so the figures compare with any other run on that data.

The teacher is loaded as every distillation job loads it (`teacher` section) and dropped before
training starts. A finished sample file is reused on resume (it is written to a temporary name
and renamed at the end), so a restarted run trains on the same data (trainers/teacher_samples.py,
shared with the draft job's `draft.regenerate`, which writes every sample as a prompt and its
answer: `answer_prompts`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from distillax import interrupts
from distillax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A teacher prompt: its token ids and what the sample around the teacher's text is.

  kind 'text': a document's first tokens, the sample is {"text": prompt + continuation}.
  kind 'chat': the turns before a chat's (last) assistant answer, rendered with the chat
  template and its generation prompt; the sample is {"prompt": turns, "completion": [the
  teacher's answer]}, so only the teacher's answer is trained. kind 'prompt_completion': a
  plain-text prompt; the sample is {"prompt": prompt, "completion": the teacher's text}.
  """

  tokens: np.ndarray
  kind: str = "text"
  context: object = None  # chat: the prompt turns (a tuple of dicts); prompt_completion: text


def _chat_turns(record) -> tuple:
  """The turns a chat record's answer follows: its prompt messages, else those before its last
  assistant turn (all of them when none is the assistant's)."""
  messages = tuple(record.messages)
  if record.prompt_messages is not None:
    return messages[:record.prompt_messages]
  answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
  return messages[:answers[-1]] if answers else messages


def _render_prompt(template, turns, source: str) -> str:
  """The prompt turns and the generation prompt as the chat template writes them."""
  import jinja2
  try:
    return template.render(turns, add_generation_prompt=True)
  except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
    raise UserError(f"{source or 'a chat record'}: the chat template failed on the turns before "
                    f"its last answer ({e}); fix the record or the template") from None


def _document_prompt(document, tokenizer, template, head: list[int], prompt_len: int
                     ) -> Prompt | int | None:
  """The prompt of one train document; None when it gives none (empty), and the length of its
  whole prompt when that is longer than `prompt_len` (a chat or prompt cut short is no
  prompt)."""
  from distillax.data import records
  from distillax.data.chat import encode_chat
  if isinstance(document, str):
    # A token is at least one character for every tokenizer here, so this prefix is enough.
    ids = head + tokenizer.encode(document[:prompt_len * 32])
    return Prompt(np.asarray(ids[:prompt_len], np.int32)) if len(ids) > len(head) else None
  if isinstance(document, records.ChatRecord):
    turns = _chat_turns(document)
    if template is None:
      encode_chat(document, tokenizer, None)  # raises: chats need a chat template
    ids = tokenizer.encode(_render_prompt(template, turns, document.source)) if turns else []
    kind, context = "chat", turns
  else:
    ids, kind, context = head + tokenizer.encode(document.prompt), "prompt_completion", (
        document.prompt)
  if not ids:
    return None
  if len(ids) > prompt_len:
    return len(ids)
  return Prompt(np.asarray(ids, np.int32), kind, context)


class NoPromptFits(UserError):
  """No document of a split gives a prompt of at most `prompt_len` tokens; `shortest`: the
  shortest whole prompt skipped (None: no document has text). `line(need)` words the error
  with the length to suggest (a caller that checks several splits suggests one for all)."""

  def __init__(self, split: str, source: str, field: str, prompt_len: int,
               shortest: int | None):
    self.split, self.source, self.field = split, source, field
    self.prompt_len, self.shortest = prompt_len, shortest
    super().__init__(self.line(shortest))

  def line(self, need: int | None, also: str = "") -> str:
    fix = (f"raise it, e.g. --config.{self.field}={need}{also} (the shortest whole prompt "
           f"there, chat template and generation prompt included, is {self.shortest} tokens)"
           if self.shortest else f"give documents with text in {self.source!r}")
    return (f"no {self.split} document of {self.source!r} gives a prompt of at most "
            f"{self.field}={self.prompt_len} tokens; {fix}")


def take_prompt_records(data_cfg, tokenizer, *, count: int, prompt_len: int, seed: int,
                        split: str = "train", field: str = "sequence_kd.prompt_len"
                        ) -> list[Prompt]:
  """Prompts from `count` train documents in a seeded order: the first `prompt_len` tokens
  ([BOS] + text) of a text document; the whole prompt of a chat or prompt/completion record,
  skipped when longer than `prompt_len` tokens. split='eval': from the held-out documents.
  None at all is a NoPromptFits naming `field` (the config key of `prompt_len`) and the length
  that admits the shortest prompt it skipped. Fewer than `count` because some were skipped is
  said in one warning line with the counts (nothing is left out silently)."""
  from absl import logging
  from distillax.data import resolve_data_config, split_documents
  from distillax.data.chat import template_for
  cfg = resolve_data_config(data_cfg)
  documents = split_documents(cfg, split)
  head = [tokenizer.bos_id] if cfg.add_bos and tokenizer.bos_id is not None else []
  template = template_for(tokenizer, str(cfg.get("chat_template") or ""))
  prompts, skipped = [], []
  for index in np.random.default_rng(seed).permutation(len(documents)):
    prompt = _document_prompt(documents[int(index)], tokenizer, template, head, prompt_len)
    if isinstance(prompt, int):
      skipped.append(prompt)
    elif prompt is not None:
      prompts.append(prompt)
    if len(prompts) == count:
      break
  if not prompts:
    source = cfg.eval_source if split == "eval" and cfg.get("eval_source") else cfg.source
    raise NoPromptFits(split, source, field, prompt_len, min(skipped) if skipped else None)
  if skipped and len(prompts) < count:
    logging.warning("%s=%d: %d of the %s prompts are longer and left out, %d used of the %d "
                    "asked for; --config.%s=%d keeps them all", field, prompt_len, len(skipped),
                    split, len(prompts), count, field, max(skipped))
  return prompts


def take_prompts(data_cfg, tokenizer, *, count: int, prompt_len: int, seed: int
                 ) -> list[np.ndarray]:
  """The token ids of `take_prompt_records`: for text documents, the first `prompt_len` tokens
  ([BOS] + text) of `count` train documents, in a seeded order."""
  return [p.tokens for p in take_prompt_records(data_cfg, tokenizer, count=count,
                                                prompt_len=prompt_len, seed=seed)]


def stop_ids(tokenizer) -> set[int]:
  """Ids that end an answer: BOS, EOS, padding and every special token (e.g. an end of turn)."""
  stops = {t for t in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) if t is not None}
  for token in getattr(tokenizer, "control_tokens", ()):
    ids = tokenizer.encode(token)
    if len(ids) == 1:
      stops.add(int(ids[0]))
  return stops


def sample_record(prompt: Prompt, continuation: list[int], tokenizer, include_prompt: bool
                  ) -> dict:
  """The JSONL record of one teacher sample (see Prompt)."""
  if prompt.kind == "text":
    specials = {t for t in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
                if t is not None}
    ids = (prompt.tokens.tolist() if include_prompt else []) + continuation
    return {"text": tokenizer.decode([t for t in ids if t not in specials])}
  stops = stop_ids(tokenizer)
  cut = next((i for i, t in enumerate(continuation) if t in stops), len(continuation))
  answer = tokenizer.decode(continuation[:cut])
  if prompt.kind == "chat":
    return {"prompt": list(prompt.context),
            "completion": [{"role": "assistant", "content": answer}]}
  return {"prompt": prompt.context, "completion": answer}


def answer_prompts(prompts: list[Prompt], tokenizer) -> list[Prompt]:
  """`prompts` with each text document's beginning made a plain-text prompt (its decoded text,
  BOS left to the data pipeline), so that its sample is {"prompt", "completion"} and only the
  teacher's continuation is trained; chat and prompt/completion prompts are already so."""
  specials = {t for t in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) if t is not None}
  return [dataclasses.replace(p, kind="prompt_completion", context=tokenizer.decode(
      [t for t in p.tokens.tolist() if t not in specials])) if p.kind == "text" else p
          for p in prompts]


def generate_samples(teacher, prompts: list[Prompt], tokenizer, sc, *, mesh=None, rules=None,
                     seed: int = 0, on_batch=None) -> tuple[list[dict], dict[str, float]]:
  """Teacher continuations of `prompts` as sample records, and a few statistics of them.
  `on_batch(prompts, generated tokens)` is called after each sampler call (progress lines: a
  large regeneration runs for hours); Ctrl-C is honoured between calls."""
  from distillax.models.sampler import Sampler
  sampler = Sampler(teacher, mesh=mesh, rules=rules)
  data_parallel = int(mesh.shape.get("data", 1)) if mesh is not None else 1
  batch = -(-int(sc.batch_size) // data_parallel) * data_parallel
  width = max(len(p.tokens) for p in prompts)
  samples, generated, logprob_sum = [], 0, 0.0
  for start in range(0, len(prompts), batch):
    chunk = prompts[start:start + batch]
    rows = chunk + [chunk[0]] * (batch - len(chunk))  # static shapes: pad with copies, drop them
    tokens_BxP = np.full((batch, width), tokenizer.pad_id, np.int32)
    for i, p in enumerate(rows):
      tokens_BxP[i, :len(p.tokens)] = p.tokens
    out = sampler(tokens_BxP, np.asarray([len(p.tokens) for p in rows], np.int32),
                  max_new_tokens=int(sc.max_new_tokens), temperature=float(sc.temperature),
                  top_k=int(sc.top_k) or None, top_p=float(sc.top_p) if sc.top_p < 1 else None,
                  eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                  seed=jax.random.fold_in(jax.random.key(seed), start),
                  vocab_limit=tokenizer.vocab_size)
    new_BxT, lengths_B, logprobs_BxT = jax.device_get(
        (out.tokens_BxT, out.lengths_B, out.logprobs_BxT))
    for i, prompt in enumerate(chunk):
      continuation = new_BxT[i, :lengths_B[i]].tolist()
      samples.append(sample_record(prompt, continuation, tokenizer, bool(sc.include_prompt)))
      generated += int(lengths_B[i])
      logprob_sum += float(np.sum(logprobs_BxT[i, :lengths_B[i]]))
    if on_batch is not None:
      on_batch(len(chunk), int(np.sum(lengths_B[:len(chunk)])))
    interrupts.check()
  stats = {"samples": len(samples), "generated_tokens": generated,
           "teacher_nll_per_token": -logprob_sum / max(generated, 1)}
  return samples, stats


def write_jsonl(path: str, samples: list[dict]) -> None:
  """One JSON line per sample record, written to a temporary name and renamed when done."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for sample in samples:
      f.write(json.dumps(sample, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


__all__ = ["Prompt", "answer_prompts", "generate_samples", "sample_record", "stop_ids",
           "take_prompt_records", "take_prompts", "write_jsonl"]
