"""Smoke test of benchmarks/on_policy.py --quick, its distillax half (TRL needs its own venv):
every part is timed, the figures agree with hand arithmetic, the step trains."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("on_policy_bench")
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "on_policy.py"), "--quick",
                         "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=900, env=os.environ | FAST_COMPILE)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "share of step" in proc.stdout and "Sampler alone" in proc.stdout
  text = (out / "on_policy.json").read_text()
  return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))


def test_step_split_and_rates(result):
  s, d = result["settings"], result["distillax"]
  assert result["trl"] is None and result["checks"] == []
  sec = d["seconds"]
  for name in ("step", "sampling", "scoring", "sampler"):
    assert len(d["seconds_all"][name]) == s["reps"] and sec[name] > 0
  assert d["sampled_tokens"] == s["batch"] * s["max_new_tokens"]
  assert sec["update"] == pytest.approx(max(sec["step"] - sec["sampling"] - sec["scoring"], 0))
  assert d["step_tokens_per_s"] == pytest.approx(d["sampled_tokens"] / sec["step"])
  assert d["sampling_tokens_per_s"] == pytest.approx(d["sampled_tokens"] / sec["sampling"])
  assert d["sampler_tokens_per_s"] == pytest.approx(d["sampled_tokens"] / sec["sampler"])
  for k in ("sampling", "scoring", "update"):
    assert d["share"][k] == pytest.approx(sec[k] / sec["step"])
  assert all(math.isfinite(x) for x in d["losses"]) and len(d["losses"]) >= 2
