"""benchmarks/accelerator.py on this CPU: every row's candidates are compiled, run and the
fastest kept, with FLOPs worked out by hand; the on-policy row samples exactly its tokens and
times sampling apart from the update, its decode roofline checked against a hand-worked figure;
the QLoRA row trains the adapters alone; --expect-gpu refuses a CPU fallback in one line
(through scripts/accelerator_run.sh, as a user runs it), and a backend that cannot start fails in
one line too."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import accelerator
from benchmarks.lib import on_policy_lever
from distillax.models.presets import get_preset
from tests.support.bench import FAST_COMPILE, matmul_params, matmul_weights

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accelerator.py"


def run(args, env=None):
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=900, env=env)


TINY = get_preset("tiny")
TINY_TEACHER = get_preset("tiny", num_layers=4, embed_dim=96, num_heads=6, num_kv_heads=2,
                          mlp_dim=192)


def forward_per_token(cfg, length: int) -> int:
  """2N + 2 L H Q T: a forward's model FLOPs per token (half of each T x T product)."""
  return 2 * matmul_params(cfg) + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  """One --quick run of the train, KD, on-policy, QLoRA and draft rows (one process, one
  probe)."""
  path = tmp_path_factory.mktemp("acc") / "acc.json"
  proc = run(["--quick", "--rows", "train,kd,on_policy,qlora,draft", "--json", str(path),
              "--threads", "2"], env={**os.environ, **FAST_COMPILE})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  res = json.loads(path.read_text())
  return proc, res, {r["name"]: r for r in res["rows"]}


def test_quick_rows_on_cpu(quick):
  """The train, KD and QLoRA rows at quick sizes: each candidate ran, the best is the fastest,
  and its model FLOPs are 6N + 6 L H Q T per token for the student (half of each T x T product:
  the causal convention) plus 2N + 2 L H Q T for the frozen teacher's forward."""
  proc, res, rows = quick
  probe = res["probe"]
  assert probe["backend"] == "cpu" and probe["versions"]["jax"] == probe["jax"]
  assert probe["matmul"]["best_flops_per_s"] >= probe["matmul"]["median_flops_per_s"] > 0
  assert probe["hbm_bandwidth"] is None  # a CPU has no HBM: no decode roofline
  assert sorted(rows) == ["draft", "kd", "on_policy", "qlora", "train"]
  for name in ("train", "kd", "qlora"):
    row = rows[name]
    ran = [c for c in row["candidates"] if c["status"] == "ok"]
    assert ran and row["best"] == max(ran, key=lambda c: c["tokens_per_s"])
    best = row["best"]
    tokens, T = best["batch"] * best["seq_len"], best["seq_len"]
    per_token = 3 * forward_per_token(TINY, T)
    if name == "kd":
      per_token += forward_per_token(TINY_TEACHER, T)
    assert best["model_flops"] == pytest.approx(tokens * per_token)
    assert best["tokens_per_s"] == pytest.approx(tokens / best["step_s"])
    assert best["mfu_causal"] == pytest.approx(
        best["model_flops"] / best["step_s"] / probe["peak_flops"])
    assert best["final_loss"] < best["first_loss"]  # it trains
  assert "Each row at its fastest candidate" in proc.stdout and "kd (real)" in proc.stdout


def test_quick_qlora_row_trains_the_adapters_alone(quick):
  """configs/qlora.py:tiny on the tiny student: rank-8 adapters on every block matmul, A (in x 8)
  and B (8 x out), are all the optimizer updates (the nf4 base is frozen)."""
  _, _, rows = quick
  best = rows["qlora"]["best"]
  assert best["options"]["lora"] == "qlora"
  rank = 8
  adapters = TINY.num_layers * sum(math.prod(c) * rank + rank * math.prod(o)
                                   for c, o in matmul_weights(TINY).values())
  assert adapters == 2 * (6 * 64 * 8 + 8 * (64 + 32 + 32 + 64 + 128 + 128) + 128 * 8 + 8 * 64)
  assert best["trainable_params"] == adapters
  assert rows["train"]["best"]["trainable_params"] == TINY.num_layers * sum(
      math.prod(c) * math.prod(o) for c, o in matmul_weights(TINY).values()) + (
      2 * TINY.vocab_size * TINY.embed_dim + (2 * TINY.num_layers + 1) * TINY.embed_dim)


def test_quick_draft_row_trains_the_eagle3_head(quick):
  """The draft row at quick sizes (2 x 64 tokens) on the tiny pair's teacher (D 96, 4 layers,
  6 heads of 16, 2 kv heads, MLP 192, 256 ids) as the frozen target: the optimizer updates the
  head's fc (3 x 96 -> 96), its q/k/v (2 x 96 wide in), o, MLP and four norms, never the
  embedding or the LM head (the target's); the model FLOPs per token are the target's forward
  with its output layer at the 64 draft ids once per TTT step (3), the fc once (forward and
  weight gradient), and 3 TTT steps of the rest of the head's forward and backward (3x): its
  layer, its LM head, and attention over 64 / 2 + 3 positions."""
  _, res, rows = quick
  best = rows["draft"]["best"]
  assert (best["kind"], best["batch"], best["seq_len"]) == ("draft", 2, 64)
  D, H, G, K, F, V = 96, 6, 2, 16, 192, 64
  matmul = 3 * D * D + 2 * D * (H + 2 * G) * K + H * K * D + 3 * D * F
  assert best["trainable_params"] == matmul + 4 * D
  target = forward_per_token(TINY_TEACHER, 64) - 2 * 256 * D + 3 * 2 * D * V
  fc = 2 * 3 * D * D  # once per position: forward and weight gradient (no input gradient)
  head = 2 * fc + 3 * 3 * (2 * (matmul - 3 * D * D + D * V) + 4 * H * K * (32 + 3))
  assert best["model_flops"] == pytest.approx(2 * 64 * (target + head))
  assert best["mfu_causal"] == pytest.approx(
      best["model_flops"] / best["step_s"] / res["probe"]["peak_flops"])
  assert best["final_loss"] < best["first_loss"]


def test_quick_on_policy_row_times_sampling_apart(quick):
  """The on-policy row at quick sizes (4 prompts of 48 tokens, 16 sampled each, all 4 at once,
  learned 2 at a time): the JSON records both batches and the sampler's compiled memory; every
  timed step sampled exactly 4 x 16 tokens; the update is the step less its sampling; the rates
  are those tokens over each time; the model FLOPs are the student's decode forward, its
  scoring forward and backward and the teacher's forward over 4 x (48 + 16 - 1) tokens; on CPU
  there is no HBM bandwidth, so no roofline, but the bytes a decode step reads are worked out:
  the weights (fp32 stored and computed) less the untied input embedding, plus 4 rows of KV
  cache (2 layers x K and V x 2 kv heads x 16 x 4 bytes a position) at the mean context
  48 + 15 / 2."""
  proc, _, rows = quick
  best = rows["on_policy"]["best"]
  assert (best["kind"], best["batch"], best["prompt_len"], best["new_tokens"]) == (
      "on_policy", 4, 48, 16)
  assert (best["sampling_batch"], best["micro_batch"], best["accum_steps"]) == (4, 2, 2)
  assert best["sampler_memory"]["peak_bytes"] > 0
  assert best["sampled_tokens"] == 4 * 16
  assert best["update_s"] == pytest.approx(float(np.median(
      np.subtract(best["step_s_all"], best["sampling_s_all"]))))
  assert best["sampled_tokens_per_s"] == pytest.approx(64 / best["sampling_s"])
  assert best["tokens_per_s"] == pytest.approx(64 / best["step_s"])
  scored = 4 * (48 + 16 - 1)
  assert best["model_flops"] == pytest.approx(scored * (
      4 * forward_per_token(TINY, 63) + forward_per_token(TINY_TEACHER, 63)))
  assert best["hbm_bandwidth"] is None and best["roofline_tokens_per_s"] is None
  weights = (2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 256 * 64 + 64) * 4
  assert best["decode_weight_bytes"] == weights
  assert best["kv_bytes_per_position"] == 2 * 2 * 2 * 16 * 4
  assert best["decode_bytes_per_step"] == pytest.approx(weights + 4 * 512 * (48 + 7.5))
  assert "On-policy: sampling and the update apart" in proc.stdout


def test_decode_roofline_of_the_real_student_on_a_v5e():
  """Qwen3-0.6B (fp32 master weights read in bf16, tied embedding, bf16 KV cache), 16 rows,
  512-token prompts and 512 new tokens, on a v5e's 819 GB/s, worked by hand:
    weights: embedding 151936 x 1024 = 155,582,464; each of 28 blocks q 1024 x 2048, k and v
    1024 x 1024, o 2048 x 1024, MLP 3 x 1024 x 3072, q/k norms 2 x 128, two norms 2 x 1024 =
    15,730,944; final norm 1024: 596,049,920 parameters, 1,192,099,840 bytes in bf16;
    KV cache: 2 x 28 layers x 8 kv heads x 128 x 2 bytes = 114,688 bytes a position;
    a decode step reads 1,192,099,840 + 16 x 114,688 x (512 + 511 / 2) = 2,600,468,480 bytes;
    16 tokens a step: 16 x 819e9 / 2,600,468,480 = 5,039.1 tokens/s."""
  cfg = get_preset("qwen3-0.6b", param_dtype="float32", dtype="bfloat16")
  assert on_policy_lever.decode_weight_bytes(cfg) == 1_192_099_840
  assert on_policy_lever.kv_bytes_per_position(cfg) == 114_688
  roof = on_policy_lever.decode_roofline(1_192_099_840, 114_688, 16, 512, 512, 819e9)
  assert roof["decode_bytes_per_step"] == pytest.approx(2_600_468_480)
  assert roof["roofline_tokens_per_s"] == pytest.approx(5039.1, abs=0.1)


def test_every_row_names_candidates_of_its_own_pair():
  for row in accelerator.ROWS:
    assert row.pair in accelerator.tpu_levers.lever_grid.PAIRS, row.name
    for c in row.candidates:
      v = accelerator.tpu_levers.lever_grid.Variant.parse(
          accelerator.variant_of(row, c, quick=False), 2048)
      assert v.option("pair") == row.pair and v.kind in ("train", "kd", "on_policy", "draft")
      if v.kind == "on_policy":  # both batches: the micro-batch divides the sampling batch
        assert on_policy_lever.accum_steps(v) * on_policy_lever.micro_batch(v) == v.batch


def test_run_script_with_expect_gpu_on_cpu_refuses_and_leaves_its_files_in_out(tmp_path):
  """--expect-gpu on this CPU, through the run script (which runs accelerator.py as a user
  does): one line, exit 3, no row run, and the script's files in $OUT."""
  out, wheels = tmp_path / "out", tmp_path / "no_wheels"
  env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "ACCEL_WHEELS": str(wheels),
         "ACCEL_TIMEOUT_S": "300"}
  proc = subprocess.run([str(ROOT / "scripts" / "accelerator_run.sh"), "--quick",
                         "--expect-gpu"], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=400)
  assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert sorted(p.name for p in out.iterdir()) == [
      "accelerator.json", "accelerator.log", "accelerator_deps.txt"]
  log = (out / "accelerator.log").read_text()
  (line,) = [ln for ln in log.splitlines() if ln.startswith("accelerator.py:")]
  assert line.startswith("accelerator.py: FAIL: --expect-gpu, but JAX ")
  assert "runs on 'cpu'" in line and "fell back to CPU" in line
  res = json.loads((out / "accelerator.json").read_text())
  assert res["status"] == "refused" and res["rows"] == []
  assert res["probe"]["backend"] == "cpu"
  # This venv holds every dependency inside pyproject's ranges: nothing to install.
  deps = (out / "accelerator_deps.txt").read_text().splitlines()
  assert deps[-1] == "nothing to install"
  assert any(line.startswith("keep    jax: image ") for line in deps)


def test_a_backend_that_cannot_start_fails_in_one_line(tmp_path):
  """A plugin that fails at start-up (here: a platform JAX does not know) stops the run before
  any row, as a CPU fallback does."""
  path = tmp_path / "acc.json"
  proc = run(["--quick", "--json", str(path)],
             env={**os.environ, "JAX_PLATFORMS": "no_such_platform"})
  assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
  (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("accelerator.py:")]
  assert line.startswith("accelerator.py: FAIL: JAX could not start a backend: ")
  assert json.loads(path.read_text())["rows"] == []


def test_readme_performance_table_is_the_committed_chip_run():
  """The README's TPU table is the committed accelerator.json rendered, not hand-copied: a
  chip rerun that changes a figure must change the README with it, and its caveat is the one
  the docs site shows for the file (git history decides it, as the site's build does)."""
  from benchmarks.lib import accelerator_table
  root = Path(__file__).resolve().parents[2]
  payload = json.loads((root / "benchmarks" / "results" / "accelerator.json").read_text())
  assert payload["probe"]["backend"] == "tpu" and not payload.get("quick")
  table = accelerator_table.readme_table(payload)
  readme = (root / "README.md").read_text()
  assert table in readme
  # Hand-read from the chip's rows (levers_call55_real.jsonl, levers_call56_qat.jsonl,
  # levers_call54_real.jsonl): KD at 1,024-token chunks 607.3 ms, 13,489 tokens/s, 54.48%,
  # 15.95 GB; q4_0 QAT KD 652.0 ms, 12,565, 50.75%; int8_backward 476.5 ms, 25,788, 56.03%.
  assert "| kd (real) | 4 x 2048, full, chunk=1024 | 607 | 13,489 | 54.5% | 16.0 GB |" in table
  assert ("| qat_kd (real) | 4 x 2048, full, chunk=1024, qat=q4_0 | 652 | 12,565 | 50.7% | "
          "16.0 GB |") in table
  assert ("| train_int8_backward (real) | 6 x 2048, save_attention, "
          "qat=int8_backward | 477 | 25,788 | 56.0% | 15.8 GB |") in table
  assert ("| qlora (real) | 4 x 2048, save_dots, lora=qlora | 323 | 25,391 | 55.2% | "
          "10.6 GB |") in table
  assert "| train (real) | 6 x 2048, save_attention | 528 | 23,282 | 50.6% | 16.2 GB |" in table
  # levers_call58_moe_student.jsonl at c0a4f50: 16 rows 742.0 ms, 44,163 tokens/s, 41.25%,
  # compiled peak 15,654,297,600 B.
  assert ("| moe_train (moe_student) | 16 x 2048, save_attention, moe_impl=ragged | 742 | "
          "44,163 | 41.3% | 15.7 GB |") in table
  # The caveat the docs site's accelerator page shows for the file (stale while the script
  # changed after the figures were committed), said just before the table (issue 55).
  from docs.gen.results_pages import freshness
  _, caveat = freshness(root / "benchmarks" / "results" / "accelerator.json", payload)
  assert f"accelerator page, which marks them so: {caveat}\n\n{table}" in readme, caveat


def test_summary_sets_the_quantized_rows_against_their_plain_ones():
  """Issue 54's ratios, hand-worked: QAT KD rows by step time against KD at the same batch,
  QLoRA, LoRA and int8 training by tokens/s against the train row (each at its best)."""
  def ok(name, batch, step_s, tokens_per_s):
    return {"row": name, "status": "ok", "batch": batch, "step_s": step_s,
            "tokens_per_s": tokens_per_s}
  levers = [ok("kd", 4, 0.5, 100.0), ok("qat", 4, 0.55, 90.0), ok("qatw", 4, 0.6, 80.0),
            ok("train", 8, 1.0, 200.0), ok("qlora32", 32, 2.0, 210.0),
            ok("qlora16", 16, 1.0, 230.0), ok("lora", 16, 1.0, 260.0),
            ok("int8", 8, 1.0, 240.0)]
  names = {"kd": ["kd"], "qat_kd": ["qat"], "qat_kd_weights": ["qatw"], "train": ["train"],
           "qlora": ["qlora32", "qlora16"], "lora": ["lora"], "train_int8": ["int8"]}
  chosen = [r for r in accelerator.ROWS if r.name in names]
  out = accelerator.summary(levers, chosen, names)
  assert out["qat_kd_over_kd"] == pytest.approx(1.1)
  assert out["qat_kd_weights_over_kd"] == pytest.approx(1.2)
  assert out["qlora_over_train"] == pytest.approx(230 / 200)
  assert out["lora_over_train"] == pytest.approx(1.3)
  assert out["train_int8_over_train"] == pytest.approx(1.2)


def test_rows_from_several_chip_calls_keep_the_newest_and_say_which_are_stale(tmp_path):
  """scripts/merge_chip_rows.py tags each call's rows with its commit (older calls' as stale);
  accelerator.py --from-levers keeps a later file's row of a name, marks a row whose best is
  stale with that commit, and the README table names it."""
  from benchmarks.lib import accelerator_table
  sys.path.insert(0, str(ROOT / "scripts"))
  import merge_chip_rows

  def ok(name, step_s, tokens_per_s):
    return {"row": name, "status": "ok", "batch": 8, "seq_len": 2048, "remat": "full",
            "options": {"pair": "real"}, "step_s": step_s, "tokens_per_s": tokens_per_s,
            "mfu_causal": 0.5, "compiled_peak": 10 ** 10}
  old = {"probe": {"row": "probe", "backend": "tpu"},
         "rows": [{"name": "train", "candidates": [ok("t8", 1.0, 100.0)]},
                  {"name": "kd", "candidates": [ok("k4", 0.5, 50.0)]}]}
  new = {"probe": {"row": "probe", "backend": "tpu"},
         "rows": [{"name": "train", "candidates": [ok("t8", 0.9, 90.0), ok("t6", 0.5, 95.0)]}]}
  (tmp_path / "old.json").write_text(json.dumps(old))
  (tmp_path / "new.json").write_text(json.dumps(new))
  merged = tmp_path / "merged.jsonl"
  assert merge_chip_rows.main([str(merged), f"{tmp_path / 'old.json'}@aaa111@stale",
                               f"{tmp_path / 'new.json'}@bbb222:train"]) == 0
  rows = [json.loads(line) for line in merged.read_text().splitlines()]
  assert [(r["row"], r["commit"], r.get("stale", False)) for r in rows] == [
      ("probe", "aaa111", True), ("t8", "aaa111", True), ("k4", "aaa111", True),
      ("probe", "bbb222", False), ("t8", "bbb222", False), ("t6", "bbb222", False)]
  # An earlier merge extended: its rows keep their own commits and staleness.
  again = tmp_path / "again.jsonl"
  assert merge_chip_rows.main([str(again), f"{merged}@keep",
                               f"{tmp_path / 'old.json'}@ccc333:kd"]) == 0
  extended = [json.loads(line) for line in again.read_text().splitlines()]
  assert extended[:6] == rows
  assert [(r["row"], r["commit"], r.get("stale", False)) for r in extended[6:]] == [
      ("probe", "ccc333", False), ("k4", "ccc333", False)]
  # The code under every earlier row changed: @keep@stale keeps their commits, marks all stale.
  assert merge_chip_rows.main([str(again), f"{again}@keep@stale"]) == 0
  aged = [json.loads(line) for line in again.read_text().splitlines()]
  assert [(r["row"], r["commit"], r["stale"]) for r in aged] == [
      (r["row"], r["commit"], True) for r in extended]
  # tpu_levers --pair real names its rows without the pair option: @pair=real adds it.
  levers_file = tmp_path / "levers.jsonl"
  levers_file.write_text("".join(json.dumps(r) + "\n" for r in (
      {"row": "probe"}, {"row": "init/student"}, ok("train:full:8x2048", 0.4, 9.0),
      ok("kd:full:4x2048:pair=moe", 0.4, 9.0))))
  assert merge_chip_rows.main([str(again), f"{levers_file}@ddd444@pair=real"]) == 0
  assert [(r["row"], r["commit"]) for r in map(json.loads, again.read_text().splitlines())] == [
      ("probe", "ddd444"), ("init/student", "ddd444"), ("train:full:8x2048:pair=real", "ddd444"),
      ("kd:full:4x2048:pair=moe", "ddd444")]
  levers = accelerator._newest_rows(rows)
  assert [r["row"] for r in levers] == ["probe", "t8", "k4", "t6"]
  assert not levers[0].get("stale") and levers[1]["tokens_per_s"] == 90.0  # the newer t8
  chosen = [r for r in accelerator.ROWS if r.name in ("train", "kd")]
  out = accelerator.summary(levers, chosen, {"train": ["t8", "t6"], "kd": ["k4"]})
  by_name = {r["name"]: r for r in out["rows"]}
  assert by_name["train"]["best"]["row"] == "t6" and "stale" not in by_name["train"]
  assert by_name["kd"]["stale"] and by_name["kd"]["commit"] == "aaa111"
  out["probe"] = {"device_kind": "TPU v5 lite", "backend": "tpu"}
  table = accelerator_table.readme_table(out)
  assert "| kd (real; at aaa111) | 8 x 2048, full | 500 | 50 |" in table
  assert "| train (real) | 8 x 2048, full | 500 | 95 |" in table


def test_the_benchmarks_models_start_from_the_trainers_weights():
  """lever_grid.ModelFactory compiles its init as models/init.create_model does (least effort,
  concrete counters): the benchmark's student and teacher are the weights a job of the same
  config and seed starts from."""
  import jax
  from flax import nnx

  from benchmarks.lib import lever_grid
  from distillax.models.init import create_model
  pair = lever_grid.pair_configs("real", tiny=True)
  for cfg in (pair["student"], pair["teacher"]):
    cfg = lever_grid.init_config(cfg)
    got = jax.tree.leaves(nnx.to_pure_dict(nnx.state(lever_grid.ModelFactory(cfg).make())))
    want = jax.tree.leaves(nnx.to_pure_dict(nnx.state(create_model(cfg, seed=0))))
    assert len(got) == len(want) > 10
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                 rtol=1e-6, atol=1e-7)
