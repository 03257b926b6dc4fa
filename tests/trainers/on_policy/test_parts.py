"""trainers/on_policy/parts.py: what SamplingClock times (with a fake clock and fake programs,
whose durations are set by hand) and how eval samples are written."""

import json
import types

import numpy as np
import pytest

from distillax.distill.on_policy.objective import OnPolicySettings
from distillax.trainers.on_policy.parts import SamplingClock, write_samples


class World:
  """The fake clock: time passes only when a fake program runs or is waited for."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


class Pending:
  """A device value still being computed: waiting for it takes `remaining` seconds."""

  def __init__(self, world, remaining):
    self.world, self.remaining = world, remaining

  def block_until_ready(self):
    self.world.now += self.remaining
    self.remaining = 0.0
    return self


def _clock(world, *, decode_s, step_s, every):
  """A SamplingClock over a fake engine: the decode alone takes `decode_s`, a train step
  `step_s` (its result is ready that long after its input is); as on a device, a program first
  waits for its inputs."""
  def call(state, batch):
    return Pending(world, state.remaining + step_s), {"loss": np.float32(1.0)}

  def sample(state, batch):
    state.block_until_ready()
    world.now += decode_s
    return np.array([5, 3])  # completion lengths: 8 sampled tokens

  engine = types.SimpleNamespace(
      runner=types.SimpleNamespace(call=call, place_batch=lambda batch: batch),
      layout=types.SimpleNamespace(defs=None), mesh=None, rules=None,
      global_state=lambda state: state)
  clock = SamplingClock(engine, OnPolicySettings(max_new_tokens=4), every, clock=world)
  clock.sample, clock.place_global = sample, (lambda batch: batch)
  return clock


def _run(clock, world, steps):
  state, rows = Pending(world, 0.0), []
  for _ in range(steps):
    state, metrics = clock(state, clock.place_batch({"x": np.zeros(2)}))
    rows.append(metrics)
  return rows


def test_the_decode_is_timed_alone_not_with_the_previous_step_still_running():
  world = World()
  clock = _clock(world, decode_s=1.0, step_s=4.0, every=2)
  rows = _run(clock, world, 3)
  # Step 2 is not measured and not waited for: step 3's measurement starts while it runs.
  # Its 4 s are not decode time: the decode takes 1 s of a 4 s step, 8 tokens in 1 s.
  assert rows[2]["sampling_share"] == pytest.approx(0.25)
  assert rows[2]["sampled_tokens_per_s"] == pytest.approx(8.0)


def test_the_share_is_at_most_one():
  # Timed apart, the decode alone can measure longer than the step that holds it (load on the
  # machine during one timing and not the other): 1.79 was reported on on_policy.py:tiny.
  world = World()
  rows = _run(_clock(world, decode_s=1.79, step_s=1.0, every=1), world, 2)
  assert all(0.0 <= r["sampling_share"] <= 1.0 for r in rows)
  assert rows[-1]["sampling_share"] == 1.0


def test_eval_samples_of_a_step_written_again_keep_the_earlier_file(tmp_path):
  first = [{"prompt": "a", "completion": "b"}]
  path = write_samples(str(tmp_path), 10, first)
  assert write_samples(str(tmp_path), 10, first) == path  # the same completions: one file
  folder = tmp_path / "on_policy_samples"
  assert sorted(p.name for p in folder.iterdir()) == ["step_000010.jsonl"]
  write_samples(str(tmp_path), 10, [{"prompt": "a", "completion": "c"}])  # after a rollback
  write_samples(str(tmp_path), 10, [{"prompt": "a", "completion": "d"}])
  assert sorted(p.name for p in folder.iterdir()) == [
      "step_000010.jsonl", "step_000010.superseded-1.jsonl", "step_000010.superseded-2.jsonl"]
  read = lambda name: json.loads((folder / name).read_text())["completion"]
  assert [read("step_000010.superseded-1.jsonl"), read("step_000010.superseded-2.jsonl"),
          read("step_000010.jsonl")] == ["b", "c", "d"]
