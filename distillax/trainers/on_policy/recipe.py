"""On-policy distillation as a recipe: the distill recipe whose train objective samples.

The `on_policy` section (configs/on_policy.py) names the divergence and how the student samples;
the prompts come from the train documents the way sequence KD takes them (chat turns before the
last answer with the chat template's generation prompt, a prompt/completion record's prompt, or
a text's first `prompt_len` tokens). Each step's batch is the distill recipe's packed batch (the
lmbda < 1 share trains the `distill` loss on it) plus the step's prompts; the objective
(distill/on_policy/objective.py) samples and scores inside the compiled step. Eval reports the `distill`
loss on the validation data (eval_objective; eval_loss is its next-token CE) and the on-policy
figures on held-out prompts (distill/on_policy/eval.py), whose reverse KL the rollback guard
watches, and writes a few completions to <workdir>/on_policy_samples/.
"""

from __future__ import annotations

import jax
from absl import logging

from distillax import quant
from distillax.distill import TEACHER, make_distill_objective
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TOKENS, ROW_IDS,
                                         OnPolicySettings, make_on_policy_objective)
from distillax.distill.on_policy.eval import OnPolicyEvaluator
from distillax.distill.on_policy.losses import on_policy_strategy
from distillax.distill.sequence_kd import stop_ids, take_prompt_records
from distillax.errors import ConfigError, UserError
from distillax.framework import flops
from distillax.framework.engine import with_extra_eval
from distillax.framework.step import Objective
from distillax.trainers.distill.recipe import DistillRecipe
from distillax.trainers.on_policy.parts import OnPolicyIterator, SamplingClock, write_samples
from distillax.trainers.registry import register


def settings_from_config(c, tokenizer) -> OnPolicySettings:
  """The sampling settings of the `on_policy` section (stops: EOS and every special token,
  e.g. the end of a chat turn; ids past the tokenizer's, a padded vocabulary's rows, never
  sampled)."""
  for name in ("prompt_len", "max_new_tokens", "num_samples", "num_prompts", "eval_prompts"):
    if int(c[name]) < 1:
      raise ConfigError(f"on_policy.{name}={c[name]} must be >= 1")
  on_policy_strategy(str(c.divergence), beta=float(c.beta), temperature=float(c.temperature))
  stops = tuple(sorted(i for i in stop_ids(tokenizer) if i != tokenizer.eos_id))
  return OnPolicySettings(
      max_new_tokens=int(c.max_new_tokens), num_samples=int(c.num_samples),
      temperature=float(c.sampling_temperature), top_k=int(c.top_k) or None,
      top_p=float(c.top_p) if float(c.top_p) < 1 else None, eos_id=tokenizer.eos_id,
      stop_ids=stops, pad_id=int(tokenizer.pad_id), lmbda=float(c.lmbda),
      vocab_limit=int(tokenizer.vocab_size))


def sample_width(prompt_len: int, settings: OnPolicySettings, model_config) -> int:
  """Prompt plus completion tokens of one sample, refused in one line past the student's
  max_seq_len."""
  width = prompt_len + settings.max_new_tokens
  if width > model_config.max_seq_len:
    raise ConfigError(f"on_policy.prompt_len={prompt_len} + on_policy.max_new_tokens="
                      f"{settings.max_new_tokens} exceeds model.max_seq_len="
                      f"{model_config.max_seq_len}; shorten one of them")
  return width


@register("on_policy")
class OnPolicyRecipe(DistillRecipe):
  """The student learns from its own samples, graded token by token by the teacher."""

  sliced_loss = False  # its objective is not make_distill_objective's one LogitKD
  prompt_splits = ("train", "eval")  # checked with the data: a prompt_len no prompt fits
  router_losses = True  # an MoE student's, from its forward over its own samples

  # The guard watches what on-policy training lowers, the reverse KL on the student's own
  # samples of held-out prompts: its teacher-forced CE on the data may rise as it improves.
  rollback_metrics = ("eval_on_policy_reverse_kl", "eval_on_policy_teacher_nll",
                      "eval_objective", "eval_loss", "eval_perplexity")

  def __init__(self, config, **kwargs):
    super().__init__(config, **kwargs)
    c = config.on_policy
    self.settings = settings_from_config(c, self.tokenizer)
    self.prompt_len = int(c.prompt_len)
    sample_width(self.prompt_len, self.settings, self.model_config)
    if self.teacher_model_config is None:
      raise ConfigError("on_policy needs a teacher model (teacher.workdir, teacher.hf_path or "
                        "teacher.preset), not an offline cache: the teacher scores the "
                        "student's own samples")

  def objective(self, *, train: bool = False) -> Objective:
    """Train: sampling + scoring (with lmbda mixing); eval: the distill loss on the data."""
    if not train:
      return super().objective(train=False)
    c = self.config.on_policy
    weights = self.router_loss_weights(train=True)
    off = make_distill_objective(self.strategy(), chunk_size=self.chunk_size(), metrics=False,
                                 router_loss_weights=weights, teachers=self.mix)
    leaf = on_policy_strategy(str(c.divergence), beta=float(c.beta),
                              temperature=float(c.temperature))
    # Adapter dropout is for the learner's forward, not for sampling.
    context = (lambda: quant.lora_dropout(None)) if self.transforms.lora is not None else None
    on = make_on_policy_objective(leaf, self.settings, off_policy=off,
                                  chunk_size=self.chunk_size(), sampling_context=context,
                                  router_loss_weights=weights, teachers=self.mix)
    return self.transforms.train_objective(on)  # the wrapper keeps on's rng_per_worker

  def batch_shapes(self):
    shapes = dict(super().batch_shapes())
    B = self.batch_size
    shapes[PROMPT_TOKENS] = jax.ShapeDtypeStruct((B, self.prompt_len), jax.numpy.int32)
    shapes[PROMPT_LENGTHS] = jax.ShapeDtypeStruct((B,), jax.numpy.int32)
    shapes[ROW_IDS] = jax.ShapeDtypeStruct((B,), jax.numpy.int32)
    return shapes

  def prompts(self, split: str = "train") -> list:
    """Prompt token ids from the train (or held-out: 'eval') documents, in a seeded order; read
    once per split (the data check reads both before anything compiles: prompt_splits)."""
    cache = self.__dict__.setdefault("_prompts", {})
    if split not in cache:
      c = self.config.on_policy
      try:
        records = take_prompt_records(
            self.config.data, self.tokenizer, count=int(c.num_prompts if split == "train"
                                                        else c.eval_prompts),
            prompt_len=self.prompt_len, seed=int(self.config.seed), split=split,
            field="on_policy.prompt_len")
      except UserError as e:
        raise UserError(f"on_policy: {e}") from None
      cache[split] = [r.tokens for r in records]
    return cache[split]

  def eval_teacher(self, extras):
    """The teacher model the held-out prompts are graded by."""
    return extras[TEACHER]

  def prompt_teachers(self, split: str):
    """Routing: the teacher index of each of `prompts(split)`; None: one teacher grades all."""
    del split

  def train_iterator(self):
    return OnPolicyIterator(super().train_iterator(), self.prompts("train"),
                            global_batch=self.batch_size, width=self.prompt_len,
                            pad_id=self.tokenizer.pad_id, process_index=jax.process_index(),
                            process_count=jax.process_count())

  def build_engines(self, learning_rate: float | None = None, *, compile_now: bool = True):
    engines = super().build_engines(learning_rate, compile_now=compile_now)
    return engines.wrap(self._on_policy_engine)

  def _on_policy_engine(self, engine):
    if bool(self.config.on_policy.time_sampling) and self.settings.lmbda > 0:
      engine.runner = SamplingClock(engine, self.settings,
                                    int(self.config.train.log_every)).runner()
    # The one evaluation route adds the on-policy figures (and writes the samples).
    return with_extra_eval(engine, self._eval_fn())

  def _eval_fn(self):
    """(engine, state) -> the on-policy figure on held-out prompts; writes the samples."""
    evaluator = OnPolicyEvaluator(self.settings, mesh=self.mesh, rules=self.rules,
                                  chunk_size=self.chunk_size(), teachers=self.mix)
    prompts, c = None, self.config.on_policy

    def run(engine, state):
      nonlocal prompts
      prompts = self.prompts("eval") if prompts is None else prompts
      gstate = engine.global_state(state)
      student, extras = engine.layout.defs.merge(gstate.params, gstate.frozen)
      result = evaluator(student, self.eval_teacher(extras), prompts, seed=int(c.eval_seed),
                         prompt_teachers=self.prompt_teachers("eval"))
      if self.workdir and jax.process_index() == 0 and int(c.samples_to_write) > 0:
        records = [{"prompt": self.tokenizer.decode(p), "completion": self.tokenizer.decode(s),
                    "prompt_ids": p, "completion_ids": s}
                   for p, s in result.samples[:int(c.samples_to_write)]]
        path = write_samples(self.workdir, int(jax.device_get(gstate.step)), records)
        logging.info("on_policy: %d eval completions in %s", len(records), path)
      return result.figures
    return run

  def step_flops(self) -> float:
    return on_policy_step_flops(self.model_config, self.teacher_model_config,
                                self.batch_size * self.settings.num_samples, self.prompt_len,
                                self.settings.max_new_tokens)


def on_policy_step_flops(model_config, teacher_config, rows: int, prompt_len: int,
                         max_new_tokens: int) -> float:
  """Model FLOPs of one on-policy step over `rows` samples: the student's decode (about one
  forward over prompt + completion), the student's scoring forward and backward, and the
  teacher's forward."""
  length = prompt_len + max_new_tokens - 1
  step = flops.train_step_flops(model_config, rows, length, teacher_cfg=teacher_config)["total"]
  return step + flops.forward_flops(model_config, rows, length)


__all__ = ["OnPolicyRecipe", "on_policy_step_flops", "settings_from_config"]
