"""Training on 8 simulated CPU devices survives a busy host, with the same numbers.

XLA:CPU runs each simulated device's share of a collective on its own thread and aborts the
whole process (rc 134, "Termination timeout ... only 7 of them arrived") when one thread reaches
the collective more than 20 s + 40 s after the first. 8 devices on 2 loaded cores can get there
with nothing wrong, so distillax raises that limit wherever it simulates devices
(distillax.main._preset_devices: `--devices`, launch_local's children, tests/conftest.py).
A straggler that late cannot be forced without a clock; what is checked here is that the
collective backends finish with jit's numbers while the host is oversubscribed.

The loaded runs happen in a child process (under_load_worker.py): if XLA:CPU aborts anyway, the
child dies, not this pytest-xdist worker, and the failure carries the child's stderr (XLA's
abort message and stack) instead of "node down: Not properly terminated".
"""

import contextlib
import os
import subprocess
import sys

import jax
import numpy as np

from distillax.main import _preset_devices
from distillax.models.init import create_model
from tests.support.engines import mesh_and_rules, packed_batches, train_copy
from tests.support.models import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WARN = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"
TERMINATE = "--xla_cpu_collective_call_terminate_timeout_seconds"
DEVICE_COUNT = "--xla_force_host_platform_device_count"
XLA_DEFAULT_LIMIT_S = 20 + 40  # warn, then terminate: XLA's defaults, seen in its abort message
BUSY_LOOPS = 4  # with the suite's own process: load >= 5 on the 2-core machine


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


@contextlib.contextmanager
def busy_host():
  """BUSY_LOOPS processes spinning on the CPU while the block runs; each also stops by itself
  once this process is gone, so a killed test run leaves none behind."""
  spin = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n  pass\n"
  spinners = [subprocess.Popen([sys.executable, "-c", spin, str(os.getpid())])
              for _ in range(BUSY_LOOPS)]
  try:
    yield
  finally:
    for p in spinners:
      p.kill()
    for p in spinners:
      p.wait()


def test_collective_backends_finish_and_agree_with_jit_under_load(tmp_path):
  batches = packed_batches(3)
  mesh, rules = mesh_and_rules("dp", 8)
  model = create_model(TINY, mesh=mesh, rules=rules, seed=0)
  ref_losses, ref_params = train_copy("jit", model, mesh, rules, batches)
  assert np.all(np.isfinite(ref_losses)) and ref_losses[-1] < ref_losses[0]
  # Each step of both all-reduces its gradients over 8 devices sharing 2 cores with the spinners.
  out = tmp_path / "runs.npz"
  worker = os.path.join(ROOT, "tests", "framework", "under_load_worker.py")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
      "PYTHONPATH")])))
  with busy_host():
    proc = subprocess.run([sys.executable, worker, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, (f"the loaded child exited {proc.returncode}; its stderr ends:\n"
                                f"{proc.stderr[-6000:]}")
  with np.load(out, allow_pickle=False) as runs:
    for backend in ("pmap", "shard_map"):
      np.testing.assert_allclose(runs[f"{backend}/losses"], ref_losses, rtol=1e-5,
                                 err_msg=backend)
      for path, b in jax.tree_util.tree_leaves_with_path(ref_params):
        key = f"{backend}/params{jax.tree_util.keystr(path)}"
        np.testing.assert_allclose(runs[key], b, atol=1e-5, rtol=0, err_msg=key)
