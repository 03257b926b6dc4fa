"""The recipe half of a job: everything a config alone determines.

A recipe resolves the mesh, rules, tokenizer and model configs; builds the student (fresh, from
an earlier run, a Hugging Face checkpoint or the teacher's blocks, with the LoRA/QAT transforms)
and the frozen extras; gives the objective, what trains, the batch shapes, the data, the
compiled engines and the model that export writes. `plan`, `export`, `cache-teacher`, loading an
earlier run and the benchmarks ask a recipe; the loop (base.py) runs one. A new kind of job is
a new recipe, usually a few methods over this one.

    recipe = recipe_for(config)                  # mesh, rules, tokenizer, model config
    engines = recipe.build_engines()             # compiled step(s); nothing materialised
    student, extras = recipe.build(abstract=False)
    state = engines.main.init_state(student, extras, config.seed)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
from flax import nnx

from distillax import partitioning as pt
from distillax.data import batch_shapes, make_eval_iterator, make_tokenizer, make_train_iterator
from distillax.errors import ConfigError
from distillax.framework import eval_rules, flops, token_rows
from distillax.framework.engine import Engine, build_engine, with_extra_eval
from distillax.framework.run import runtime
from distillax.framework.run.startup import StartupClock
from distillax.framework.state import Reloaded
from distillax.framework.step import Objective
from distillax.framework.token_loss_impl import check_loss_impl, resolve_loss_impl
from distillax.models.config import TransformerConfig
from distillax.models.init import abstract_model
from distillax.trainers import sources as src
# The checks, imported here too: what a job's config may hold is asked of the recipe.
from distillax.trainers.checks import (check_data_paths, check_model_conflicts,
                                       check_recipe_data, check_run_sections)
from distillax.trainers.generation_eval import GENERATION_FIGURES, GenerationEval
from distillax.trainers.paths import absolute_paths
from distillax.trainers.transforms import StudentTransforms


@dataclasses.dataclass
class Engines:
  """The compiled step(s) of a run: with a delayed QAT start, a full-precision engine serves the
  steps before `start_step`; under a qat.schedule, `middle` holds the stages before the last,
  each from its first step, and `main` (the last stage) serves from `main_step`. Every engine
  has the same state tree, so switching touches nothing (optimizer state, data position)."""

  main: Engine
  before_start: Engine | None = None
  start_step: int = 0
  middle: tuple[tuple[int, Engine], ...] = ()  # qat.schedule's earlier stages: (first step, engine)
  main_step: int = 0  # first step of `main` under a qat.schedule

  def add_extra_eval(self, fn) -> None:
    """Every engine's evals also report `fn(engine, state)`'s figures."""
    self.wrap(lambda engine: with_extra_eval(engine, fn))

  def wrap(self, wrapper) -> "Engines":
    """Every engine replaced by `wrapper(engine)` (extra evals, on-policy sampling, a host step
    between two programs): the switching between them stays as it was."""
    self.main = wrapper(self.main)
    if self.before_start is not None:
      self.before_start = wrapper(self.before_start)
    self.middle = tuple((first, wrapper(e)) for first, e in self.middle)
    return self

  def at(self, step: int) -> Engine:
    if self.before_start is not None and step < self.start_step:
      return self.before_start
    if step < self.main_step:
      for first, engine in reversed(self.middle):
        if step >= first:
          return engine
    return self.main


def rollback_metric(config, choices: tuple[str, ...], job: str) -> str:
  """train.rollback_metric, None resolved to the job's own figure (the first of `choices`); a
  figure of unknown direction (framework/eval_rules.py), or one the job's eval does not report,
  fails when the recipe is made, not at the first eval."""
  name = config.train.get("rollback_metric")
  if name is None:
    return choices[0]
  if name not in choices:
    raise ConfigError(f"train.rollback_metric={name!r} is not an eval figure the {job} job "
                      f"reports; use one of {', '.join(choices)}, e.g. "
                      f"--config.train.rollback_metric={choices[0]}"
                      + ("" if name not in GENERATION_FIGURES else
                         f" (or set eval.generate to a held-out prompt/completion JSONL for "
                         f"{name})"))
  eval_rules.direction_of(name)  # a figure of unknown direction cannot be judged
  return name


def check_router_losses(train, model_config: TransformerConfig, job: str, supported: bool):
  """Router-loss weights only where a router and an objective that adds them exist."""
  for name in ("moe_aux_loss", "router_z_loss"):
    value = float(train.get(name, 0.0))
    if value < 0:
      raise ConfigError(f"train.{name}={value} must be >= 0 (0 = off)")
    if value and not model_config.num_experts:
      raise ConfigError(f"train.{name}={value} weighs a router loss, but the student is dense "
                        f"(model.num_experts=0); set --config.train.{name}=0")
    if value and not supported:
      raise ConfigError(f"train.{name}={value}: the {job} job's objective adds no router "
                        f"losses (lm, sequence_kd, distill, distill_cached and on_policy do); "
                        f"set --config.train.{name}=0")


class Recipe:
  """The base every recipe specialises (lm.py's LMRecipe is the plainest): one student, no
  frozen extras, the packed train and validation data; a subclass names the objective.

  `workdir` is where the job's own files go (sequence KD writes its samples there); `mesh` and
  `rules` override the config's (loading an earlier run onto this run's topology);
  `model_overrides` are the `--config.*` values a user set (the CLI's), checked against the
  student's source.
  """

  name = "recipe"  # @register sets the registered name
  # The model run frozen inside the step (counted in its FLOPs); distillation recipes set it.
  teacher_model_config: TransformerConfig | None = None
  teacher_source: src.ModelSource | None = None  # where that teacher's weights come from
  # Where the plain student sits in the trained module's tree (a distillation student wraps it
  # with its training-only projections): what loading a run's student reads.
  student_path: tuple[str, ...] = ()
  # The splits of `data` the job trains or evaluates on, which must each have a token to train.
  data_splits: tuple[str, ...] = ("train", "eval")
  # The splits whose prompts the job reads (`self.prompts(split)`, on-policy jobs): read by
  # check_recipe_data before anything compiles, so a prompt length none fits is said then.
  prompt_splits: tuple[str, ...] = ()
  # (self, plan report) -> lines `plan` prints about the job's own batches after its figures
  # (on-policy's sampling and update batches); None: no such lines.
  plan_lines = None
  # Model FLOPs of step_flops() that a program other than the compiled train step runs (an
  # on-policy sampler on devices of its own): plan checks the step's HLO against the rest.
  step_flops_elsewhere: float = 0.0
  # (rows, positions) the step's token losses score where they are not its batch (on-policy's
  # samples: prompt + completion); None: the batch. plan sizes the sliced engine's recompute by it.
  loss_shape: tuple[int, int] | None = None
  # The eval figures the rollback guard may watch (train.rollback_metric), each with a direction
  # in framework/eval_rules.py; the first is the job's own (the default): the figure its
  # objective lowers. Next-token training lowers the CE, so its perplexity. eval.generate adds
  # generation_eval.GENERATION_FIGURES.
  rollback_metrics: tuple[str, ...] = ("eval_perplexity", "eval_loss", "eval_objective")
  # Whether the objective adds train.moe_aux_loss / train.router_z_loss (every registered job
  # does; a new recipe says so once its objective takes them).
  router_losses: bool = False
  # Whether its train losses are ones train.loss_impl='sliced' computes (framework/vocab_slices).
  sliced_loss: bool = False

  def __init__(self, config, *, workdir: str | None = None, mesh=None,
               rules: pt.RuleSet | None = None, model_overrides: Mapping | None = None):
    # The phases of the job's start, said at its first step (the loop marks the rest).
    self.startup = StartupClock()
    self.startup.mark("imports, config and runtime")
    opened = runtime.wait_for_early_devices()  # the CLI's start of them, beside the imports
    if opened is None:
      jax.devices()  # starts JAX's runtime (opens a chip) unless something already has
      self.startup.mark("devices")
    else:
      self.startup.mark("waiting for the devices")
      self.startup.beside["the devices opened"] = opened
    config = absolute_paths(config)  # as the CLI makes them: orbax refuses relative paths
    check_run_sections(config)  # the optimizer section's too
    check_data_paths(config.data)
    self.sources = src.job_sources(config)
    # A student from an earlier run, a checkpoint or the teacher has its source's shape:
    # `self.config` (what config.json records) holds it in the model section.
    self.config = config = src.resolve_student(config, self.sources, model_overrides)
    self.workdir = workdir
    # Micro-batches per optimizer step (gradient accumulation inside the step); a recipe with
    # its own batches (on-policy's micro_batch) sets it from them.
    self.accum_steps = int(config.train.accum_steps)
    self.mesh = mesh if mesh is not None else pt.create_mesh(config.mesh)
    self.rules = rules if rules is not None else pt.rules_from_config(config.partitioning)
    self.tokenizer = make_tokenizer(config.data.tokenizer)
    self.startup.mark("sources, mesh and tokenizer")
    self.model_config = src.resolve_model_config(config.model, self.tokenizer)
    if self.sources.student.kind == "fresh":
      self.sources = dataclasses.replace(
          self.sources, student=dataclasses.replace(self.sources.student, cfg=self.model_config))
    src.check_run_shape(self.sources.student, self.model_config)
    check_router_losses(config.train, self.model_config, self.name, self.router_losses)
    check_loss_impl(config.train.get("loss_impl", "auto"), self.name, sliced=self.sliced_loss)
    self.loss_impl = resolve_loss_impl(config.train.get("loss_impl", "auto"), self.sliced_loss)
    # Checked with the data before training, or before compiling (checks.model_conflicts).
    self.batch_size, self.seq_len = int(config.train.batch_size), int(config.train.seq_len)
    self.transforms = StudentTransforms.from_config(config)
    # eval.generate: each eval also scores greedy completions of held-out prompts.
    self.generation_eval = GenerationEval.from_config(config, self.tokenizer, self.student_path)
    figures = self.rollback_metrics + (GENERATION_FIGURES if self.generation_eval else ())
    self.rollback_metric = rollback_metric(config, figures, self.name)

  # ---- what the job builds (subclasses override these) ----------------------------------------

  def objective(self, *, train: bool = False) -> Objective:
    """The evaluation objective; `train=True` adds training-only parts (adapter dropout)."""
    raise NotImplementedError(f"{type(self).__name__} names no objective")

  def build(self, *, abstract: bool, quantize: bool = True) -> tuple[nnx.Module, dict]:
    """(student, frozen extras). Abstract modules cost no memory; real ones are sharded.
    quantize=False leaves QAT fake quantization off (the steps before `qat.start_step`)."""
    return self.build_student(abstract=abstract, quantize=quantize), {}

  def batch_shapes(self) -> Mapping[str, jax.ShapeDtypeStruct]:
    return batch_shapes(self.batch_size, self.seq_len)

  def train_iterator(self):
    c = self.config
    return make_train_iterator(c.data, global_batch_size=self.batch_size, seq_len=self.seq_len,
                               seed=int(c.seed), tokenizer=self.tokenizer)

  # ---- shared by every recipe -------------------------------------------------------------------

  def build_student(self, *, abstract: bool, quantize: bool = True) -> nnx.Module:
    """The plain student (fresh or `train.init_from`) with the LoRA/QAT transforms applied."""
    apply = lambda m: self.transforms.apply(m, quantize=quantize)
    if abstract:
      model = abstract_model(self.model_config, int(self.config.seed))
      return nnx.eval_shape(lambda: apply(model))
    model = self.sources.student.load(self.model_config, self.mesh, self.rules,
                                      seed=int(self.config.seed))
    return src.place(apply(model), self.mesh, self.rules)

  def trainable(self) -> Any:
    return self.transforms.trainable()

  def eval_iterator(self):
    c = self.config
    return make_eval_iterator(c.data, global_batch_size=self.batch_size, seq_len=self.seq_len,
                              num_batches=int(c.train.eval_batches), tokenizer=self.tokenizer)

  def export_model(self, student: nnx.Module) -> nnx.Module:
    """The plain deployable model inside a trained student: LoRA merged, fake quantization off
    (quantized export applies it again)."""
    return self.transforms.strip(student)

  def build_engines(self, learning_rate: float | None = None, *,
                    compile_now: bool | str = "background") -> Engines:
    """The step(s) at `learning_rate` (default: the optimizer section's), lowered now and
    compiled in the background (build_engine's `compile_now`), or only if ever run with
    compile_now=False (eval alone)."""
    check_model_conflicts(self)
    lr = float(self.config.optimizer.learning_rate if learning_rate is None else learning_rate)
    start = self.transforms.qat_start_step
    engines = Engines(self._engine(lr, compile_now=compile_now),
                      self._engine(lr, quantize=False, compile_now=compile_now) if start > 0
                      else None, start)
    qat = self.transforms.qat
    if qat is not None and qat.schedule:
      *earlier, (engines.main_step, _) = qat.stages()
      engines.middle = tuple((first, self._engine(lr, compile_now=compile_now, stage=first))
                             for first, _ in earlier)
    if self.generation_eval is not None:
      engines.add_extra_eval(self.generation_eval)
    return engines

  def step_flops(self) -> float:
    """Model FLOPs of one train step (forward + backward, a frozen teacher's forward)."""
    return flops.train_step_flops(self.model_config, self.batch_size, self.seq_len,
                                  teacher_cfg=self.teacher_model_config)["total"]

  def _engine(self, learning_rate: float, quantize: bool = True,
              compile_now: bool | str = "background", stage: int | None = None) -> Engine:
    """`stage`: the first step of a qat.schedule stage whose rules the student takes (every
    recipe's `build` reads self.transforms, so they are swapped for that one build)."""
    c = self.config
    optimizer_cfg = c.optimizer.copy_and_resolve_references()
    optimizer_cfg.learning_rate = learning_rate
    transforms = self.transforms
    self.transforms = transforms if stage is None else transforms.at_step(stage)
    try:
      student, extras = self.build(abstract=True, quantize=quantize)
    finally:
      self.transforms = transforms
    # Every token loss takes its softmax over the tokenizer's ids, as the model's export does
    # (framework/token_rows.py): a padded vocabulary's rows never count.
    over_tokens = lambda objective: token_rows.over_token_rows(objective,
                                                               self.tokenizer.vocab_size)
    return build_engine(student, extras, over_tokens(self.objective(train=True)), optimizer_cfg,
                        int(c.train.steps), self.mesh, self.rules, c.backend, self.batch_shapes(),
                        accum_steps=self.accum_steps, trainable=self.trainable(),
                        compile_now=compile_now, eval_objective=over_tokens(self.objective()),
                        gradient_reduction=str(c.partitioning.get("gradient_reduction", "auto")),
                        # Checkpoints leave out what the sources give back on resume: every
                        # frozen extra (the teacher) and the student's frozen base (LoRA's).
                        reloaded=Reloaded(tuple(extras), self.student_path))
