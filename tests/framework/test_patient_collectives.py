"""Simulated CPU devices get patient collectives.

XLA:CPU runs each simulated device's share of a collective on its own thread and aborts the
whole process (rc 134, "Termination timeout ... only 7 of them arrived") when one thread reaches
the collective more than 20 s + 40 s after the first. 8 devices on 2 loaded cores can get there
with nothing wrong, so distillax raises that limit wherever it simulates devices
(distillax.main._preset_devices: `--devices`, launch_local's children, tests/conftest.py).

There is no test that trains under a deliberately loaded host: with four spinning processes
beside the suite, XLA:CPU's in-process all-reduce twice hung for good (7 of 8 device threads in
the rendezvous for the whole raised 540 s, so not a straggler), once in a fresh-clone run and once
in CI. That is a hang inside XLA's CPU runtime which no limit of ours can cure; the backends'
agreement is held on a normally busy host by tests/framework/test_backends.py.
"""

import os
import subprocess
import sys

from distillax.main import _preset_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WARN = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"
TERMINATE = "--xla_cpu_collective_call_terminate_timeout_seconds"
DEVICE_COUNT = "--xla_force_host_platform_device_count"
XLA_DEFAULT_LIMIT_S = 20 + 40  # warn, then terminate: XLA's defaults, seen in its abort message


def _xla_flags() -> dict[str, list[str]]:
  out: dict[str, list[str]] = {}
  for flag in os.environ.get("XLA_FLAGS", "").split():
    name, _, value = flag.partition("=")
    out.setdefault(name, []).append(value)
  return out


def test_simulated_devices_get_patient_collectives(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
  assert _preset_devices(["--config", "c.py", "--devices", "4"]) is None
  flags = _xla_flags()
  assert flags[DEVICE_COUNT] == ["4"] and flags["--xla_dump_to"] == ["/nowhere"]
  assert len(flags[WARN]) == len(flags[TERMINATE]) == 1
  assert int(flags[WARN][0]) + int(flags[TERMINATE][0]) >= 10 * XLA_DEFAULT_LIMIT_S

  # A child of launch_local: the device count is already in XLA_FLAGS, and the user's own
  # terminate timeout wins.
  monkeypatch.setenv("XLA_FLAGS", f"{DEVICE_COUNT}=2 {TERMINATE}=5")
  assert _preset_devices(["--config", "c.py"]) is None
  flags = _xla_flags()
  assert flags[TERMINATE] == ["5"] and len(flags[WARN]) == 1 and flags[DEVICE_COUNT] == ["2"]

  # No simulated devices (one CPU device, or accelerators): XLA_FLAGS stay as they are.
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
  assert _preset_devices(["--config", "c.py"]) is None
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/nowhere"


def test_the_cli_sets_xla_flags_before_jax_is_imported():
  """XLA reads XLA_FLAGS once, when JAX creates its CPU backend: distillax.main (and so
  tests/conftest.py) must not import JAX before _preset_devices has run."""
  code = "import sys, distillax.main; print(sorted(m for m in sys.modules if m == 'jax'))"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, check=True)
  assert out.stdout.strip() == "[]"
