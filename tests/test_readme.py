"""The documentation's Python API walkthrough (docs/python-api.md) runs as printed there (a user
copies it into a file)."""

import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_api_script() -> str:
  page = open(os.path.join(ROOT, "docs", "python-api.md")).read()
  return re.search(r"```python\n(.*?)```", page, re.S).group(1)


def test_python_api_script_distils_a_few_steps(tmp_path):
  script = tmp_path / "api.py"
  script.write_text(_python_api_script())
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # the script asks for its 8 devices itself
  out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=600,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  steps = re.findall(r"step (\d): loss ([\d.]+), KD ([\d.]+)", out.stdout)
  assert [int(s) for s, _, _ in steps] == [1, 2, 3], out.stdout
  assert all(math.isfinite(float(l)) and float(k) > 0 for _, l, k in steps)
  assert "'eval_logit_kd'" in out.stdout and "'eval_feature_pooling'" in out.stdout
