"""Smoke test of benchmarks/kd_vocab.py --quick (no Tunix): every distillax variant is timed
and sized, the figures agree with hand arithmetic (tokens/s, the auto chunk, the bytes the
arguments alone take) and the largest-batch search brackets the memory limit."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from distillax.models.config import get_preset

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ["unchunked", "chunk256", "default"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("kd_vocab_bench")
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kd_vocab.py"), "--quick",
                         "--no-tunix", "--out", str(out)], cwd=ROOT, capture_output=True,
                        text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "max batch" in proc.stdout  # the table was printed
  return json.loads((out / "kd_vocab.json").read_text())


def params(cfg) -> int:
  """Parameters of a tied-embedding decoder from its config: q, k, v, o, gated MLP, 2 norms per
  block, the embedding, the final norm."""
  block = (cfg.embed_dim * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
           + 3 * cfg.embed_dim * cfg.mlp_dim + 2 * cfg.embed_dim)
  return cfg.num_layers * block + cfg.vocab_size * cfg.embed_dim + cfg.embed_dim


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
  for vocab in s["vocabs"]:
    first = [r["first_loss"] for r in result["rows"] if r["vocab"] == vocab]
    assert max(first) - min(first) <= 1e-6 * abs(first[0])  # same weights, same batch
  assert all(c["pass"] for c in result["checks"])


def test_chunks(result):
  s = result["settings"]
  tokens = s["batch"] * s["seq_len"]
  for r in result["rows"]:
    if r["system"] == "unchunked":
      assert r["chunk_tokens"] is None
    elif r["system"] == "chunk256":
      assert r["chunk_tokens"] == min(256, tokens)
    else:  # auto: the most tokens whose fp32 logits of one model fit 128 MiB
      assert r["chunk_size"] == -1
      assert r["chunk_tokens"] == min(tokens, 128 * 2**20 // (4 * r["vocab"]))


def test_memory_and_the_largest_batch(result):
  s = result["settings"]
  limit = s["memory_limit"]
  for r in result["rows"]:
    student = get_preset("demo_student").replace(vocab_size=r["vocab"])
    teacher = get_preset("demo_teacher").replace(vocab_size=r["vocab"])
    # fp32 student params and two Adam moments, fp32 teacher params: all live in the step
    assert r["peak_bytes"] >= 4 * (3 * params(student) + params(teacher))
    peaks = {int(b): p for b, p in r["peaks_by_batch"].items()}
    assert peaks[s["batch"]] == r["peak_bytes"]
    best = r["max_batch"]
    assert best >= 1 and peaks[best] <= limit
    assert best == s["max_batch_cap"] or peaks[best + 1] > limit
    ordered = [peaks[b] for b in sorted(peaks)]
    assert ordered == sorted(ordered)  # more rows never take less memory
