"""The trainer's generation eval: held-out prompts completed greedily, then scored.

With `eval.generate` naming a prompt/completion JSONL, every eval of the run also decodes each
prompt greedily with the student as it trains (the training forward: QAT fake quant, LoRA
adapters on) through the KV-cached sampler, batched and jitted on the run's mesh, up to
`eval.max_new_tokens` tokens or EOS, and scores the completions against the file's completions
with framework/text_metrics.py: eval_bleu, eval_chrf and eval_rouge_l land in metrics.jsonl and
TensorBoard next to eval_loss, where `train.rollback_metric` can watch them. The decode is
models/completions.py's, the one `distillax eval --generate` uses, so a checkpoint's logged
figures are the ones that command prints for it.
"""

from __future__ import annotations

from flax import nnx

from distillax.data.prompt_pairs import read_prompt_pairs
from distillax.errors import ConfigError
from distillax.framework.text_metrics import generation_scores
from distillax.models.completions import greedy_completions
from distillax.models.sampler import Sampler

# The figures it adds (evaluate prefixes "eval_" to the names it returns).
GENERATION_FIGURES = ("eval_bleu", "eval_chrf", "eval_rouge_l")
# Prompts per sampler call, rounded up to a multiple of the data-parallel size: the batch of
# `distillax eval --generate` (eval.harness.DistillaxLM), so both decode the same rows together.
BATCH_ROWS = 8


def _check_extra(path: str) -> None:
  try:
    import rouge_score  # noqa: F401
    import sacrebleu  # noqa: F401
  except ImportError:
    raise ConfigError(f"eval.generate={path} scores completions with sacreBLEU and rouge-score: "
                      f"pip install 'distillax[eval]', or set --config.eval.generate=''") from None


class GenerationEval:
  """(engine, state) -> {bleu, chrf, rouge_l} of the student's greedy completions."""

  def __init__(self, eval_cfg, tokenizer, *, add_bos: bool, student_path: tuple[str, ...]):
    path = str(eval_cfg.generate)
    self.max_new_tokens = int(eval_cfg.max_new_tokens)
    if self.max_new_tokens < 1:
      raise ConfigError(f"eval.max_new_tokens={self.max_new_tokens} must be at least 1")
    _check_extra(path)
    prompts, self.references = read_prompt_pairs(path, "eval.generate")
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    self.prompts = [bos + list(tokenizer.encode(p)) for p in prompts]
    self.tokenizer, self.student_path = tokenizer, student_path
    self.stop_ids = (tokenizer.eos_id,) if tokenizer.eos_id is not None else ()
    self._samplers: dict[int, tuple] = {}  # id(engine) -> (engine, Sampler): compiled once

  @classmethod
  def from_config(cls, config, tokenizer, student_path) -> "GenerationEval | None":
    section = config.get("eval")
    if section is None or not section.get("generate"):
      return None
    return cls(section, tokenizer, add_bos=bool(config.data.get("add_bos", True)),
               student_path=student_path)

  def _sampler(self, engine, model) -> Sampler:
    """The engine's sampler holding `model`'s current weights (its compiled decode is kept)."""
    held = self._samplers.get(id(engine))
    if held is None or held[0] is not engine:
      held = (engine, Sampler(model, mesh=engine.mesh, rules=engine.rules))
      self._samplers[id(engine)] = held
    else:
      held[1].state = nnx.split(model)[1]
    return held[1]

  def __call__(self, engine, state) -> dict[str, float]:
    return generation_scores(self.completions(engine, state), self.references)

  def completions(self, engine, state) -> list[str]:
    """The student's greedy completion of each held-out prompt, as text."""
    gstate = engine.global_state(state)
    model, _ = engine.layout.defs.merge(gstate.params, gstate.frozen)
    for name in self.student_path:  # the plain student inside a distillation wrapper
      model = getattr(model, name)
    data = int(engine.mesh.shape.get("data", 1))
    rows = -(-BATCH_ROWS // data) * data
    ids = greedy_completions(self._sampler(engine, model), self.prompts, batch_size=rows,
                             max_new_tokens=self.max_new_tokens,
                             pad_id=int(self.tokenizer.pad_id), stop_ids=self.stop_ids,
                             vocab_limit=self.tokenizer.vocab_size)
    return [self.tokenizer.decode(i) for i in ids]
