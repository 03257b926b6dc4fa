"""Two real local processes x 4 CPU devices form one 8-device mesh and train like one process."""

import json
import os
import sys

import numpy as np

from distillax.launch_local import launch
from tests.framework.two_process_worker import STEPS
from tests.support.engines import packed_batches, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_two_processes_match_one_process_with_eight_devices(tmp_path):
  out = tmp_path / "losses.json"
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  status = launch([sys.executable, "-m", "tests.framework.two_process_worker", str(out)],
                  num_processes=2, devices_per_process=4, timeout_s=600, env=env,
                  log_dir=str(tmp_path / "logs"))
  logs = "".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").iterdir()))
  assert status == 0, logs
  result = json.loads(out.read_text())
  assert result["processes"] == 2
  single, _, _ = run_training("jit", "fsdp", (8, 1), packed_batches(STEPS))
  np.testing.assert_allclose(result["losses"], single, rtol=1e-5)
  # Every preset computes the same run, so the per-step dp losses match the fsdp ones too.
  np.testing.assert_allclose(result["per_step_losses"], single, rtol=1e-5)
