"""The progress bar: rate limiting, ETA and rates by hand arithmetic, TTY and log-file output."""

import io
import re

import pytest

from distillax.framework.run.progress import ProgressBar, format_count, format_duration


class FakeClock:
  def __init__(self, now=0.0):
    self.now = now

  def __call__(self):
    return self.now


def test_log_mode_prints_a_line_every_interval_with_rates_and_eta():
  clock, out = FakeClock(100.0), io.StringIO()
  bar = ProgressBar(total=100, desc="train", stream=out, is_tty=False, min_interval_s=10.0,
                    clock=clock)
  # Step 1 ends at t=100 after a 30 s compile the bar never sees; then one step per second.
  for i in range(1, 101):
    clock.now = 100.0 + (i - 1)
    bar.update(1, tokens=256, loss=10.0 / i)
  bar.close()
  lines = out.getvalue().splitlines()
  assert "\r" not in out.getvalue()
  # Renders at t=110, 120, ..., 190 (steps 11..91) and the final one at close.
  assert len(lines) == 10
  first = lines[0]
  assert first.startswith("train  11/100 (11%)  1 step/s")
  assert "1 step/s" in first                 # 10 steps in 10 s since the first update
  assert "256 tok/s" in first
  assert f"loss {10.0 / 11:.4g}" in first
  assert "elapsed 0:10 ETA 1:29" in first      # 89 steps left at 1 step/s
  assert lines[-1].startswith("train  100/100 (100%)") and "ETA 0:00" in lines[-1]


def test_rates_exclude_the_first_update():
  clock = FakeClock(0.0)
  bar = ProgressBar(total=10, stream=io.StringIO(), is_tty=False, clock=clock)
  clock.now = 50.0       # a slow first step (compilation)
  bar.update(1, tokens=100)
  clock.now = 54.0
  bar.update(4, tokens=400)
  rates = bar.rates()
  assert rates["units_per_s"] == pytest.approx(1.0)
  assert rates["tokens_per_s"] == pytest.approx(100.0)
  assert rates["eta_s"] == pytest.approx(5.0)
  assert rates["elapsed_s"] == pytest.approx(4.0)


def test_tty_mode_redraws_in_place_and_log_keeps_the_bar_intact():
  clock, out = FakeClock(), io.StringIO()
  bar = ProgressBar(total=4, desc="eval", unit="batch", stream=out, is_tty=True,
                    min_interval_s=0.5, clock=clock)
  for i in range(4):
    clock.now = float(i)
    bar.update(1)
    if i == 1:
      bar.log("eval_loss 1.5")
  bar.close()
  text = out.getvalue()
  frames = [f for f in re.split(r"\r\x1b\[K", text) if f]
  # First render at t=1 (0.5 s after the first update): 2 of 4 done, half the bar.
  assert frames[0].startswith("eval  |############            |  2/4 (50%)  1 batch/s")
  assert "eval_loss 1.5\n" in text
  assert text.endswith("\n") and text.count("\n") == 2  # the log line and the final newline
  assert "|" + "#" * 24 + "|" in frames[-1] and "4/4" in frames[-1]


def test_unknown_total_and_disabled_bar():
  clock, out = FakeClock(), io.StringIO()
  bar = ProgressBar(total=None, stream=out, is_tty=False, min_interval_s=1.0, clock=clock)
  for i in range(3):
    clock.now = float(i)
    bar.update(2)
  assert "6 step" in bar.format_line() and "ETA" not in bar.format_line()
  quiet = io.StringIO()
  silent = ProgressBar(total=3, stream=quiet, enabled=False)
  silent.update(3)
  silent.close()
  assert quiet.getvalue() == ""


def test_slow_steps_show_seconds_per_step():
  clock = FakeClock()
  bar = ProgressBar(total=10, stream=io.StringIO(), is_tty=False, clock=clock)
  bar.update(1)
  clock.now = 8.0
  bar.update(2)
  assert "4 s/step" in bar.format_line()


def test_formatting_helpers():
  assert format_duration(59.4) == "0:59"
  assert format_duration(3725) == "1:02:05"
  assert format_duration(float("nan")) == "?"
  assert format_count(950) == "950"
  assert format_count(12_345) == "12.3k"
  assert format_count(4_560_000) == "4.56M"
