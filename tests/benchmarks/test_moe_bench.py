"""benchmarks/moe.py's two measurements at toy size, in this process: the ragged layer and the
dense reference agree (loss and gradients) and their ratios are those of their rows; the dense
teacher of the KD comparison has the MoE teacher's active parameters but the router's (hand
arithmetic from the tiny shapes)."""

import pytest

from benchmarks import moe as moe_bench


def test_layer_ragged_and_dense_agree_and_the_ratios_are_their_rows():
  s = {"tokens": 48, "embed_dim": 16, "expert_dim": 8, "reps": 1}
  res = moe_bench.measure_layer(s)
  assert res["check"]["pass"], res["check"]
  rows = {r["impl"]: r for r in res["rows"]}
  assert sorted(rows) == ["dense", "ragged"]
  # The dense path runs all 64 experts' three matmuls on every token (forward alone).
  assert rows["dense"]["flops"] >= 2 * 3 * 48 * 64 * 16 * 8
  assert res["temp_ragged_over_dense"] == pytest.approx(
      rows["ragged"]["temp_bytes"] / rows["dense"]["temp_bytes"])
  assert res["time_ragged_over_dense"] > 0
  assert rows["ragged"]["loss"] == pytest.approx(rows["dense"]["loss"], rel=1e-4)


def test_the_dense_teacher_has_the_moe_teachers_active_parameters_but_the_router():
  t = moe_bench.teachers()
  # tiny_moe: 2 layers of width 64, 4 experts of width 32, top-2; the dense one: MLP width 64.
  # Embedding + untied head 2 x 256 x 64, final norm 64; per layer attention 12,288, two norms
  # 128, MLP 3 x 64 x 64 (dense) or 4 experts x 3 x 64 x 32 + router 64 x 4 (MoE).
  assert moe_bench.active_params(t["dense"]) == 2 * 256 * 64 + 64 + 2 * (12_288 + 128 + 12_288)
  assert moe_bench.active_params(t["moe"]) == moe_bench.active_params(t["dense"]) + 2 * 64 * 4
  assert moe_bench.param_count(t["moe"]) == (moe_bench.active_params(t["moe"])
                                             + 2 * 2 * 3 * 64 * 32)
