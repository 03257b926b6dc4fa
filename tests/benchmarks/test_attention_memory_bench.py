"""Smoke test of benchmarks/attention_memory.py --quick: both attention paths compile at every
length, the reference path's temporaries hold at least one layer's fp32 (L, S) scores (hand
arithmetic from the shapes), at the checked length blockwise's hold less than one such array
(and at most a quarter of the reference's), and only attention differs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("attention_memory")
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_memory.py"),
                         "--quick", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=900, env=os.environ | FAST_COMPILE)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "vs reference" in proc.stdout and "PASS" in proc.stdout
  text = (out / "attention_memory_quick.json").read_text()
  return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))


def test_both_paths_at_every_length_and_the_check(result):
  lengths = result["settings"]["lengths"]
  rows = {(r["impl"], r["seq_len"]): r for r in result["rows"]}
  assert set(rows) == {(i, n) for i in ("reference", "blockwise") for n in lengths}
  cfg = result["config"]
  for n in lengths:
    ref, blk = rows[("reference", n)], rows[("blockwise", n)]
    scores = cfg["num_heads"] * n * n * 4  # one layer's fp32 scores at batch 1
    assert ref["temp_bytes"] >= scores
    # Same parameters, optimizer state and batch: only the attention path changed.
    assert blk["argument_bytes"] == ref["argument_bytes"]
    assert blk["temp_ratio_to_reference"] == pytest.approx(blk["temp_bytes"] / ref["temp_bytes"])
  check = result["check"]
  n = check["seq_len"]
  assert rows[("blockwise", n)]["temp_bytes"] < cfg["num_heads"] * n * n * 4  # < one score array
  assert check["pass"] and check["ratio"] <= 0.25
  assert check["ratio"] == rows[("blockwise", check["seq_len"])]["temp_ratio_to_reference"]
