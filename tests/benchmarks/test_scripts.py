"""Smoke tests: every benchmark script runs with --quick and its JSON holds figures that agree
with hand arithmetic (parameter counts, shard sizes, FLOPs) and with a second code path (the
hand-written step, the other backends)."""

import json
from pathlib import Path

import pytest

from distillax.models.presets import get_preset
from tests.support.bench import run_script_here, total_params

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, out: Path, *argv: str) -> dict:
  """The script runs in this process (8 devices); the child processes it starts for other
  device counts stay processes."""
  status, printed = run_script_here(ROOT / "benchmarks" / f"{name}.py",
                                    ["--quick", "--out", out, *argv])
  assert status == 0, printed[-3000:]
  return json.loads((out / f"{name}.json").read_text())


def train_flops(c, batch, seq) -> float:
  """3 x forward matmul FLOPs: projections, causal attention (half of L x L), output layer."""
  tokens = batch * seq
  proj = (c.embed_dim * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
          + 3 * c.embed_dim * c.mlp_dim)
  attn = 2 * 2 * batch * c.num_heads * c.head_dim * seq * seq / 2
  forward = c.num_layers * (2 * tokens * proj + attn) + 2 * tokens * c.embed_dim * c.vocab_size
  return 3 * forward


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("bench")


def test_step(out_dir):
  res = run_script("step", out_dir)
  (suite,) = res["backends"]
  assert {r["variant"] for r in suite["rows"]} == {"jit/dp", "pmap"}
  assert suite["loss_check"]["pass"]
  losses = [r["final_loss"] for r in suite["rows"]]
  assert max(losses) - min(losses) <= 1e-4 * abs(losses[0])
  ref = next(r for r in suite["rows"] if r["variant"] == "jit/dp")
  assert ref["ratio_to_jit_dp"] == pytest.approx(1.0)
  (over,) = res["overhead"]
  assert over["devices"] == 1
  # The hand-written flax+optax step computes the same training run as the framework.
  assert over["framework_losses"][0] == pytest.approx(over["minimal_losses"][0], rel=1e-5)
  assert over["framework_losses"][-1] == pytest.approx(over["minimal_losses"][-1], rel=1e-3)
  assert over["framework_losses"][-1] < over["framework_losses"][0]  # it trains
  assert over["framework_step_s"] > 0 and over["minimal_step_s"] > 0


def test_scaling(out_dir):
  res = run_script("scaling", out_dir, "--devices", "8")  # only its children use devices
  assert res["checks_total"] >= 3 and res["checks_passed"] == res["checks_total"]
  tiny = get_preset("tiny")
  p = total_params(tiny)
  rows = {(r["model"], r["strategy"]): r for r in res["rows"]}
  fsdp = rows[("tiny", "fsdp")]["state_bytes"]
  assert fsdp["params_total"] == 4 * p
  assert fsdp["params_per_device"] == 4 * p / 2
  # Adam's two fp32 moments plus two int32 step counters (adam, schedule).
  assert fsdp["opt_total"] == 2 * 4 * p + 2 * 4
  tp = rows[("tiny", "tp")]
  assert tp["mesh"] == "1x2"
  # Everything but the three norm scales carries a heads/kv_heads/mlp/vocab dim.
  sharded = p - (2 * tiny.num_layers + 1) * tiny.embed_dim
  assert tp["state_bytes"]["model_sharded_total"] == 4 * sharded
  assert tp["state_bytes"]["model_sharded_per_device"] == 4 * sharded / 2
  dp = rows[("tiny", "dp")]
  assert dp["collectives"]["all-reduce"]["count"] >= 1
  assert 1.0 <= dp["collectives"]["all-reduce"]["bytes"] / (4 * p) <= 1.01
  assert dp["model_flops_per_step"] == pytest.approx(
      train_flops(tiny, dp["global_batch"], dp["seq_len"]))
  for r in res["rows"]:
    if r["mode"] == "measured":
      assert r["step_s"] > 0 and r["tokens_per_s_per_device"] > 0
    else:
      assert "step_s" not in r and r["memory"]["argument_size_in_bytes"] > 0
  assert (out_dir / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_backends(out_dir):
  res = run_script("backends", out_dir)
  rows = {r["variant"]: r for r in res["rows"]}
  assert set(rows) == {"jit/dp", "shard_map", "vmap"}
  assert res["loss_check"]["pass"]
  for r in rows.values():
    assert r["compile_s"] > 0 and r["argument_bytes"] > 0 and r["step_s"] > 0
  # vmap emulates 8 workers on one device: that device holds the whole batch's activations,
  # while under jit/dp each device holds an eighth.
  assert rows["vmap"]["temp_bytes"] > rows["jit/dp"]["temp_bytes"]



def test_q8_0_activation(out_dir):
  """Every formulation of the q8_0 activation rounding gives the current one's values."""
  res = run_script("q8_0_activation", out_dir)
  variants = {r["variant"]: r for r in res["rows"]}
  assert {"v0_current", "floor_x2", "onehot_bf16max", "transposed"} <= set(variants)
  assert all(r["value_equal"] for name, r in variants.items() if name != "floor_x2")
  assert variants["v0_current"]["bitwise_equal"]
