"""The demo's on-policy stages and their figures.

Two more trained stages start from the distilled student (`student_kd`) and take the same number
of extra steps (`qat_steps`) as the rows they are compared with:

  student_onpolicy   on-policy distillation (configs/on_policy.py's recipe), full precision,
                     against `student_kd_fp` (the same steps of off-policy KD on the data)
  student_qad_q4_0   on-policy QAD: the same with the q4_0-weight / q8_0-activation rules, the
                     student sampling in its fake-quantized form, against `student_qat_int4`
                     (QAT by off-policy KD)

The figure of each (`measure`): the student completes held-out prompts (fixed seed) and the
teacher grades every token, the teacher's NLL per completion token and KL(student || teacher)
per token, next to the validation loss; the q4_0 rows twice, as distillax's fake-quant forward
samples and as llama.cpp samples the q4_0 GGUF file (the deployed model's writing, scored by
the teacher; its reverse KL uses llama.cpp's own logits as the student's distribution).
Measuring and rendering are separate functions (`measure`, `checks`, `markdown`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from distillax import partitioning as pt
from distillax.distill.on_policy.objective import OnPolicySettings
from distillax.distill.on_policy.eval import FIGURES, OnPolicyEvaluator
from distillax.distill.sequence_kd import take_prompt_records
from distillax.demo import prompt_stats
from distillax.demo.markdown import table_lines
from distillax.edge import runtime as gguf_runtime
from distillax.edge.export import write_gguf
from distillax.trainers.on_policy.recipe import settings_from_config

STAGES = ("student_onpolicy", "student_qad_q4_0")
# figure row -> (the model it reads, quantized?); the pairs compared are (off-policy, on-policy)
ROWS = {"student_kd_fp": False, "student_onpolicy": False,
        "student_qat_int4": True, "student_qad_q4_0": True}
PAIRS = (("student_kd_fp", "student_onpolicy"), ("student_qat_int4", "student_qad_q4_0"))
LABELS = {"student_kd_fp": "off-policy KD (+ extra fp steps)",
          "student_onpolicy": "on-policy distillation (same extra steps)",
          "student_qat_int4": "q4_0 QAT, off-policy KD", "student_qad_q4_0": "q4_0 on-policy QAD"}


def stage_config(c, demo, workdir: str):
  """`c` (the stage's config with the distill parts filled in by stages.py) as an on-policy
  stage: from student_kd, qat_steps steps at the QAT learning rate."""
  c.trainer = "on_policy"
  c.on_policy = demo.on_policy.copy_and_resolve_references()
  c.train.steps = demo.qat_steps
  c.train.init_from = os.path.join(workdir, "student_kd")
  c.optimizer.learning_rate = demo.qat_learning_rate
  c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, max(demo.qat_steps // 10, 1))
  return c


def heldout_prompts(c, tokenizer) -> list[np.ndarray]:
  """The held-out prompts every row completes: the first prompt_len tokens of validation
  documents, in a seeded order (the trainer's eval takes the same)."""
  return [r.tokens for r in take_prompt_records(
      c.data, tokenizer, count=int(c.on_policy.eval_prompts),
      prompt_len=int(c.on_policy.prompt_len), seed=int(c.seed), split="eval")]


def _distillax_figures(models: dict, teacher, prompts, settings, mesh, rules, seed) -> dict:
  """Each row's evaluator figures, with their standard errors over prompts."""
  evaluator = OnPolicyEvaluator(settings, mesh=mesh, rules=rules)
  out = {}
  for row in ROWS:
    result = evaluator(models[row], teacher, prompts, seed=seed)
    completions = [ids for _, ids in result.samples]
    out[row] = {**result.figures, **distillax_se(models[row], teacher, prompts, completions,
                                                 settings, mesh, rules)}
  return out


def sample_gguf(path: str, prompts, settings: OnPolicySettings, seed: int):
  """llama.cpp's samples of `prompts` (temperature, stop tokens and vocab_limit as `settings`:
  no padded row is drawn; numpy's seeded draws from its float32 logits, every step one
  llama.cpp decode) and the log-softmax of its full logits at each sampled position:
  [(completion ids, logp_TxV)]."""
  rng = np.random.default_rng(seed)
  llm = gguf_runtime.load(path)
  out = []
  try:
    for prompt in prompts:
      llm.reset()
      llm.eval([int(t) for t in prompt])
      ids, logps = [], []
      for _ in range(settings.max_new_tokens):
        z = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
        logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
        logps.append(logp)
        t, real = settings.temperature, z[:settings.vocab_limit]  # padded rows never drawn
        p = np.exp((real - real.max()) / t) / np.exp((real - real.max()) / t).sum() if t > 0 \
            else None
        token = int(np.argmax(real)) if p is None else int(rng.choice(len(p), p=p))
        ids.append(token)
        if token in settings.stops:
          break
        llm.eval([token])
      out.append((ids, np.stack(logps)))
  finally:
    llm.close()
  return out


def completion_logps(model, prompts, completions, width: int, pad_id: int, mesh, rules):
  """`model`'s log-softmax at the positions predicting each completion, [(T_i, V)]: one forward
  over every prompt + completion, right-padded to `width` (causal: the padding after a sequence
  cannot change it). The rows are padded to whole rows per data-parallel worker."""
  rows = len(prompts)
  if mesh is not None:
    rows = -(-rows // int(mesh.shape.get("data", 1))) * int(mesh.shape.get("data", 1))
  seq = np.full((rows, width), pad_id, np.int32)
  for i, (p, ids) in enumerate(zip(prompts, completions)):
    seq[i, :len(p) + len(ids)] = np.concatenate([p, ids])

  @jax.jit
  def logits(tokens):
    if mesh is None:
      return model(tokens).logits_BxLxV
    with pt.use_rules(mesh, rules):
      return model(tokens).logits_BxLxV

  z = np.asarray(jax.device_get(logits(jnp.asarray(seq))), np.float64)
  out = []
  for i, (p, ids) in enumerate(zip(prompts, completions)):
    zi = z[i, len(p) - 1:len(p) - 1 + len(ids)]
    zi = zi - zi.max(-1, keepdims=True)
    out.append(zi - np.log(np.exp(zi).sum(-1, keepdims=True)))
  return out


def gguf_figures(path, teacher, prompts, settings, seed, mesh, rules) -> dict:
  """on_policy_* figures of llama.cpp's own samples of the GGUF file, graded by the teacher,
  with the standard errors over prompts (prompt_stats.py)."""
  samples = sample_gguf(path, prompts, settings, seed)
  width = max(len(p) for p in prompts) + settings.max_new_tokens
  completions = [ids for ids, _ in samples]
  t_logps = completion_logps(teacher, prompts, completions, width, settings.pad_id, mesh, rules)
  sums = prompt_stats.per_prompt_sums(completions, [s for _, s in samples], t_logps)
  tokens = float(sums["tokens"].sum())
  ended = sum(ids[-1] in settings.stops for ids in completions)
  return {**prompt_stats.figures_with_se(sums),
          "on_policy_completion_length": tokens / len(prompts),
          "on_policy_eos_rate": ended / len(prompts), "on_policy_tokens": tokens,
          "per_prompt": _lists(sums)}


def _lists(sums: dict) -> dict[str, list[float]]:
  """Per-prompt sums as report.json keeps them (the paired comparisons are recomputable)."""
  return {k: [float(x) for x in v] for k, v in sums.items()}


def distillax_se(model, teacher, prompts, completions, settings, mesh, rules) -> dict:
  """The standard errors over prompts of a distillax row's figures and its per-prompt sums (its
  completions scored again per prompt, by the row's model and the teacher); the figures
  themselves are the evaluator's."""
  width = max(len(p) for p in prompts) + settings.max_new_tokens
  s_logps = completion_logps(model, prompts, completions, width, settings.pad_id, mesh, rules)
  t_logps = completion_logps(teacher, prompts, completions, width, settings.pad_id, mesh, rules)
  sums = prompt_stats.per_prompt_sums(completions, s_logps, t_logps)
  figures = prompt_stats.figures_with_se(sums)
  return {**{k: v for k, v in figures.items() if k.endswith("_se")}, "per_prompt": _lists(sums)}


def export_gguf(plain: dict, demo_rules, tokenizer, add_bos: bool, export_dir: str) -> dict:
  """The q4_0 GGUF files of the two quantized rows (the QAT one edge.py also writes)."""
  paths = {}
  for row in ("student_qat_int4", "student_qad_q4_0"):
    paths[row] = os.path.join(export_dir, f"{row}-q4_0-sampled.gguf")
    write_gguf(plain[row], paths[row], quant="q4_0", tokenizer=tokenizer, add_bos=add_bos,
               rules=demo_rules)
  return paths


def measure(c, plain: dict, models: dict, stages: dict, tokenizer, mesh, rules,
            paths: dict) -> dict:
  """Each row's on-policy figures (distillax's forward, the q4_0 rows the fake quantization
  made real; the q4_0 rows also from their GGUF `paths` in llama.cpp) and its validation loss
  from the report's stage rows."""
  settings = settings_from_config(c.on_policy, tokenizer)
  prompts = heldout_prompts(c, tokenizer)
  seed = int(c.on_policy.eval_seed)
  figures = _distillax_figures(models, plain["teacher"], prompts, settings, mesh, rules, seed)
  rows = {}
  for row, quantized in ROWS.items():
    rows[row] = {"val_loss": stages[row]["val_loss"], "prompts": len(prompts), **figures[row]}
    if quantized:
      rows[row]["llama_cpp"] = gguf_figures(paths[row], plain["teacher"], prompts, settings,
                                            seed, mesh, rules)
  return rows


def checks(rows: dict) -> dict:
  """The claims, per pair (the q4_0 pair in distillax and in llama.cpp): on-policy beats
  off-policy on both figures, i.e. is lower by more than two standard errors of the difference
  over the same prompts (prompt_stats.compare, with the difference and both SEs beside it); and
  on the deployed q4_0 files, QAD is at least as good as QAT (not higher on either figure)."""
  out = {}
  for off, on in PAIRS:
    sides = [("", rows[on], rows[off])]
    if "llama_cpp" in rows[on]:
      sides.append(("_in_llama_cpp", rows[on]["llama_cpp"], rows[off]["llama_cpp"]))
    for fig in ("teacher_nll", "reverse_kl"):
      for suffix, on_row, off_row in sides:
        cmp = prompt_stats.compare(on_row["per_prompt"], off_row["per_prompt"], fig)
        out[f"{on}_beats_{fig}{suffix}"] = cmp["beats"]
        out[f"{on}_{fig}_lower_by{suffix}"] = (
            f"{cmp['difference']:.4f} (paired SE {cmp['paired_se']:.4f}, unpaired "
            f"{cmp['unpaired_se']:.4f})")
  qad, qat = rows["student_qad_q4_0"]["llama_cpp"], rows["student_qat_int4"]["llama_cpp"]
  out["qad_at_least_as_good_as_qat_in_llama_cpp"] = bool(all(
      qad[f"on_policy_{fig}"] <= qat[f"on_policy_{fig}"] for fig in ("teacher_nll", "reverse_kl")))
  return out


def _with_se(r: dict, key: str) -> str:
  return f"{r[key]:.4f} ± {r[key + '_se']:.4f}"


def markdown(rows: dict, checks_: dict, c) -> list[str]:
  """report.md's on-policy section: the table and the claims."""
  head = ("student", "val loss", "teacher NLL / token", "reverse KL / token", "mean length",
          "llama.cpp teacher NLL", "llama.cpp reverse KL")
  lines = ["## On-policy distillation: what each student writes, graded by the teacher", "",
           f"Every student completes the same {next(iter(rows.values()))['prompts']} held-out "
           f"prompts "
           f"({int(c.on_policy.prompt_len)} tokens, seed {int(c.on_policy.eval_seed)}, "
           f"temperature {float(c.on_policy.sampling_temperature)}, up to "
           f"{int(c.on_policy.max_new_tokens)} tokens); the teacher scores every token. All "
           f"four start from the distilled student and take the same {int(c.qat_steps)} extra "
           f"steps. The q4_0 rows are sampled twice: by distillax's fake-quant forward and by "
           f"llama.cpp from the q4_0 GGUF file (reference kernels, f32 KV cache). Each figure "
           f"is per token, ± its standard error over prompts; 'beats' means lower by more "
           f"than two standard errors of the difference, taken per prompt (both rows complete "
           f"the same prompts; the unpaired SE is shown beside it).", ""]
  cells = []
  for row, r in rows.items():
    cpp = r.get("llama_cpp")
    cells.append((LABELS[row], f"{r['val_loss']:.4f}", _with_se(r, "on_policy_teacher_nll"),
                  _with_se(r, "on_policy_reverse_kl"), f"{r['on_policy_completion_length']:.1f}",
                  _with_se(cpp, "on_policy_teacher_nll") if cpp else "-",
                  _with_se(cpp, "on_policy_reverse_kl") if cpp else "-"))
  lines += table_lines(head, cells)
  lines += ["", *(f"- {k}: {v}" for k, v in checks_.items()), ""]
  return lines


__all__ = ["FIGURES", "LABELS", "PAIRS", "ROWS", "STAGES", "checks",
           "export_gguf", "gguf_figures", "heldout_prompts", "markdown", "measure",
           "sample_gguf", "stage_config", "completion_logps", "distillax_se"]
