"""The kinds of model source: fresh weights, a preset, a Hugging Face directory, an earlier run,
and blocks of another source (a student derived from its teacher).

Every source answers the same questions, each reading its files once:
  model_config()    the model it holds, as stored
  load(cfg, ...)    its weights as a model of config `cfg` (same shapes; `cfg`'s dtypes and
                    layout), read sharded tensor by tensor, never gathered on a host
  abstract(cfg)     the module `load` gives, with no arrays (what a step is compiled for)
  tokenizer_file()  the tokenizer.json it was trained with, if it has one
  fingerprint()     what identifies its weights on disk, so that a run which reloads them on
                    resume (a teacher, a LoRA base) notices when they changed
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from distillax import partitioning as pt
from distillax.data import check_vocab, make_tokenizer, padded_vocab_size
from distillax.errors import ConfigError
from distillax.models.hf import checkpoint as hf
from distillax.models.config import COMPUTE, STORAGE, TransformerConfig, fields_of_kind
from distillax.models.presets import config_from_dict, get_preset
from distillax.models.init import abstract_model, create_model
from distillax.models.per_layer_inputs import select_layer_columns
from distillax.models.transformer import layer_params
from distillax.quant.int8_model import abstract_int8_model, int8_model
from distillax.trainers.sources import experts, files

# The model fields that say how a model runs, not what it is (the kinds TransformerConfig
# declares): a model loaded from a source takes the asking config's values of these (e.g. fp32
# master weights of a bf16 checkpoint).
RUN_FIELDS = fields_of_kind(STORAGE, COMPUTE)


def resolve_model_config(model_cfg, tokenizer) -> TransformerConfig:
  """A model section's TransformerConfig, with the vocabulary taken from, or checked against,
  the data's tokenizer."""
  values = dict(model_cfg)
  if int(values.get("vocab_size") or 0) <= 0:
    values["vocab_size"] = padded_vocab_size(tokenizer)
  cfg = config_from_dict(values)
  check_vocab(tokenizer, cfg.vocab_size)
  return cfg


def place(values, mesh, rules, like: nnx.Module | None = None) -> nnx.Module:
  """`values` (a module, or a pure dict of its arrays) as a module shaped like `like` (an
  abstract module; default: the module itself): cast to `like`'s dtypes and put on the mesh by
  its logical axes. The one place where loaded or created weights (a teacher's blocks, a dtype
  change, adapters and projections made after the sharded init) meet the shardings; arrays
  move device to device, none is gathered on a host."""
  if isinstance(values, nnx.Module):
    like = values if like is None else like
    values = nnx.to_pure_dict(nnx.state(values))
  graph, abstract = nnx.split(like)
  want = nnx.to_pure_dict(abstract)
  values = jax.tree.map(lambda v, w: v.astype(w.dtype), values, want)
  shardings = pt.tree_shardings(want, pt.logical_tree(abstract), mesh, rules)
  nnx.replace_by_pure_dict(abstract, jax.device_put(values, shardings))
  return nnx.merge(graph, abstract)


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


class ModelSource:
  """Where one model's weights come from. `field` is the setting that names it."""

  kind = ""
  field = ""

  def named(self) -> str:
    """`field=value` as the user wrote it, for error lines."""
    return self.field or self.kind

  def model_config(self) -> TransformerConfig:
    raise NotImplementedError

  def load(self, cfg: TransformerConfig, mesh, rules, *, seed: int) -> nnx.Module:
    raise NotImplementedError

  def abstract(self, cfg: TransformerConfig, seed: int) -> nnx.Module:
    return abstract_model(cfg, seed)

  def tokenizer_file(self) -> str | None:
    return None

  def fingerprint(self) -> dict:
    return {"kind": self.kind, "source": self.named(), "config": self.model_config().to_dict()}

  def check_files(self) -> None:
    """Raises a UserError for a weight file `load` would miss (before anything compiles)."""
    of = getattr(self, "of", None)
    if of is not None:
      of.check_files()

  def _checked(self, model: nnx.Module, cfg: TransformerConfig) -> nnx.Module:
    if model.config != cfg:
      raise ConfigError(f"{self.named()} holds a model of another shape ({model.config}); make "
                        f"the model section match it")
    return model


@dataclasses.dataclass(frozen=True)
class FreshSource(ModelSource):
  """New weights from the seed: a student trained from scratch, or a preset teacher (tests,
  benchmarks), which draws from its own seed stream (`seed_offset`)."""

  cfg: TransformerConfig | None  # None until the recipe has resolved the model section
  field: str = ""
  seed_offset: int = 0
  kind = "fresh"

  def named(self) -> str:
    return self.field or "fresh weights"

  def model_config(self) -> TransformerConfig:
    return self.cfg

  def load(self, cfg, mesh, rules, *, seed):
    return create_model(cfg, mesh=mesh, rules=rules, seed=seed + self.seed_offset)

  def fingerprint(self) -> dict:
    return {**super().fingerprint(), "seed_offset": self.seed_offset}


def preset_source(name: str, vocab_size: int, field: str, seed_offset: int) -> FreshSource:
  return FreshSource(get_preset(name).replace(vocab_size=vocab_size), f"{field}={name}",
                     seed_offset)


@dataclasses.dataclass(frozen=True)
class HFSource(ModelSource):
  """A Hugging Face checkpoint directory (config.json + *.safetensors)."""

  path: str
  field: str
  kind = "hf"

  def named(self) -> str:
    return files.where(self.path, self.field)

  @functools.cached_property
  def _config(self) -> TransformerConfig:
    return files.hf_checkpoint_config(self.path, self.field)

  def model_config(self):
    return self._config

  def load(self, cfg, mesh, rules, *, seed):
    model = hf.load(self.path, mesh=mesh, rules=rules, **{k: getattr(cfg, k) for k in RUN_FIELDS})
    return self._checked(model, cfg)

  def check_files(self) -> None:
    hf.check_files(self.path)

  def tokenizer_file(self):
    file = os.path.join(self.path, "tokenizer.json")
    return file if os.path.isfile(file) else None

  def fingerprint(self):
    names = [n for n in os.listdir(self.path)
             if n == files.CONFIG_FILE or n.endswith((".safetensors", ".safetensors.index.json"))]
    return {**super().fingerprint(), "files": files.files_fingerprint(self.path, names)}


@dataclasses.dataclass(frozen=True)
class RunSource(ModelSource):
  """The trained student of an earlier distillax run: its newest valid checkpoint's student
  weights, restored alone (runs.py), whatever topology saved them."""

  workdir: str
  field: str
  # The source of the run's own student (given by select.py: a LoRA run's checkpoint holds
  # its adapters, and its frozen base is reloaded from where the run took it).
  base_of: Callable[[Any], ModelSource] = dataclasses.field(default=None, compare=False)
  kind = "run"

  def named(self) -> str:
    return files.where(self.workdir, self.field)

  @functools.cached_property
  def run_config(self):
    return files.load_run_config(self.workdir, self.field)

  @functools.cached_property
  def _config(self) -> TransformerConfig:
    cfg = self.run_config
    return resolve_model_config(cfg.model, make_tokenizer(cfg.data.tokenizer))

  def model_config(self):
    return self._config

  def load(self, cfg, mesh, rules, *, seed):
    return self.load_with_step(cfg, mesh, rules, seed=seed)[0]

  def load_with_step(self, cfg, mesh, rules, *, seed):
    """(`load`'s model, the checkpoint step it was read from: an older step than the newest
    when that one cannot be read)."""
    del seed  # the run's weights are all in its checkpoint
    from distillax.trainers.sources import runs  # runs.py asks sources for a LoRA run's base
    model, step = runs.load_run_student(self, mesh, rules)
    if model.config != cfg:
      model = self._checked(place(model, mesh, rules, abstract_model(cfg)), cfg)
    return model, step

  def tokenizer_file(self):
    return files.hf_tokenizer_file(str(self.run_config.data.tokenizer))

  def fingerprint(self):
    from distillax.trainers.sources import runs
    return {**super().fingerprint(), "run_config": _digest(self.run_config.to_dict()),
            **runs.checkpoint_fingerprint(self.workdir)}


@dataclasses.dataclass(frozen=True)
class BlocksSource(ModelSource):
  """Blocks `layers` (in that order) of another source, with its embeddings, final norm and
  head: a student derived from its teacher; `experts` (student.from_teacher.experts): the
  experts each block keeps (sources/experts.py; () = all)."""

  of: ModelSource
  layers: tuple[int, ...]
  field: str = "student.from_teacher.layers"
  experts: tuple = ()
  kind = "teacher"

  def named(self) -> str:
    return f"{self.field}={self.layers}"

  def kept_experts(self) -> tuple[tuple[int, ...], ...] | None:
    """Per student layer, the teacher experts it keeps; None = all."""
    return experts.kept_experts(self.experts, self.layers, self.of.model_config())

  def model_config(self):
    whole = self.of.model_config()
    outside = [i for i in self.layers if i >= whole.num_layers]
    if outside:
      raise ConfigError(f"{self.named()} names blocks {outside} but the teacher has "
                        f"{whole.num_layers} (0..{whole.num_layers - 1}); pick blocks it has")
    # Each block keeps its attention type.
    return experts.with_kept_experts(whole.select_layers(self.layers), self.kept_experts())

  def load(self, cfg, mesh, rules, *, seed):
    whole = self.of.load(self.of.model_config(), mesh, rules, seed=seed)  # bit for bit
    per_layer = layer_params(whole)
    kept = self.kept_experts() or [None] * len(self.layers)
    picked = [experts.slice_layer(per_layer[i], e) for i, e in zip(self.layers, kept)]
    values = {k: v for k, v in nnx.to_pure_dict(nnx.state(whole)).items() if k != "layers"}
    if cfg.per_layer_input_dim:  # Gemma 4: each block's columns of the per-layer inputs
      values["per_layer_inputs"] = select_layer_columns(values["per_layer_inputs"], self.layers,
                                                        cfg.per_layer_input_dim)
    values["layers"] = (jax.tree.map(lambda *a: jnp.stack(a), *picked) if cfg.scan_layers
                        else dict(enumerate(picked)))
    return place(values, mesh, rules, abstract_model(cfg))

  def tokenizer_file(self):
    return self.of.tokenizer_file()

  def fingerprint(self):
    kept = self.kept_experts()
    return {**self.of.fingerprint(), "layers": list(self.layers),
            **({} if kept is None else {"experts": [list(row) for row in kept]})}


@dataclasses.dataclass(frozen=True)
class Int8Source(ModelSource):
  """A frozen teacher's source whose matmul weights are kept as int8 codes + scales and run as
  int8 matmuls (`teacher.int8`: quant/int8_model.py), converted on the device once loaded.
  Everything else (what it holds, its tokenizer, its name in error lines) is its source's."""

  of: ModelSource

  @property
  def kind(self) -> str:
    return self.of.kind

  @property
  def field(self) -> str:
    return self.of.field

  def named(self) -> str:
    return self.of.named()

  def model_config(self):
    return self.of.model_config()

  def load(self, cfg, mesh, rules, *, seed):
    return int8_model(self.of.load(cfg, mesh, rules, seed=seed))

  def abstract(self, cfg, seed):
    return abstract_int8_model(self.of.abstract(cfg, seed))

  def tokenizer_file(self):
    return self.of.tokenizer_file()

  def fingerprint(self):
    return {**self.of.fingerprint(), "int8": True}
