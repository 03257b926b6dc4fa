"""The checks every section of TransformerConfig's fields shares, each raising one ConfigError
line that names the field, its value and what it may be (models/config_checks.py and the MoE
room's moe/config_checks.py use them)."""

from __future__ import annotations

from distillax.errors import ConfigError


def check_ints(cfg, names, minimum: int):
  """Integer fields (not bools) of at least `minimum`: 1 for sizes, 0 where 0 means off."""
  what = "a positive integer" if minimum == 1 else "a non-negative integer (0 = off)"
  for name in names:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      raise ConfigError(f"model.{name}={value!r} must be {what}")


def check_choice(cfg, name: str, choices) -> None:
  value = getattr(cfg, name)
  if value not in choices:
    raise ConfigError(f"model.{name}={value!r}; choose one of {', '.join(choices)}")
