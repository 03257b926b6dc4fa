"""Mixture of experts: the ragged grouped-matmul layer against the dense reference, and the KD
step with an MoE teacher against a dense teacher of equal active parameters.

  python benchmarks/moe.py [--quick] [--devices N]

(a) One MoE layer (`models.moe.MoE`: router, top-k, experts), forward and backward (the loss
is the output against a fixed random cotangent; gradients for the weights and the input), at
E = 64 experts, k = 8, 4096 tokens, width D = 128 and expert width F = 64 (the whole script runs
in about a minute on two cores). `moe_impl='ragged'` sorts the T*k assignments by expert and
runs three `ragged_dot` grouped matmuls; `moe_impl='dense'` runs every expert on every token and
masks. XLA:CPU has no grouped-matmul kernel: it computes a `ragged_dot` of N rows and E groups
as N x E dense rows and masks, so on CPU the ragged path does k times the dense path's matmul
work (N = T*k rows against every expert; XLA's FLOP count shows it). The TPU compiler lowers
it to Mosaic's ragged-dot kernels (docs/guides/plan-target.md); this script measures what runs here.
Both must give the same loss and gradients (checked). Reported: step time (median of interleaved
rounds, and the median of per-round ratios) and the compiled temporaries
(`memory_analysis().temp_size_in_bytes`).

(b) The distillation step (`build_engine` with LogitKD: the trainer's step) of the tiny dense
student of distill_moe.py:tiny, once with the tiny_moe teacher (4 experts of width 32, top-2)
and once with a dense teacher of the same shape whose MLP width is k x 32 = 64: the same active
parameters per token but for the router's D x E. Tokens/s of each and their ratio.

Both parts are ratios measured in one run (interleaved, so a loaded machine slows both alike);
the machine's load average is recorded with them. Writes benchmarks/results/moe.json
(--quick: moe_quick.json).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax import partitioning as pt  # noqa: E402
from distillax.distill import LogitKD, make_distill_objective  # noqa: E402
from distillax.framework import build_engine  # noqa: E402
from distillax.models import (TransformerConfig, abstract_model, create_model,  # noqa: E402
                              get_preset, param_count)
from distillax.models.moe.layer import MoE  # noqa: E402

EXPERTS, TOP_K = 64, 8


def settings(quick: bool) -> dict:
  if quick:
    return {"tokens": 256, "embed_dim": 32, "expert_dim": 16, "reps": 2,
            "kd_batch": 4, "kd_seq_len": 32, "kd_reps": 2, "kd_steps_per_rep": 1}
  return {"tokens": 4096, "embed_dim": 128, "expert_dim": 64, "reps": 5,
          "kd_batch": 16, "kd_seq_len": 128, "kd_reps": 7, "kd_steps_per_rep": 3}


def load() -> list[float]:
  """/proc/loadavg's 1, 5 and 15 minute load averages (empty where there is none)."""
  try:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
  except OSError:
    return []


# ---- (a) the layer ------------------------------------------------------------------------

def layer_config(s: dict, impl: str) -> TransformerConfig:
  return TransformerConfig(embed_dim=s["embed_dim"], mlp_dim=s["expert_dim"],
                           num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                           moe_mlp_dim=s["expert_dim"], norm_topk_prob=True, moe_impl=impl)


def layer_step(s: dict, impl: str):
  """(compiled loss-and-gradients of one MoE layer, its arguments); the same weights, input
  and cotangent for every impl."""
  mesh = pt.create_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    graph, params = nnx.split(MoE(layer_config(s, impl), rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  x_1xTxD = jnp.asarray(rng.normal(size=(1, s["tokens"], s["embed_dim"])), jnp.float32)
  cot_1xTxD = jnp.asarray(rng.normal(size=(1, s["tokens"], s["embed_dim"])), jnp.float32)

  def loss(params, x_1xTxD):
    out_1xTxD, _ = nnx.merge(graph, params)(x_1xTxD)
    return jnp.sum(out_1xTxD * cot_1xTxD)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  args = (params, x_1xTxD)
  return fn.lower(*args).compile(), args


def measure_layer(s: dict) -> dict:
  rows, times, results = common.compiled_side_by_side(
      {impl: layer_step(s, impl) for impl in ("ragged", "dense")}, reps=s["reps"])
  loss_diff, grad_diff = common.value_and_grad_gaps(results["ragged"], results["dense"])
  return {"experts": EXPERTS, "top_k": TOP_K, "tokens": s["tokens"], "embed_dim": s["embed_dim"],
          "expert_dim": s["expert_dim"], "rows": list(rows.values()),
          "time_ragged_over_dense": common.paired_ratio(times, "ragged", "dense"),
          "temp_ragged_over_dense": rows["ragged"]["temp_bytes"] / rows["dense"]["temp_bytes"],
          "check": {"loss_rel_diff": loss_diff, "grad_rel_diff": grad_diff,
                    "pass": loss_diff <= 1e-4 and grad_diff <= 1e-4}}


# ---- (b) the KD step ----------------------------------------------------------------------

def teachers() -> dict[str, TransformerConfig]:
  """The tiny MoE teacher and the dense teacher of its active parameters (MLP width k x F)."""
  moe = get_preset("tiny_moe")
  dense = get_preset("tiny", mlp_dim=moe.num_experts_per_tok * moe.expert_mlp_dim)
  return {"moe": moe, "dense": dense}


def active_params(cfg: TransformerConfig) -> int:
  """A token's parameters: all but the experts it is not routed to."""
  unused = max(cfg.num_experts - cfg.num_experts_per_tok, 0)
  return param_count(cfg) - cfg.num_layers * unused * 3 * cfg.embed_dim * cfg.expert_mlp_dim


def measure_kd(s: dict) -> dict:
  B, L = s["kd_batch"], s["kd_seq_len"]
  student_cfg = get_preset("tiny", num_layers=1)  # distill_moe.py:tiny's student
  mesh = pt.create_mesh({"data": jax.device_count(), "model": 1})
  rules = pt.rules_from_config({"strategy": "fsdp"})
  batch = common.packed_batch(B, L, student_cfg.vocab_size, seed=0)
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
  objective = make_distill_objective(LogitKD(temperature=2.0, alpha=0.7))
  steppers, rows = {}, {}
  for name, cfg in teachers().items():
    engine = build_engine(abstract_model(student_cfg), {"teacher": abstract_model(cfg)},
                          objective, common.benchmark_optimizer(), 1000, mesh, rules, "jit",
                          shapes)
    teacher = create_model(cfg, mesh=mesh, rules=rules, seed=1)
    student = create_model(student_cfg, mesh=mesh, rules=rules, seed=0)
    steppers[name] = common.Stepper(engine, student, batch, extras={"teacher": teacher})
    rows[name] = {"teacher": name, "teacher_params": param_count(cfg),
                  "teacher_active_params": active_params(cfg),
                  "temp_bytes": engine.runner.stats.get("temp_size_in_bytes")}
  common.timed_rounds(steppers, rows, reps=s["kd_reps"], steps_per_rep=s["kd_steps_per_rep"],
                      warmup_steps=1, tokens_per_step=B * L, reference="dense")
  return {"batch": B, "seq_len": L, "student_params": param_count(student_cfg),
          "rows": list(rows.values()),
          "tokens_per_s_moe_over_dense": rows["moe"]["tokens_per_s"] / rows["dense"]["tokens_per_s"],
          "time_moe_over_dense": rows["moe"]["ratio"]}


def main() -> int:
  args = subproc.parse_args(subproc.base_parser(__doc__.splitlines()[0]))
  s = settings(args.quick)
  load_before = load()
  print(f"load average {load_before}; (a) the MoE layer ...", flush=True)
  layer = measure_layer(s)
  print("(b) the KD step ...", flush=True)
  kd = measure_kd(s)
  res = {"machine": common.machine_info(), "quick": args.quick, "settings": s,
         "load_before": load_before, "load_after": load(), "layer": layer, "kd": kd}

  print(f"\n(a) one MoE layer, forward + backward: E={EXPERTS}, k={TOP_K}, {layer['tokens']} "
        f"tokens, D={layer['embed_dim']}, F={layer['expert_dim']}")
  print(common.format_table(layer["rows"], [
      ("moe_impl", lambda r: r["impl"]), ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("GFLOPs", lambda r: f"{r['flops'] / 1e9:.2f}"),
      ("temporaries", lambda r: common.fmt_bytes(r["temp_bytes"]))]))
  print(f"ragged / dense: time {layer['time_ragged_over_dense']:.3f} (median of per-round "
        f"ratios), temporaries {layer['temp_ragged_over_dense']:.3f}")
  print(f"\n(b) KD step, tiny student, batch {kd['batch']} x {kd['seq_len']}")
  print(common.format_table(kd["rows"], [
      ("teacher", lambda r: r["teacher"]), ("params", lambda r: r["teacher_params"]),
      ("active", lambda r: r["teacher_active_params"]),
      ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
      ("temporaries", lambda r: common.fmt_bytes(r["temp_bytes"]))]))
  print(f"MoE / dense teacher: tokens/s {kd['tokens_per_s_moe_over_dense']:.3f}")
  print(f"load average before {load_before}, after {res['load_after']} "
        f"({os.cpu_count()} CPUs)")
  check = layer["check"]
  print(f"{'PASS' if check['pass'] else 'FAIL'}  ragged and dense agree (loss rel "
        f"{check['loss_rel_diff']:.1e}, gradients rel {check['grad_rel_diff']:.1e})")
  path = common.write_json(args.out, "moe_quick" if args.quick else "moe", res)
  print(f"\nwrote {path}")
  return 0 if check["pass"] else 1


if __name__ == "__main__":
  sys.exit(main())
