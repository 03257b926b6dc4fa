"""`distillax eval --generate`: BLEU, chrF and ROUGE-L of a model's greedy completions.

  distillax eval --model runs/kd --generate held_out.jsonl --max_new_tokens 64

Each line of the file is a prompt/completion record ({"prompt": ..., "completion": ...}, the
layout training reads). The model (a run in the form it trained, or a Hugging Face directory)
continues every prompt greedily through the lm-eval adapter's batched sampler (up to
--max_new_tokens tokens, stopping at EOS), and the completions are scored against the records'
completions by framework/text_metrics.py (corpus BLEU and chrF, mean ROUGE-L F). Prints one JSON
object: bleu, chrf, rouge_l and the number of records.
"""

from __future__ import annotations

import json
import os

import jax

from distillax.errors import UserError
from distillax.framework.text_metrics import generation_scores


def read_pairs(path: str) -> tuple[list[str], list[str]]:
  """(prompts, reference completions) of a prompt/completion JSONL file."""
  if not path or not os.path.isfile(path):
    raise UserError(f"--generate={path}: no such file; give a JSONL of {{\"prompt\", "
                    f"\"completion\"}} records")
  prompts, references = [], []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError as e:
        raise UserError(f"--generate: {path} line {number} is not JSON ({e})") from None
      if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
              and isinstance(record.get("completion"), str)):
        raise UserError(f"--generate: {path} line {number} needs string \"prompt\" and "
                        f"\"completion\" fields")
      prompts.append(record["prompt"])
      references.append(record["completion"])
  if not prompts:
    raise UserError(f"--generate: {path} holds no records")
  return prompts, references


def greedy_completions(lm, prompts: list[str], max_new_tokens: int) -> list[str]:
  """Each prompt's greedy continuation (up to max_new_tokens, to EOS) by a DistillaxLM."""
  from lm_eval.api.instance import Instance
  settings = {"until": [], "do_sample": False, "max_gen_toks": int(max_new_tokens)}
  return lm.generate_until([Instance("generate_until", {}, (p, dict(settings)), i)
                            for i, p in enumerate(prompts)])


def run_eval_generate(config, model_dir: str | None, data: str, *, max_new_tokens: int) -> int:
  """Prints the scores as one JSON object; 0."""
  from distillax.generate import load_model_dir
  if max_new_tokens is None or max_new_tokens < 1:
    raise UserError(f"--max_new_tokens={max_new_tokens} must be at least 1")
  prompts, references = read_pairs(data)
  try:
    from distillax.eval_harness import DistillaxLM
  except ImportError:
    raise UserError("--generate needs the eval extra (lm-eval, sacrebleu, rouge-score): "
                    "pip install 'distillax[eval]'") from None
  loaded = load_model_dir(model_dir, config)
  loaded.command = "eval"
  completions = greedy_completions(DistillaxLM(loaded), prompts, max_new_tokens)
  scores = dict(generation_scores(completions, references), records=len(prompts))
  if jax.process_index() == 0:
    print(json.dumps(scores, sort_keys=True, allow_nan=False), flush=True)
  return 0
