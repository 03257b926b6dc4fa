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

import contextlib
import dataclasses

import jax
from absl import logging

from distillax import quant
from distillax.distill import TEACHER, make_distill_objective
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TOKENS, ROW_IDS,
                                                   OnPolicySettings, make_on_policy_objective,
                                                   make_prepare)
from distillax.distill.on_policy.eval import OnPolicyEvaluator
from distillax.distill.on_policy.losses import on_policy_strategy
from distillax.distill.sequence_kd import NoPromptFits, stop_ids, take_prompt_records
from distillax.errors import ConfigError, UserError
from distillax.framework import backends, flops
from distillax.framework.engine import with_extra_eval
from distillax.framework.step import Objective
from distillax.models.attention.layer import kv_cache_bytes_per_token
from distillax.trainers.distill.recipe import DistillRecipe
from distillax.trainers.on_policy.parts import OnPolicyIterator, SamplingClock, write_samples
from distillax.trainers.on_policy.sampler_devices import (SamplerRunner, rollout_shapes,
                                                          split_devices)
from distillax.trainers.registry import register


def settings_from_config(c, tokenizer) -> OnPolicySettings:
  """The sampling settings of the `on_policy` section (stops: EOS and every special token,
  e.g. the end of a chat turn; ids past the tokenizer's, a padded vocabulary's rows, never
  sampled)."""
  for name in ("prompt_len", "max_new_tokens", "num_samples", "num_prompts", "eval_prompts"):
    if int(c[name]) < 1:
      raise ConfigError(f"on_policy.{name}={c[name]} must be >= 1")
  on_policy_strategy(str(c.divergence), beta=float(c.beta), temperature=float(c.temperature))
  if str(c.kv_cache_dtype) not in ("", "int8"):
    raise ConfigError(f"on_policy.kv_cache_dtype={c.kv_cache_dtype!r}: use '' (the compute "
                      f"dtype) or 'int8'")
  stops = tuple(sorted(i for i in stop_ids(tokenizer) if i != tokenizer.eos_id))
  return OnPolicySettings(
      max_new_tokens=int(c.max_new_tokens), num_samples=int(c.num_samples),
      temperature=float(c.sampling_temperature), top_k=int(c.top_k) or None,
      top_p=float(c.top_p) if float(c.top_p) < 1 else None, eos_id=tokenizer.eos_id,
      stop_ids=stops, pad_id=int(tokenizer.pad_id), lmbda=float(c.lmbda),
      vocab_limit=int(tokenizer.vocab_size), cache_dtype=str(c.kv_cache_dtype) or None)


def prompt_records(recipe, split: str):
  """The on-policy prompts of `split` (train: num_prompts, eval: eval_prompts) of `recipe`."""
  c = recipe.config.on_policy
  return take_prompt_records(
      recipe.config.data, recipe.tokenizer,
      count=int(c.num_prompts if split == "train" else c.eval_prompts),
      prompt_len=recipe.prompt_len, seed=int(recipe.config.seed), split=split,
      field="on_policy.prompt_len")


def prompt_fix(recipe, error: NoPromptFits) -> str:
  """`error`'s line with a prompt_len that works when followed: long enough for every prompt
  split of `recipe` (train and eval), and a max_new_tokens that still fits model.max_seq_len."""
  need = error.shortest
  for other in recipe.prompt_splits:
    if need is None or other == error.split:
      continue
    try:
      prompt_records(recipe, other)
    except NoPromptFits as e:
      need = max(need, e.shortest or need)
  if need is None:
    return str(error)
  room = int(recipe.model_config.max_seq_len) - need
  also = ""
  if recipe.settings.max_new_tokens > room > 0:
    also = f" --config.on_policy.max_new_tokens={room}"
  elif room <= 0:
    also = f" (past model.max_seq_len={recipe.model_config.max_seq_len}: shorten the prompts)"
  return error.line(need, also)


def micro_batches(sampling_batch: int, num_samples: int, micro_batch: int,
                  accum_steps: int) -> int:
  """Update micro-batches per step: sampling_batch / micro_batch completions (on_policy.
  micro_batch), or train.accum_steps when micro_batch is 0; each wrong pair refused in one
  line."""
  if micro_batch == 0:
    return accum_steps
  divisors = [m for m in range(num_samples, sampling_batch + 1, num_samples)
              if sampling_batch % m == 0]
  if micro_batch < 0 or micro_batch % num_samples or sampling_batch % micro_batch:
    raise ConfigError(f"on_policy.micro_batch={micro_batch} must be a multiple of "
                      f"on_policy.num_samples={num_samples} that divides the sampling batch "
                      f"(train.batch_size x num_samples = {sampling_batch} completions), e.g. "
                      f"{', '.join(map(str, divisors[-3:]))}; or 0 to leave train.accum_steps "
                      f"in charge")
  accum = sampling_batch // micro_batch
  if accum_steps not in (1, accum):
    raise ConfigError(f"on_policy.micro_batch={micro_batch} makes {accum} micro-batches per step "
                      f"but train.accum_steps={accum_steps}; set only one of them")
  return accum


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

  # train.loss_impl='sliced' scores its samples (either divergence, one teacher:
  # distill/on_policy/sliced.py); its off-policy share and eval objective take the slices where
  # its strategy's LogitKDs are the slices' (DistillRecipe.sliced_strategy).
  sliced_loss = True
  prompt_splits = ("train", "eval")  # checked with the data: a prompt_len no prompt fits
  router_losses = True  # an MoE student's, from its forward over its own samples

  # The guard watches what on-policy training lowers, the reverse KL on the student's own
  # samples of held-out prompts: its teacher-forced CE on the data may rise as it improves.
  rollback_metrics = ("eval_on_policy_reverse_kl", "eval_on_policy_teacher_nll",
                      "eval_objective", "eval_loss", "eval_perplexity")

  def __init__(self, config, *, mesh=None, **kwargs):
    # on_policy.sampler_devices > 0: the trainer's mesh leaves those devices to the sampler.
    self.sampler_devices = split_devices(config, mesh)
    if self.sampler_devices is not None:
      mesh = self.sampler_devices.trainer_mesh
      logging.info("on_policy: %s", self.sampler_devices.describe())
    super().__init__(config, mesh=mesh, **kwargs)
    c = config.on_policy
    self.settings = settings_from_config(c, self.tokenizer)
    self.prompt_len = int(c.prompt_len)
    sample_width(self.prompt_len, self.settings, self.model_config)
    self.sampling_batch = self.batch_size * self.settings.num_samples
    self.accum_steps = micro_batches(self.sampling_batch, self.settings.num_samples,
                                     int(c.get("micro_batch", 0)), int(config.train.accum_steps))
    # A plain student samples from its matmul weights cast to bf16 once, before the decode loop.
    plain = self.transforms.qat is None and self.transforms.lora is None
    self.settings = dataclasses.replace(self.settings, cast_weights=plain)
    # The samples a step scores: prompt + completion, less the last token's position.
    self.loss_shape = (self.sampling_batch, self.prompt_len + self.settings.max_new_tokens - 1)
    if self.sampler_devices is not None:  # the sampler's devices run the step's decode
      width = self.prompt_len + self.settings.max_new_tokens - 1
      self.step_flops_elsewhere = flops.forward_flops(self.model_config, self.sampling_batch,
                                                      width)
      # What the sampler runs each step, and the arrays it hands the step (their shapes).
      self.sampler_prepare = make_prepare(self.settings, sampling_context(self.transforms))
      self.rollout_shapes = rollout_shapes(self.build_student(abstract=True),
                                           self.prompt_shapes(), self.sampler_prepare)
    if self.teacher_model_config is None:
      raise ConfigError("on_policy needs a teacher model (teacher.workdir, teacher.hf_path or "
                        "teacher.preset), not an offline cache: the teacher scores the "
                        "student's own samples")

  def plan_lines(self, report: dict) -> list[str]:
    """The two batches and what the sampler holds per device while it runs."""
    if self.sampler_devices is not None:
      return [sampler_devices_plan_line(self.model_config, self.sampling_batch, self.accum_steps,
                                        self.prompt_len, self.settings, report,
                                        self.sampler_devices.sampler_mesh.devices.size)]
    data = int(self.mesh.shape.get(backends.DATA_AXIS, 1)) if self.mesh is not None else 1
    return [sampling_plan_line(self.model_config, self.sampling_batch, self.accum_steps,
                               self.prompt_len, self.settings, report, data)]

  def objective(self, *, train: bool = False) -> Objective:
    """Train: sampling + scoring (with lmbda mixing); eval: the distill loss on the data."""
    if not train:
      return super().objective(train=False)
    c = self.config.on_policy
    weights = self.router_loss_weights(train=True)
    sliced = self.loss_impl == "sliced"
    off = make_distill_objective(self.strategy(), chunk_size=self.chunk_size(), metrics=False,
                                 router_loss_weights=weights, teachers=self.mix,
                                 sliced=sliced and self.sliced_strategy())
    leaf = on_policy_strategy(str(c.divergence), beta=float(c.beta),
                              temperature=float(c.temperature))
    on = make_on_policy_objective(leaf, self.settings, off_policy=off,
                                  chunk_size=self.chunk_size(),
                                  sampling_context=sampling_context(self.transforms),
                                  router_loss_weights=weights, teachers=self.mix, sliced=sliced)
    on = self.transforms.train_objective(on)  # the wrapper keeps on's rng_per_worker
    if self.sampler_devices is not None:  # the sampler's devices run its prepare
      on = dataclasses.replace(on, prepare=None)
    return on

  def prompt_shapes(self) -> dict:
    """The step's prompts (a routed recipe adds each prompt's teacher)."""
    B, i32 = self.batch_size, jax.numpy.int32
    return {PROMPT_TOKENS: jax.ShapeDtypeStruct((B, self.prompt_len), i32),
            PROMPT_LENGTHS: jax.ShapeDtypeStruct((B,), i32),
            ROW_IDS: jax.ShapeDtypeStruct((B,), i32)}

  def batch_shapes(self):
    """The loop's batch; with sampler_devices > 0 also the arrays the sampler hands the step."""
    shapes = {**super().batch_shapes(), **self.prompt_shapes()}
    if self.sampler_devices is not None:
      shapes.update(self.rollout_shapes)
    return shapes

  def prompts(self, split: str = "train") -> list:
    """Prompt token ids from the train (or held-out: 'eval') documents, in a seeded order; read
    once per split (the data check reads both before anything compiles: prompt_splits)."""
    cache = self.__dict__.setdefault("_prompts", {})
    if split not in cache:
      c = self.config.on_policy
      try:
        cache[split] = [r.tokens for r in prompt_records(self, split)]
      except NoPromptFits as e:
        raise UserError(f"on_policy: {prompt_fix(self, e)}") from None
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
    timed, every = bool(self.config.on_policy.time_sampling), int(self.config.train.log_every)

    def on_policy_engine(engine):
      if self.sampler_devices is not None:
        dtype = self.model_config.dtype if self.settings.cast_weights else None
        engine.runner = SamplerRunner(engine, self.sampler_prepare, self.sampler_devices,
                                      self.rollout_shapes, compute_dtype=dtype,
                                      every=every if timed else 0).runner()
      elif timed and self.settings.lmbda > 0:
        engine.runner = SamplingClock(engine, self.settings, every).runner()
      # The one evaluation route adds the on-policy figures (and writes the samples).
      return with_extra_eval(engine, self._eval_fn())
    return engines.wrap(on_policy_engine)

  def _eval_fn(self):
    """(engine, state) -> the on-policy figure on held-out prompts; writes the samples."""
    evaluator = OnPolicyEvaluator(self.settings, mesh=self.mesh, rules=self.rules,
                                  chunk_size=self.chunk_size(), teachers=self.mix,
                                  sliced=self.loss_impl == "sliced")
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


def sampling_context(transforms):
  """What sampling runs under: adapter dropout is for the learner's forward, not sampling."""
  if transforms.lora is None:
    return contextlib.nullcontext
  return lambda: quant.lora_dropout(None)


def sampling_memory(model_config, rows: int, width: int, params_bytes: int,
                    settings: OnPolicySettings) -> dict[str, int]:
  """Bytes the sampler holds while it decodes `rows` samples of `width` positions: its KV cache
  (the compute dtype, or settings.cache_dtype) and, when it casts them (cast_weights), the
  student's weights in the compute dtype (`params_bytes` as stored, scaled down)."""
  kv = rows * width * kv_cache_bytes_per_token(model_config, settings.cache_dtype)
  stored = jax.numpy.dtype(model_config.param_dtype).itemsize
  compute = jax.numpy.dtype(model_config.dtype).itemsize
  weights = params_bytes * compute // stored if settings.cast_weights and compute < stored else 0
  return {"kv_cache_bytes": int(kv), "weights_copy_bytes": int(weights)}


def sampling_plan_line(model_config, sampling_batch: int, accum: int, prompt_len: int,
                       settings: OnPolicySettings, report: dict, data: int = 1) -> str:
  """plan's line about the two batches (per device: the `data`-parallel share of the rows)."""
  width = prompt_len + settings.max_new_tokens
  memory = sampling_memory(model_config, -(-sampling_batch // data), width,
                           int(report["params_bytes_per_device"]), settings)
  gib = lambda n: f"{n / 2**30:.3g} GiB"
  copy = (f" + the student's weights in {model_config.dtype} {gib(memory['weights_copy_bytes'])}"
          if memory["weights_copy_bytes"] else "")
  return (f"on-policy batches: sampling {sampling_batch} completions of {prompt_len} + "
          f"{settings.max_new_tokens} tokens at once (KV cache {gib(memory['kv_cache_bytes'])}"
          f"{copy} per device, before the update), update micro-batch "
          f"{sampling_batch // accum} completions x {accum} per step (in the compiled step's "
          f"peak)")


def sampler_devices_plan_line(model_config, sampling_batch: int, accum: int, prompt_len: int,
                              settings: OnPolicySettings, report: dict, devices: int) -> str:
  """plan's line about the two batches when the sampler has devices of its own: there, each
  device holds a whole copy of the student's weights and its share of the KV cache."""
  width = prompt_len + settings.max_new_tokens
  # The student's trained and frozen parts (a LoRA base), not the frozen extras (the teacher).
  extras = sum(int(total) for total, _ in report.get("frozen_models", {}).values())
  whole = int(report["params_total_bytes"]) + int(report["frozen_total_bytes"]) - extras
  memory = sampling_memory(model_config, -(-sampling_batch // devices), width, whole, settings)
  weights = memory["weights_copy_bytes"] or whole
  gib = lambda n: f"{n / 2**30:.3g} GiB"
  return (f"on-policy batches: sampling {sampling_batch} completions of {prompt_len} + "
          f"{settings.max_new_tokens} tokens at once on the sampler's {devices} devices (per "
          f"device: the student's weights {gib(weights)} + KV cache "
          f"{gib(memory['kv_cache_bytes'])}), update micro-batch {sampling_batch // accum} "
          f"completions x {accum} per step on the trainer's (in the compiled step's peak)")


def on_policy_step_flops(model_config, teacher_config, rows: int, prompt_len: int,
                         max_new_tokens: int) -> float:
  """Model FLOPs of one on-policy step over `rows` samples: the student's decode (about one
  forward over prompt + completion), the student's scoring forward and backward, and the
  teacher's forward."""
  length = prompt_len + max_new_tokens - 1
  step = flops.train_step_flops(model_config, rows, length, teacher_cfg=teacher_config)["total"]
  return step + flops.forward_flops(model_config, rows, length)


__all__ = ["OnPolicyRecipe", "on_policy_step_flops", "settings_from_config"]
