"""A plain-text progress bar with ETA, rate, tokens/s and loss for every long job.

On a terminal it redraws one line in place (carriage return) a few times a second. When the
stream is not a terminal (a log file, CI, `nohup`), carriage returns would pile up into one
unreadable line, so it prints a complete line every `min_interval_s` seconds instead (default 30)
plus a final one. Rendering is rate-limited in both modes, so calling `update` every step costs
a clock read and a comparison.

Rates are measured from the first `update` call, not from construction: the first step of a jitted
job includes compilation, which would otherwise drag the ETA for minutes.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, TextIO

TTY_INTERVAL_S = 0.2
LOG_INTERVAL_S = 30.0
BAR_WIDTH = 24


def format_duration(seconds: float) -> str:
  """H:MM:SS (or M:SS under an hour); '?' when unknown."""
  if seconds is None or not math.isfinite(seconds) or seconds < 0:
    return "?"
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_count(value: float) -> str:
  """Compact human number: 950, 12.3k, 4.56M, 7.89G."""
  for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(value) >= threshold:
      return f"{value / threshold:.3g}{suffix}"
  return f"{value:.3g}"


class ProgressBar:
  """Progress of a job of `total` units (steps, batches); use as a context manager or call close().

  update(n, tokens=..., loss=..., **extra) advances by n units; tokens accumulate into tokens/s;
  loss and extra (name -> float) are shown as their latest values.
  """

  def __init__(self, total: int | None, desc: str = "", *, unit: str = "step", initial: int = 0,
               stream: TextIO | None = None, is_tty: bool | None = None,
               min_interval_s: float | None = None, enabled: bool = True,
               clock: Callable[[], float] = time.monotonic):
    self.total = total
    self.desc = desc
    self.unit = unit
    self.count = initial
    self.tokens = 0
    self.enabled = enabled
    self._stream = stream if stream is not None else sys.stdout
    if is_tty is None:
      is_tty = bool(getattr(self._stream, "isatty", lambda: False)())
    self.is_tty = is_tty
    self.min_interval_s = (min_interval_s if min_interval_s is not None
                           else TTY_INTERVAL_S if is_tty else LOG_INTERVAL_S)
    self._clock = clock
    self._start_time: float | None = None   # time of the first update
    self._start_count = initial
    self._start_tokens = 0
    self._last_render: float | None = None
    self._postfix: dict[str, float] = {}
    self._closed = False
    self._line_open = False  # a TTY line is drawn without its newline

  # -- measurement -------------------------------------------------------------------------
  def update(self, n: int = 1, *, tokens: int = 0, loss: float | None = None, **extra: float):
    """Advance by n units; render if min_interval_s has passed since the last render."""
    now = self._clock()
    if self._start_time is None:
      # The first update marks the start; the work it reports (compile included) is not timed.
      self._start_time = now
      self._start_count = self.count + n
      self._start_tokens = self.tokens + tokens
      self._last_render = now
    self.count += n
    self.tokens += tokens
    if loss is not None:
      self._postfix["loss"] = loss
    self._postfix.update(extra)
    if self.enabled and now - self._last_render >= self.min_interval_s:
      self._render(now)

  def rates(self, now: float | None = None) -> dict[str, float]:
    """units/s, tokens/s, elapsed and ETA seconds measured since the first update."""
    now = self._clock() if now is None else now
    if self._start_time is None:
      return {}
    elapsed = now - self._start_time
    done = self.count - self._start_count
    out = {"elapsed_s": elapsed}
    if elapsed > 0 and done > 0:
      out["units_per_s"] = done / elapsed
      out["tokens_per_s"] = (self.tokens - self._start_tokens) / elapsed
      if self.total is not None:
        out["eta_s"] = max(0, self.total - self.count) / out["units_per_s"]
    return out

  # -- rendering ---------------------------------------------------------------------------
  def format_line(self, now: float | None = None) -> str:
    """The text of one status line (no carriage return or newline)."""
    rates = self.rates(now)
    parts = [self.desc] if self.desc else []
    if self.total:
      fraction = min(1.0, self.count / self.total)
      if self.is_tty:
        filled = int(round(fraction * BAR_WIDTH))
        parts.append("|" + "#" * filled + " " * (BAR_WIDTH - filled) + "|")
      parts.append(f"{self.count}/{self.total} ({100 * fraction:.0f}%)")
    else:
      parts.append(f"{self.count} {self.unit}")
    if "units_per_s" in rates:
      per_s = rates["units_per_s"]
      parts.append(f"{per_s:.3g} {self.unit}/s" if per_s >= 1 else f"{1 / per_s:.3g} s/{self.unit}")
      if self.tokens:
        parts.append(f"{format_count(rates['tokens_per_s'])} tok/s")
    for name, value in self._postfix.items():
      parts.append(f"{name} {value:.4g}")
    timing = f"elapsed {format_duration(rates.get('elapsed_s', 0.0))}"
    if self.total is not None:
      timing += f" ETA {format_duration(rates.get('eta_s', float('nan')))}"
    parts.append(timing)
    return "  ".join(parts)

  def _render(self, now: float):
    self._last_render = now
    line = self.format_line(now)
    if self.is_tty:
      self._stream.write("\r\033[K" + line)
      self._line_open = True
    else:
      self._stream.write(line + "\n")
    self._stream.flush()

  def log(self, message: str):
    """Print a message on its own line without breaking the bar (the bar reappears at its next render)."""
    if self._line_open:
      self._stream.write("\r\033[K")
      self._line_open = False
    self._stream.write(message + "\n")
    self._stream.flush()

  def close(self):
    """Render the final state once and end the line."""
    if self._closed:
      return
    self._closed = True
    if self.enabled:
      self._render(self._clock())
      if self.is_tty:
        self._stream.write("\n")
        self._line_open = False
        self._stream.flush()

  def __enter__(self) -> "ProgressBar":
    return self

  def __exit__(self, *exc):
    self.close()
    return False
