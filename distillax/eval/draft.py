"""`distillax eval --draft DIR`: how many tokens a draft lets one target forward produce.

  distillax eval --draft runs/draft                  # an EAGLE-3 head run: its own target
  distillax eval --draft runs/kd --model runs/teacher  # a whole small model as the draft

The draft's held-out prompts (the eval documents' first `PROMPT_LEN` tokens, or their whole
chat/prompt record) are continued by speculative decoding (models/speculative.py) with the
draft proposing 1, 2, ..., k tokens a round (k: --proposals, default the head's
draft.ttt_steps, 4 for a whole model); one program measures all of them (a row limited to j
proposals is exactly a decode with k = j). Printed per j: the mean acceptance length (tokens
emitted per target forward of a round, accepted draft tokens plus the target's own), the target
forwards the whole generation took (prefill included) against the one forward per token of plain
decoding, and the share saved. Greedy by default (the output is then the target's own greedy
text); --temperature samples by the rejection rule. Nothing is written.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from distillax.errors import UserError

PROMPT_LEN = 32  # prompt tokens per held-out text document


@dataclasses.dataclass(frozen=True)
class AcceptanceRow:
  """One proposal count's figures over all prompts."""

  proposals: int
  acceptance_length: float  # tokens per target forward of a round (1 = nothing accepted)
  target_forwards: int  # with the draft: prefills + rounds
  plain_forwards: int  # without: one per generated token
  tokens: int

  @property
  def saved(self) -> float:
    return 1.0 - self.target_forwards / max(self.plain_forwards, 1)

  def line(self) -> str:
    return (f"  {self.proposals:>2} proposed | acceptance length {self.acceptance_length:.3f} "
            f"tokens/forward | target forwards {self.target_forwards} vs {self.plain_forwards} "
            f"plain ({100 * self.saved:.1f}% saved)")


def acceptance_table(target, draft, prompts: list[list[int]], *, proposals: int,
                     max_new_tokens: int, temperature: float = 0.0, vocab_limit=None,
                     eos_id=None, seed: int = 0) -> list[AcceptanceRow]:
  """Speculative decoding of every prompt at 1..`proposals` proposed tokens (one program)."""
  from distillax.models.sampler import SamplingConfig
  from distillax.models.speculative import speculative_decode
  P = max(len(p) for p in prompts)
  need = P + max_new_tokens + proposals + 1
  if need > target.config.max_seq_len:
    raise UserError(f"prompts of {P} tokens + --max_new_tokens {max_new_tokens} + "
                    f"--proposals {proposals} + 1 exceed the target's max_seq_len "
                    f"{target.config.max_seq_len}; lower --max_new_tokens to "
                    f"{max(target.config.max_seq_len - P - proposals - 1, 1)}")
  rows = np.zeros((len(prompts), P), np.int32)
  for i, p in enumerate(prompts):
    rows[i, :len(p)] = p
  lengths = np.array([len(p) for p in prompts], np.int32)
  js = np.repeat(np.arange(1, proposals + 1, dtype=np.int32), len(prompts))
  rows, lengths = np.tile(rows, (proposals, 1)), np.tile(lengths, proposals)
  cfg = SamplingConfig(max_new_tokens, float(temperature), vocab_limit=vocab_limit, eos_id=eos_id)
  keys = jax.random.split(jax.random.key(seed), len(rows))
  run = jax.jit(lambda r, n, k, j: speculative_decode(target, draft, r, n, k, cfg, proposals, j))
  out = jax.device_get(run(jnp.asarray(rows), jnp.asarray(lengths), keys, jnp.asarray(js)))
  table = []
  for j in range(1, proposals + 1):
    sel = js == j
    rounds, accepted = out.rounds_B[sel].sum(), out.accepted_B[sel].sum()
    tokens = int(out.lengths_B[sel].sum())
    table.append(AcceptanceRow(j, float((accepted + rounds) / max(rounds, 1)),
                               int(rounds + sel.sum()), tokens, tokens))
  return table


def held_out_prompts(config, tokenizer, count: int, prompt_len: int = PROMPT_LEN
                     ) -> list[list[int]]:
  """`count` held-out prompts of the config's data (seeded order), as token ids."""
  from distillax.distill.sequence_kd import NoPromptFits, take_prompt_records
  try:
    records = take_prompt_records(config.data, tokenizer, count=count, prompt_len=prompt_len,
                                  seed=int(config.seed), split="eval", field="prompt_len")
  except NoPromptFits as e:
    raise UserError(f"eval --draft: no held-out prompt of at most {prompt_len} tokens ({e})") \
        from None
  return [list(r.tokens) for r in records]


def _is_head_run(path: str) -> bool:
  from distillax.trainers import is_hf_checkpoint, load_run_config
  return not is_hf_checkpoint(path) and str(load_run_config(path, "--draft").get("trainer")) == \
      "draft"


def run_eval_draft(config, draft_dir: str, model_dir: str | None, *, proposals: int | None,
                   max_new_tokens: int, temperature: float = 0.0, prompts: int = 16) -> int:
  """Prints the acceptance table of `draft_dir` (a head run, or a whole model against the
  target --model)."""
  from distillax.models.speculative import HeadDraft, ModelDraft
  if not os.path.isdir(draft_dir):
    raise UserError(f"--draft {draft_dir} is not a directory: give a draft run's --workdir (an "
                    f"EAGLE-3 head, distillax/configs/draft_eagle3.py) or a model directory")
  if proposals is not None and proposals < 1:
    raise UserError(f"--proposals={proposals} must be >= 1 (tokens the draft proposes a round)")
  if temperature < 0:
    raise UserError(f"--temperature={temperature} must be >= 0 (0 = greedy)")
  if _is_head_run(draft_dir):
    if model_dir:
      raise UserError(f"--draft {draft_dir} is an EAGLE-3 head run, which reads its own "
                      f"target (its teacher section); drop --model {model_dir}")
    from distillax.trainers.draft import load_draft_run
    head, target, recipe = load_draft_run(draft_dir, "--draft")
    draft, tokenizer, run_config = HeadDraft(head), recipe.tokenizer, recipe.config
    k = proposals or int(recipe.settings.ttt_steps)
    what = f"EAGLE-3 head {draft_dir} ({len(head.config.aux_layers)} target layers " \
           f"{head.config.aux_layers}, draft vocabulary {head.config.draft_vocab_size})"
  else:
    if not model_dir:
      raise UserError(f"--draft {draft_dir} is a whole model: name the target it drafts for "
                      f"with --model (a run or Hugging Face directory)")
    from distillax.generate import load_model_dir
    loaded_target = load_model_dir(model_dir, config)
    loaded_draft = load_model_dir(draft_dir, config)
    loaded_target.command = loaded_draft.command = "eval"
    target, draft = loaded_target.model, ModelDraft(loaded_draft.model)
    tokenizer = loaded_target.tokenizer
    from distillax.trainers import is_hf_checkpoint, load_run_config
    run_config = config if config is not None else (
        None if is_hf_checkpoint(model_dir) else load_run_config(model_dir, "--model"))
    if run_config is None:
      raise UserError(f"--model {model_dir} is a Hugging Face directory: pass a --config whose "
                      f"data section holds the held-out prompts")
    k = proposals or 4
    what = f"whole model {draft_dir}"
  held_out = held_out_prompts(run_config, tokenizer, prompts)
  room = target.config.max_seq_len - max(len(p) for p in held_out) - k - 1
  cut = "" if max_new_tokens <= room else f" (cut from {max_new_tokens} to fit max_seq_len)"
  max_new_tokens = min(max_new_tokens, room)
  table = acceptance_table(target, draft, held_out, proposals=k, max_new_tokens=max_new_tokens,
                           temperature=temperature, vocab_limit=int(tokenizer.vocab_size))
  mode = "greedy" if temperature == 0 else f"temperature {temperature}"
  print(f"distillax eval --draft: {what}; {len(held_out)} held-out prompts x {max_new_tokens} "
        f"tokens{cut}, {mode}")
  for row in table:
    print(row.line())
  return 0
