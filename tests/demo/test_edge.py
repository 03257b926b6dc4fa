"""The demo's edge rows: the QAT file judged on llama.cpp's reference kernels and run again as a
device runs it by default, and the ratios the report states computed as written. (That each
row's loss is distillax's packed loss is tests/edge/test_measurements.py.)"""

import math

import pytest

from distillax.demo import edge
from distillax.edge import measurements
from distillax.edge import runtime as gguf_runtime
from distillax.edge.export import write_gguf
from distillax.models.presets import get_preset
from distillax.models.init import create_model
from tests.edge.helpers import byte_eval_batches

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def batches():
  return byte_eval_batches()


def test_the_qat_file_also_runs_as_a_device_runs_it_by_default(batches, tmp_path):
  """The deployed row: the same q4_0 file on the kernels llama.cpp picks for this CPU, with a
  float16 KV cache, next to the judged row (reference kernels, float32 cache)."""
  model = create_model(get_preset("tiny", vocab_size=384), seed=3)
  path = tmp_path / "m.gguf"
  write_gguf(model, path, quant="q4_0", rules=((".*", "q4_0", "q8_0", None),))
  speed = {**edge.speed_tokens(batches, 4), "rounds": 1}
  segs = measurements.segments(batches[:1])
  rows = edge.measure({"q4_0_qat": str(path)}, segs, speed, [[1, 2]], 4, 1)
  assert list(rows) == ["q4_0_qat", edge.DEPLOYED_ROW]
  judged, deployed = rows["q4_0_qat"], rows[edge.DEPLOYED_ROW]
  for row in rows.values():
    assert (row["format"], row["source_stage"]) == ("q4_0", "student_qat_int4")
  # the judged row alone keeps what the report compares with distillax's own forward
  assert len(judged["segment_nll"]) == len(segs) and [len(g) for g in judged["greedy"]] == [4]
  assert (judged["kernels"], judged["kv_cache"]) == ("reference", "f32")
  assert (deployed["kernels"], deployed["kv_cache"]) == (gguf_runtime.deployment_kernels(), "f16")
  assert deployed["file_bytes"] == judged["file_bytes"]
  assert "greedy" not in deployed and "segment_nll" not in deployed
  # Measured 2e-4 nats/token apart here (f16 cache and kernel rounding); not the same run.
  assert abs(deployed["val_loss"] - judged["val_loss"]) < 1e-2
  assert "AVX" in judged["system_info"] or "NEON" in judged["system_info"]


def test_recovery():
  assert edge.recovery(ptq=2.0, qat=1.25, full=1.0) == pytest.approx(0.75)
  assert edge.recovery(ptq=2.0, qat=2.5, full=1.0) == pytest.approx(-0.5)  # QAT worse: < 0
  assert math.isnan(edge.recovery(ptq=1.0, qat=0.9, full=1.0))  # PTQ costs nothing
