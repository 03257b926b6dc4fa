"""The demo's task columns: what each model writes and answers, next to its losses.

Two figures per row (teacher, students, quantized students), each through the route a user
runs on a model:

- BLEU and chrF of greedy completions of held-out code (`distillax eval --generate`'s
  machinery: eval.generate.greedy_completions over the lm-eval adapter, scored by
  framework/text_metrics.py). The prompts are cut from validation documents at a line break
  (seeded), and the reference is what the document says next, as many tokens as the model
  writes: whoever continues the code as it was written scores higher.
- One local lm-eval task (`distillax eval --tasks`'s run_tasks: lm-eval's own simple_evaluate
  over the adapter), by default distillax_code_mc, whose data ships with distillax.

A quantized row is scored in its fake quantization made real (the weights its GGUF file holds,
q8_0 activations): the model llama.cpp runs.
"""

from __future__ import annotations

import numpy as np

from distillax.eval.generate import greedy_completions
from distillax.eval.harness import DistillaxLM
from distillax.eval.lm_tasks import run_tasks
from distillax.framework.text_metrics import bleu_chrf
from distillax.generate import LoadedModel


def heldout_pairs(c, tokenizer) -> tuple[list[str], list[str]]:
  """(prompts, references) from validation documents in a seeded order: the prompt is up to
  `text_eval.prompt_chars` characters ending at a line break chosen at random (after at least
  half that many characters), the reference the document's next `text_eval.new_tokens` tokens."""
  from distillax.data import resolve_data_config, split_documents
  t = c.text_eval
  documents = split_documents(resolve_data_config(c.data), "eval")
  rng = np.random.default_rng(int(c.seed))
  prompts, references = [], []
  for index in rng.permutation(len(documents)):
    text = documents[int(index)]
    if not isinstance(text, str):
      continue  # text documents only (the demo's corpus is text)
    breaks = [i + 1 for i, ch in enumerate(text[:-1]) if ch == "\n"
              and i + 1 >= int(t.prompt_chars) // 2 and text[i + 1:].strip()]
    if not breaks:
      continue
    cut = breaks[int(rng.integers(len(breaks)))]
    reference = tokenizer.decode(tokenizer.encode(text[cut:cut + 32 * int(t.new_tokens)])
                                 [:int(t.new_tokens)])
    prompts.append(text[max(cut - int(t.prompt_chars), 0):cut])
    references.append(reference)
    if len(prompts) == int(t.prompts):
      break
  return prompts, references


def loaded_model(model, tokenizer, add_bos: bool, mesh, rules, name: str) -> LoadedModel:
  """A model in memory as `distillax eval` holds one it loaded (placed on the demo's mesh)."""
  stops = (tokenizer.eos_id,) if tokenizer.eos_id is not None else ()
  loaded = LoadedModel(name, None, tokenizer, None, stops, add_bos)
  loaded.model, loaded.placement = model, (mesh, rules)  # what the cached properties would load
  loaded.command = "demo"
  return loaded


def row_scores(loaded: LoadedModel, prompts, references, c) -> dict:
  """{bleu, chrf, <task>_<metric>...} of one model."""
  t = c.text_eval
  completions = greedy_completions(DistillaxLM(loaded), prompts, int(t.new_tokens))
  out = dict(bleu_chrf(completions, references))
  metrics = run_tasks(loaded, str(t.task), limit=int(t.task_limit) or None)
  for task, values in metrics.items():
    out.update({f"{task}_{k}": float(v) for k, v in values.items()})
  return out


def measure(models: dict, tokenizer, add_bos: bool, mesh, rules, c) -> dict:
  """Each row's scores ({row: model}, the quantized ones in their quantization made real)."""
  prompts, references = heldout_pairs(c, tokenizer)
  return {row: row_scores(loaded_model(m, tokenizer, add_bos, mesh, rules, row), prompts,
                          references, c) for row, m in models.items()}


__all__ = ["heldout_pairs", "loaded_model", "measure", "row_scores"]
