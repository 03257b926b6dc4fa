"""`distillax eval --generate`: BLEU, chrF and ROUGE-L of a model's greedy completions.

  distillax eval --model runs/kd --generate held_out.jsonl --max_new_tokens 64
  distillax eval --model out/student-q4_0.gguf --generate held_out.jsonl --max_new_tokens 64

Each line of the file is a prompt/completion record ({"prompt": ..., "completion": ...}, the
layout training reads). The model (a run in the form it trained, or a Hugging Face directory)
continues every prompt greedily through the lm-eval adapter's batched sampler (up to
--max_new_tokens tokens, stopping at EOS); a .gguf file is decoded by llama.cpp itself
(edge/completions.py: its own tokenizer, greedy, to its EOS). The completions are scored
against the records' completions by framework/text_metrics.py (corpus BLEU and chrF, mean
ROUGE-L F). Prints one JSON object: bleu, chrf, rouge_l and the number of records.
"""

from __future__ import annotations

import json
import sys

import jax

from distillax.data.prompt_pairs import read_prompt_pairs
from distillax.edge import completions as gguf_completions
from distillax.errors import UserError
from distillax.framework.text_metrics import generation_scores


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
  prompts, references = read_prompt_pairs(data)
  if gguf_completions.is_gguf(model_dir):  # the deployed file, decoded by llama.cpp itself
    if jax.process_index() == 0:
      print(f"distillax eval: {model_dir} decoded by {gguf_completions.describe()}",
            file=sys.stderr, flush=True)
    completions = gguf_completions.greedy_texts(model_dir, prompts, max_new_tokens)
  else:
    try:
      from distillax.eval.harness import DistillaxLM
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
