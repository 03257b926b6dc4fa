"""Smoke test of benchmarks/kd_vocab.py --quick (no Tunix; tiny bodies, one vocabulary): every
distillax variant is timed and sized, chunked and unchunked KD start from the same loss, the
figures agree with hand arithmetic (tokens/s, the chunks, the bytes the arguments alone take)
and the largest-batch search brackets the memory limit; the search itself is checked against
peak functions with known answers."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.kd_vocab import largest_batch
from tests.support.bench import FAST_COMPILE, total_params

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ["unchunked", "chunk256", "default"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("kd_vocab_bench")
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kd_vocab.py"), "--quick",
                         "--no-tunix", "--out", str(out)], cwd=ROOT, capture_output=True,
                        text=True, timeout=900, env=os.environ | FAST_COMPILE)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "max batch" in proc.stdout  # the table was printed
  text = (out / "kd_vocab.json").read_text()
  return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))


def test_every_variant_timed_and_the_same_loss(result):
  s = result["settings"]
  assert not result["tunix"]
  assert [(r["vocab"], r["system"]) for r in result["rows"]] == [
      (v, name) for v in s["vocabs"] for name in SYSTEMS]
  for r in result["rows"]:
    assert r["tokens"] == s["batch"] * s["seq_len"]
    assert len(r["step_s_all"]) == s["reps"] and r["step_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"])
    assert math.isfinite(r["first_loss"]) and r["cpu_s"] > 0
    assert r["student"]["tie_embeddings"] and r["student"]["vocab_size"] == r["vocab"]
  for vocab in s["vocabs"]:
    first = [r["first_loss"] for r in result["rows"] if r["vocab"] == vocab]
    assert max(first) - min(first) <= 1e-6 * abs(first[0])  # same weights, same batch
  assert all(c["pass"] for c in result["checks"]) and len(result["checks"]) == len(s["vocabs"])


def test_chunks(result):
  s = result["settings"]
  tokens = s["batch"] * s["seq_len"]
  for r in result["rows"]:
    if r["system"] == "unchunked":
      assert r["chunk_tokens"] is None
    elif r["system"] == "chunk256":
      assert r["chunk_tokens"] == 256 < tokens  # two chunks: the chunked path really ran
    else:  # auto: the most positions of every row whose fp32 logits of one model fit 128 MiB
      assert r["chunk_size"] == -1
      positions = max(1, min(s["seq_len"], 128 * 2**20 // (4 * s["batch"] * r["vocab"])))
      assert r["chunk_tokens"] == s["batch"] * positions


def test_memory_and_the_largest_batch(result):
  s = result["settings"]
  limit = s["memory_limit"]
  searched = [r for r in result["rows"] if r["max_batch"] is not None]
  assert [r["system"] for r in searched] == list(s["max_batch_systems"])
  for r in result["rows"]:
    # fp32 student params and two Adam moments, fp32 teacher params: all live in the step
    assert r["peak_bytes"] >= 4 * (3 * total_params(r["student"]) + total_params(r["teacher"]))
    assert {int(b): p for b, p in r["peaks_by_batch"].items()}[s["batch"]] == r["peak_bytes"]
  for r in searched:
    peaks = {int(b): p for b, p in r["peaks_by_batch"].items()}
    best = r["max_batch"]
    assert best == 0 or peaks[best] <= limit
    assert best == s["max_batch_cap"] or peaks[best + 1] > limit
    ordered = [peaks[b] for b in sorted(peaks)]
    assert ordered == sorted(ordered)  # more rows never take less memory


@pytest.mark.parametrize("peak,limit,cap,want", [
    (lambda b: 100 + 7 * b, 1000, 4096, 128),  # affine: the interpolation lands on it
    (lambda b: 100 + b * b, 5000, 4096, 70),  # convex
    (lambda b: 10 ** 9 if b > 37 else b, 10 ** 6, 4096, 37),  # a cliff
    (lambda b: b, 10 ** 9, 300, 300),  # everything fits: the cap
    (lambda b: 10 ** 9, 10, 64, 0),  # nothing fits
])
def test_largest_batch_search(peak, limit, cap, want):
  calls = []
  best, peaks = largest_batch(lambda b: calls.append(b) or peak(b), limit, 4, cap)
  assert best == want
  assert all(peaks[b] == peak(b) for b in peaks) and len(calls) == len(set(calls))
  assert len(calls) <= 2 * math.log2(cap) + 2  # a search, not a scan
