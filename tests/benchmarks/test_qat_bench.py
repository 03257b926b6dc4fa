"""Smoke test of benchmarks/qat.py --quick: it runs every variant through the trainer's set-up,
and its figures agree with hand arithmetic on the model's shapes (parameter, adapter, optimizer
and nf4 storage counts, per-device batch bytes) and with what LoRA and QAT must do to the loss."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench import matmul_weights, total_params

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ["plain", "qat_int8", "qat_int4", "lora", "qlora_nf4"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("qat_bench")
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "qat.py"), "--quick",
                         "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "vs plain" in proc.stdout  # the table was printed
  res = json.loads((out / "qat.json").read_text())
  res["by_name"] = {r["variant"]: r for r in res["rows"]}
  return res


def test_every_variant_timed(result):
  rows = result["by_name"]
  assert list(rows) == VARIANTS
  assert rows["plain"]["ratio_to_plain"] == pytest.approx(1.0)
  for r in rows.values():
    assert len(r["step_s_all"]) == result["settings"]["reps"]
    assert r["step_s"] > 0 and math.isfinite(r["ratio_to_plain"]) and r["ratio_to_plain"] > 0
    # median of per-round ratios lies within the range of those ratios
    per_round = [a / b for a, b in zip(r["step_s_all"], rows["plain"]["step_s_all"])]
    assert min(per_round) - 1e-12 <= r["ratio_to_plain"] <= max(per_round) + 1e-12
  assert result["checks_total"] >= 15 and result["checks_passed"] == result["checks_total"]


def test_trainable_and_optimizer_state(result):
  m, rows = result["model"], result["by_name"]
  p = total_params(m)
  for name in ("plain", "qat_int8", "qat_int4"):
    assert rows[name]["trainable_params"] == p  # fake quant adds no parameters
  rank = rows["lora"]["lora"]["rank"]
  adapters = m["num_layers"] * rank * sum(math.prod(c) + math.prod(o)
                                          for c, o in matmul_weights(m).values())
  for name in ("lora", "qlora_nf4"):
    assert rows[name]["trainable_params"] == adapters
  for r in rows.values():
    # AdamW: two fp32 moments per trainable parameter, plus the int32 step counts of Adam and
    # of the learning-rate schedule.
    assert r["opt_state_bytes"] == 2 * 4 * r["trainable_params"] + 2 * 4
    assert r["param_bytes"] == 4 * r["trainable_params"]


def test_frozen_storage(result):
  """LoRA freezes the fp32 model; QLoRA stores adapted weights as packed nf4 codes (two per
  byte) with one fp32 scale per tile of the last contracted dim per output channel."""
  m, rows = result["model"], result["by_name"]
  assert rows["plain"]["frozen_bytes"] == 0
  assert rows["lora"]["frozen_bytes"] == 4 * total_params(m)
  tile = rows["qlora_nf4"]["lora"]["base_tile_size"]
  adapted = scales = 0
  for contracted, out in matmul_weights(m).values():
    adapted += math.prod(contracted) * math.prod(out)
    scales += math.prod(out) * contracted[-1] // tile
  adapted, scales = m["num_layers"] * adapted, m["num_layers"] * scales
  expected = 4 * (total_params(m) - adapted) + adapted // 2 + 4 * scales
  assert rows["qlora_nf4"]["frozen_bytes"] == expected


def test_compiled_memory(result):
  settings, rows = result["settings"], result["by_name"]
  data = result["machine"]["device_count"] // settings["mesh_model"]
  # inputs, targets, segments, positions (int32) and the loss mask (fp32), batch split on data
  batch_bytes = 5 * 4 * settings["batch"] // data * settings["seq_len"]
  for r in rows.values():
    assert r["batch_bytes_per_device"] == batch_bytes
    assert r["argument_bytes"] == r["state_bytes_per_device"] + batch_bytes
    assert r["alias_bytes"] == r["state_bytes_per_device"]  # the state is donated
    assert r["temp_bytes"] > 0
  # Only the frozen base differs between them: nf4 codes take less device memory.
  assert rows["qlora_nf4"]["argument_bytes"] < rows["lora"]["argument_bytes"]
  # LoRA's per-device state (no moments for the base) is below plain training's.
  assert rows["lora"]["state_bytes_per_device"] < rows["plain"]["state_bytes_per_device"]


def test_losses(result):
  rows = result["by_name"]
  plain = rows["plain"]["first_loss"]
  rel = {n: abs(r["first_loss"] - plain) / plain for n, r in rows.items()}
  # B starts at zero: the LoRA model's first forward is the base model's.
  assert rel["lora"] <= 1e-5
  # Fake quantization is on, and int4 rounding moves the loss more than int8.
  assert 0 < rel["qat_int8"] < rel["qat_int4"] < 0.1
  assert 0 < rel["qlora_nf4"] < 0.1
  for r in rows.values():
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["final_loss"] < r["first_loss"]
