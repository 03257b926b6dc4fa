"""What every job config shares: the base config, the model section, the `:arg` parser and the
`:tiny` shrink. A config file builds on `base_config(model_preset)` and changes what its job
needs; the CLI then applies `--config.a.b=value` overrides, type-checked against the defaults
(each section's defaults live in configs/sections.py).
"""

from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from distillax.configs import sections
from distillax.data import default_data_config
from distillax.errors import ConfigError
from distillax.framework.optim import default_optimizer_config
from distillax.models.presets import get_preset


def model_config(preset: str, **overrides) -> ml_collections.ConfigDict:
  """Every TransformerConfig field of a preset, so any one is overridable from the CLI.

  vocab_size 0 means "take it from the tokenizer" (rounded up to a multiple of 128).
  """
  cfg = dataclasses.asdict(get_preset(preset))
  cfg.update(overrides)
  cfg.setdefault("vocab_size", 0)
  out = ml_collections.ConfigDict(cfg)
  for key in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
              "rope_scaling_factor", "moe_capacity_factor", "rope_local_theta"):
    if out[key] is None:
      out[key] = config_dict.placeholder(float)
  if out["sliding_window"] is None:
    out["sliding_window"] = config_dict.placeholder(int)
  # Per-layer names (token_mixers: Qwen3.5's) and indices (rope_free_layers: SmolLM3's).
  for key in ("layer_types", "token_mixers", "rope_free_layers"):
    if out[key] is None:
      out[key] = config_dict.placeholder(tuple)
  return out


def base_config(model_preset: str = "tiny") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.trainer = "lm"  # the recipe that builds the job: lm, distill, on_policy, ... (Trainers)
  c.seed = 0  # seeds parameters, data order and dropout
  c.backend = "jit"  # jit | shard_map | pmap | vmap (the last three: data parallel only)
  c.mesh = sections.mesh_section()
  c.partitioning = sections.partitioning_section()
  c.model = model_config(model_preset, vocab_size=0)
  c.optimizer = default_optimizer_config()
  c.data = default_data_config()
  c.train = sections.train_section()
  c.eval = sections.eval_section()
  c.checkpoint = sections.checkpoint_section()
  c.qat = sections.qat_section()
  c.lora = sections.lora_section()
  c.profile = sections.profile_section()
  c.runtime = sections.runtime_section()
  return c


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """The `:arg` of `--config file.py:arg`, as typed fields: 'tiny' or 'tiny,steps=3'.

  A bare name turns a boolean default on; `key=value` takes the default's type. Unknown names
  are a one-line error listing the known ones (big_vision's `parse_arg`, with checking).
  """
  out = ml_collections.ConfigDict(defaults)
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    key, has_value, value = part.partition("=")
    if key not in defaults:
      known = ", ".join(f":{k}" for k in defaults) or "none"
      raise ConfigError(f"unknown config argument {part!r}; this config takes {known}")
    default = defaults[key]
    if not has_value:
      if not isinstance(default, bool):
        raise ConfigError(f"config argument {key!r} needs a value, e.g. :{key}={default!r}")
      out[key] = True
    elif isinstance(default, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"config argument {key}={value!r} must be true or false")
      out[key] = value.lower() in ("true", "1")
    else:
      try:
        out[key] = type(default)(value)
      except ValueError:
        raise ConfigError(f"config argument {key}={value!r} must be a "
                          f"{type(default).__name__}") from None
  return out


def shrink_for_tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The `:tiny` argument: a seconds-long run on the embedded corpus (smoke tests use it)."""
  for key, value in dataclasses.asdict(get_preset("tiny")).items():
    if key in c.model and key != "vocab_size":
      c.model[key] = value
  c.train.steps = 6
  c.train.batch_size = 8
  c.train.seq_len = 32
  c.train.log_every = 2
  c.train.eval_every = 3
  c.train.eval_batches = 2
  c.train.progress = False
  c.checkpoint.every_steps = 3
  c.optimizer.warmup_steps = 2
  c.data.shuffle_buffer = 64
  return c
