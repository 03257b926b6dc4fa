"""Smoke test of benchmarks/edge.py --quick: every format runs in llama.cpp in interleaved rounds,
the ratios are paired per round, and the file sizes agree with ggml's block arithmetic on the
model's shapes (f16: 2 bytes per weight; q8_0: 34 bytes per 32; q4_0: 18 bytes per 32)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from distillax.edge import runtime as gguf_runtime

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ["f32", "f16", "q8_0", "q4_0"]
BYTES_PER_WEIGHT = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("edge_bench")
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "edge.py"), "--quick",
                         "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "decode tok/s" in proc.stdout  # the table was printed
  return json.loads((out / "edge.json").read_text())


def test_every_format_timed_in_rounds_with_paired_ratios(result):
  rows = {r["format"]: r for r in result["rows"]}
  assert list(rows) == FORMATS
  rounds = result["settings"]["rounds"]
  for r in rows.values():
    assert len(r["prompt_s"]) == len(r["decode_s"]) == rounds
    assert all(t > 0 for t in r["prompt_s"] + r["decode_s"])
    per_round = [a / b for a, b in zip(rows["f32"]["decode_s"], r["decode_s"])]
    assert min(per_round) - 1e-12 <= r["decode_speedup_vs_f32"] <= max(per_round) + 1e-12
    assert 0 < r["rss_before_load_bytes"] <= r["peak_rss_bytes"]
    # measured as deployed: the kernels llama.cpp picks here, named with its system info
    assert r["kv_cache"] == "f16" and r["kernels"] == gguf_runtime.deployment_kernels()
    assert "AVX" in r["system_info"] or "NEON" in r["system_info"]
  assert rows["f32"]["decode_speedup_vs_f32"] == pytest.approx(1.0)
  assert rows["f32"]["peak_rss_ratio_to_f32"] == pytest.approx(1.0)
  assert result["checks_passed"] == result["checks_total"] >= 1


def test_file_sizes_follow_the_block_formats(result):
  (m,) = result["models"].values()
  d, f, layers, vocab = m["embed_dim"], m["mlp_dim"], m["num_layers"], m["vocab_size"]
  attn = d * m["head_dim"] * (2 * m["num_heads"] + 2 * m["num_kv_heads"])
  matmuls = layers * (attn + 3 * d * f) + (0 if m["tie_embeddings"] else d * vocab)
  embedding = vocab * d
  # f16 stores the embedding in f16 too; q8_0 / q4_0 quantize matmul weights only (an untied
  # embedding is a lookup table, kept f32); norms stay f32 everywhere.
  quantized = {"f16": matmuls + embedding,
               "q8_0": matmuls + (embedding if m["tie_embeddings"] else 0)}
  quantized["q4_0"] = quantized["q8_0"]
  size = {r["format"]: r["file_bytes"] for r in result["rows"]}
  n_tensors = 2 + 9 * layers + (0 if m["tie_embeddings"] else 1)
  for fmt, n in quantized.items():
    saved = n * (4 - BYTES_PER_WEIGHT[fmt])
    # the metadata is the same; each tensor's data is aligned to 32 bytes
    assert math.isclose(size["f32"] - size[fmt], saved, abs_tol=32 * n_tensors), fmt
