"""Which decoder layers the code being traced serves, and what each kernel choice made inside
ran for them: the transformer marks each block it traces (a scanned stack: all its layers at
once), the attention and MoE choices record themselves against the mark, and `plan` reports
per layer what ran ("layers 0-3 of 4: attention splash; experts tokamax")."""

from __future__ import annotations

import collections
import contextlib
import contextvars
from typing import Iterable

# (layers, num_layers of the model) of the block being traced; None outside any block.
_SCOPE: contextvars.ContextVar[tuple[tuple[int, ...], int] | None] = contextvars.ContextVar(
    "distillax_layer_scope", default=None)
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "distillax_layer_choices", default=None)


@contextlib.contextmanager
def serving(layers: Iterable[int], num_layers: int):
  """Code traced inside serves `layers` of a `num_layers`-layer model."""
  token = _SCOPE.set((tuple(layers), int(num_layers)))
  try:
    yield
  finally:
    _SCOPE.reset(token)


_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("distillax_unrecorded", default=False)


@contextlib.contextmanager
def unrecorded():
  """Traces inside are no part of the step (a model transform's probe with a (1, 1) input):
  no choice made in them is recorded, here or by the attention and MoE counts."""
  token = _OFF.set(True)
  try:
    yield
  finally:
    _OFF.reset(token)


def recording() -> bool:
  return not _OFF.get()


def record(kind: str, choice: str) -> None:
  """Notes that the call being traced ('attention', 'experts') ran `choice` in the current
  layers (when someone is recording and the call is inside a marked block)."""
  found, scope = _RECORD.get(), _SCOPE.get()
  if found is not None and scope is not None and recording():
    found.append((kind, choice, scope))


class ChoiceCounter:
  """How many traced calls made each kernel choice inside `counted()` (probes of model
  transforms left out): the MoE and token-loss figures `plan` prints beside the attention
  choices, one counter per kind of call."""

  def __init__(self, name: str):
    self._found: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
        name, default=None)

  def add(self, choice: str) -> None:
    found = self._found.get()
    if found is not None and recording():
      found.append(choice)

  @contextlib.contextmanager
  def counted(self):
    """Yields a dict filled on exit: {choice: traced calls}."""
    found: list[str] = []
    counts: dict[str, int] = {}
    token = self._found.set(found)
    try:
      yield counts
    finally:
      self._found.reset(token)
      counts.update(collections.Counter(found))


def ranges(layers: Iterable[int]) -> str:
  """'0-3, 6, 8-9' for layers 0, 1, 2, 3, 6, 8, 9."""
  runs: list[list[int]] = []
  for layer in sorted(set(layers)):
    if runs and layer == runs[-1][1] + 1:
      runs[-1][1] = layer
    else:
      runs.append([layer, layer])
  return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


@contextlib.contextmanager
def recorded_by_layer():
  """Yields a dict filled on exit: {'layers 0-3 of 4': {'attention': 'splash', 'experts':
  ...}}, the layers of one model that ran the same choices grouped (a teacher and a student
  of different depths apart); a layer traced several ways lists each ('reference + splash')."""
  found: list = []
  grouped: dict[str, dict[str, str]] = {}
  token = _RECORD.set(found)
  try:
    yield grouped
  finally:
    _RECORD.reset(token)
    per_layer: dict[tuple[int, int], dict[str, list[str]]] = {}
    for kind, choice, (layers, num_layers) in found:
      for layer in layers:
        choices = per_layer.setdefault((num_layers, layer), {}).setdefault(kind, [])
        if choice not in choices:  # e.g. on-policy: the sampler's decode, then the scoring
          choices.append(choice)
    groups: dict[tuple, list[int]] = {}
    for (num_layers, layer), choices in sorted(per_layer.items()):
      key = tuple(sorted((kind, " + ".join(c)) for kind, c in choices.items()))
      groups.setdefault((num_layers, key), []).append(layer)
    for (num_layers, choices), layers in groups.items():
      grouped[f"layer{'s' if len(layers) > 1 else ''} {ranges(layers)} of {num_layers}"] = dict(
          choices)
