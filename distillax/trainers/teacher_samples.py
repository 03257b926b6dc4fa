"""Train data a frozen model writes before training starts: what the jobs that learn a model's
own text share. Sequence-level KD (trainers/sequence_kd.py) trains the student on its teacher's
samples; the EAGLE-3 draft with `draft.regenerate` (trainers/draft.py) trains the head on its
target's own answers to the train prompts. Both read the `sequence_kd` section (how many
prompts, how long, how many new tokens, how they are sampled; configs/sections.py) and
distill/sequence_kd.py generates.

What makes such a file safe to train on is the same for both jobs, so it lives here once: it is
written whole to a temporary name and renamed (a crash mid-generation leaves no file that could
pass for finished), and a finished file is reused as it is, so a resumed or restarted run trains
on the same data and never pays for the generation twice. What wrote it (the writer's section,
the sampling settings, the data and seed) is kept beside it (`<file>.settings.json`): a run whose
settings differ is refused rather than trained on samples it did not ask for. The train split of `data` then holds
only prompts; eval stays on its validation split, so the figures compare with any run on that
data.
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections
from absl import logging

from distillax.data import make_train_iterator
from distillax.distill.sequence_kd import (answer_prompts, generate_samples, take_prompt_records,
                                           write_jsonl)
from distillax import jsonio
from distillax.errors import ConfigError, UserError
from distillax.framework.run import runtime
from distillax.framework.run.progress import ProgressBar

SAMPLES_FILE = "teacher_samples.jsonl"  # in the workdir, unless sequence_kd.output names one
# The sizes a generation needs, each at least 1, and what each counts (for the messages).
SIZES = {"num_prompts": "train prompts continued", "prompt_len": "tokens of each prompt",
         "max_new_tokens": "tokens written after each prompt",
         "batch_size": "prompts per generation call"}


def check_sample_settings(sc, writer_config, why: str, who: str = "teacher") -> None:
  """One ConfigError line for a `sequence_kd` section that cannot give samples; `why` says what
  asked for them (the job, or draft.regenerate), `writer_config` is the config of the model that
  writes them, `who` (None: not known here)."""
  for name, what in SIZES.items():
    if int(sc[name]) < 1:
      raise ConfigError(f"{why}: sequence_kd.{name}={sc[name]} must be >= 1 ({what}); raise it "
                        f"with --config.sequence_kd.{name}=N")
  if float(sc.temperature) < 0:
    raise ConfigError(f"{why}: sequence_kd.temperature={sc.temperature} must be >= 0 "
                      f"(0 = greedy decoding)")
  limit = int(writer_config.max_seq_len) if writer_config is not None else None
  if limit is not None and int(sc.prompt_len) + int(sc.max_new_tokens) > limit:
    raise ConfigError(f"{why}: sequence_kd.prompt_len={sc.prompt_len} + max_new_tokens="
                      f"{sc.max_new_tokens} exceeds the {who}'s max_seq_len={limit}; "
                      f"shorten one of them")


class TeacherSamples:
  """The sample file of one recipe (its config's `sequence_kd` section, its workdir, tokenizer,
  mesh and rules): where it is, the `data` section that reads it, and writing it once.

  `answers_only`: every sample is a prompt and its answer, so only the writer's text is trained
  (a text document's beginning becomes a plain-text prompt); otherwise text documents give
  `{"text": prompt + continuation}` as sequence-level KD trains them. `who` names the writer in
  messages and progress lines ("teacher", "target")."""

  def __init__(self, recipe, *, who: str = "teacher", answers_only: bool = False):
    self.recipe, self.who, self.answers_only = recipe, who, answers_only
    self.settings = recipe.config.sequence_kd
    self._reuse_said = False

  @property
  def path(self) -> str:
    """The sample file: sequence_kd.output, else the workdir's teacher_samples.jsonl."""
    if self.settings.output:
      return os.path.abspath(self.settings.output)
    if not self.recipe.workdir:
      raise UserError(f"the {self.who}'s samples need a workdir, or sequence_kd.output naming "
                      f"their file")
    return os.path.join(os.path.abspath(self.recipe.workdir), SAMPLES_FILE)

  def data_config(self) -> ml_collections.ConfigDict:
    """The `data` section with the sample file as the whole train set, read in the layout the
    samples are written in (distill/sequence_kd.py: text, or prompt and completion per record),
    whatever layout and fields `data` names for the original source."""
    data = ml_collections.ConfigDict(self.recipe.config.data.to_dict())
    data.source, data.format, data.layout = self.path, "jsonl", "auto"
    data.text_field, data.messages_field = "text", "messages"
    data.eval_source, data.validation_fraction = "", 0.0
    return data

  def train_iterator(self, load_writer):
    """The train batches of the sample file, written first when it is not there yet
    (`load_writer()` gives the frozen model that writes them)."""
    self.ensure(load_writer)
    r = self.recipe
    return make_train_iterator(self.data_config(), global_batch_size=r.batch_size,
                               seq_len=r.seq_len, seed=int(r.config.seed), tokenizer=r.tokenizer)

  def ensure(self, load_writer) -> str:
    """Writes the samples unless a finished file is already there; returns its path."""
    path, sc, r = self.path, self.settings, self.recipe
    if os.path.exists(path):
      self._check_settings(path)
      if not self._reuse_said:  # a job may open its data more than once (a draft's vocabulary)
        logging.info("reusing the %s samples in %s", self.who, path)
        self._reuse_said = True
      return path
    if jax.process_count() > 1:
      raise UserError(f"the {self.who}'s samples are written in one process: write {path} "
                      f"with a run without --num_processes (stop it once the file is there), or "
                      f"name a finished file in --config.sequence_kd.output")
    seed = int(r.config.seed)
    prompts = take_prompt_records(r.config.data, r.tokenizer, count=int(sc.num_prompts),
                                  prompt_len=int(sc.prompt_len), seed=seed)
    if self.answers_only:
      prompts = answer_prompts(prompts, r.tokenizer)
    logging.info("the %s continues %d train prompts (up to %d new tokens each) into %s",
                 self.who, len(prompts), int(sc.max_new_tokens), path)
    writer = load_writer()
    with _GenerationProgress(f"{self.who} samples", len(prompts), r.config.train) as on_batch:
      samples, stats = generate_samples(writer, prompts, r.tokenizer, sc, mesh=r.mesh,
                                        rules=r.rules, seed=seed, on_batch=on_batch)
    _write_settings(path, self.written_with())
    write_jsonl(path, samples)
    self._reuse_said = True  # what this session wrote it reads again without saying so
    logging.info("%d %s samples (%d generated tokens, %s NLL %.3f per token) in %s",
                 stats["samples"], self.who, stats["generated_tokens"], self.who,
                 stats["teacher_nll_per_token"], path)
    return path


  def written_with(self) -> dict:
    """What decides the samples: the writer's section, how it samples, what it continues."""
    config, sc = self.recipe.config, self.settings
    sampling = {k: v for k, v in sc.to_dict().items() if k not in ("output", "batch_size")}
    return json.loads(jsonio.dumps({
        "writer": config.teacher.to_dict() if "teacher" in config else None,
        "sequence_kd": sampling, "answers_only": self.answers_only, "seed": int(config.seed),
        "data": {k: config.data[k] for k in ("source", "format", "layout", "text_field",
                                             "messages_field") if k in config.data}}))

  def check_existing(self) -> None:
    """Up front, before anything is written: a finished file from other settings is refused."""
    if (self.settings.output or self.recipe.workdir) and os.path.exists(self.path):
      self._check_settings(self.path)

  def _check_settings(self, path: str) -> None:
    """A finished file written with other settings is refused (one written before the settings
    were kept, or named by hand in sequence_kd.output without them, is taken as it is)."""
    record = path + SETTINGS_SUFFIX
    if not os.path.exists(record):
      return
    with open(record, encoding="utf-8") as f:
      then = json.load(f)
    now = self.written_with()
    changed = _first_difference(then, now)
    if changed is not None:
      key, was, asked = changed
      raise UserError(f"{path} holds the {self.who}'s samples written with {key}={was!r}, and "
                      f"this run asks {asked!r}: delete the file (and {os.path.basename(record)})"
                      f" to write new samples, or run with the settings it was written with")


SETTINGS_SUFFIX = ".settings.json"


def _write_settings(path: str, settings: dict) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + SETTINGS_SUFFIX + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    jsonio.dump(settings, f, indent=1)
  os.replace(tmp, path + SETTINGS_SUFFIX)


def _first_difference(then, now, key: str = ""):
  """(dotted key, then, now) of the first setting that differs, or None."""
  if isinstance(then, dict) and isinstance(now, dict):
    for k in sorted(set(then) | set(now)):
      found = _first_difference(then.get(k), now.get(k), f"{key}.{k}" if key else k)
      if found is not None:
        return found
    return None
  return None if then == now else (key, then, now)


class _GenerationProgress:
  """The generation's progress: the bar when train.progress is on, else one log line per
  sampler call (a regeneration of a data set runs for hours: it must say how far it is)."""

  def __init__(self, desc: str, total: int, train_cfg):
    self.desc, self.total, self.done, self.tokens = desc, total, 0, 0
    self.bar = ProgressBar(total, desc=desc, unit="prompt",
                           enabled=bool(train_cfg.progress) and runtime.is_primary())

  def __enter__(self):
    return self.update

  def update(self, prompts: int, tokens: int) -> None:
    self.done, self.tokens = self.done + prompts, self.tokens + tokens
    self.bar.update(prompts, tokens=tokens)
    if not self.bar.enabled:
      logging.info("%s: %d/%d prompts, %d tokens generated", self.desc, self.done, self.total,
                   self.tokens)

  def __exit__(self, *exc):
    self.bar.close()
    return False


__all__ = ["SAMPLES_FILE", "SIZES", "TeacherSamples", "check_sample_settings"]
