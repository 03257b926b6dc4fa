"""The demo's draft stage and its figures: speculative-decoding drafts for the teacher.

One more trained stage, `draft_head`: an EAGLE-3 head (configs/draft_eagle3.py's recipe)
trained against the frozen teacher for `draft.steps` steps. The report then continues held-out
prompts with the teacher by speculative decoding, greedy (the text is the teacher's own), with
two drafts: the head, and the distilled student (`student_kd`) used as a whole draft model.
For each: the mean acceptance length at 1..k proposed tokens (tokens per teacher forward), the
teacher forwards saved, its parameters and its FLOPs per proposed token (one forward token of
the draft at the prompts' mean context; the head's over its draft vocabulary, without the
embedding lookup, which is the teacher's table). The check the issue asks: whether the head
beats the student's acceptance length at k at a tenth of its FLOPs per proposed token, and by
how much it falls short where it does not.
"""

from __future__ import annotations

import os

import jax

from distillax import partitioning as pt
from distillax.configs import sections
from distillax.configs.draft_eagle3 import draft_section
from distillax.demo.markdown import table_lines
from distillax.framework import flops

STAGES = ("draft_head",)
LABELS = {"draft_head": "EAGLE-3 head (draft_head)",
          "student_kd": "distilled student as a whole draft (student_kd)"}


def stage_config(c, demo, workdir: str):
  """`c` (a base config with the demo's common parts) as the draft stage."""
  d = demo.draft
  c.trainer = "draft"
  c.model = demo.teacher_model.copy_and_resolve_references()
  c.teacher = sections.teacher_section()
  c.teacher.workdir = os.path.join(workdir, "teacher")
  c.student = sections.student_section()
  c.draft = draft_section()
  for key in c.draft:
    c.draft[key] = d[key]
  if d.regenerate:  # the teacher's own answers, sequence_kd's defaults (off in the demo)
    c.sequence_kd = sections.sequence_kd_section()
  c.train.steps = d.steps
  c.optimizer.learning_rate = d.learning_rate
  c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, max(int(d.steps) // 10, 1))
  c.train.export_format = ""  # nothing of it goes to llama.cpp
  return c


def _per_token_flops(model_config, context: int) -> float:
  """Forward FLOPs of the token at position `context` of a whole model (causal)."""
  return (flops.forward_flops(model_config, 1, context + 1)
          - flops.forward_flops(model_config, 1, context))


def _params(model) -> int:
  from flax import nnx
  return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def measure(demo, pipeline, tokenizer) -> dict:
  """{"rows": {draft: {params, flops_per_token, acceptance: [..k], saved: [..k]}}, "k",
  "context", "check"} over the held-out prompts."""
  from distillax.eval.draft import acceptance_table, held_out_prompts
  from distillax.models.speculative import HeadDraft, ModelDraft
  from distillax.trainers import load_trained_model
  from distillax.trainers.draft import head_flops_per_token, head_params, load_draft_run
  d = demo.draft
  # One device: every row is a batch-1 decode of these small models, which a mesh only slows.
  mesh = pt.create_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
  rules = pt.rules_from_config({"strategy": "dp"})
  head, teacher, recipe = load_draft_run(pipeline.stage_dir("draft_head"), mesh=mesh,
                                         rules=rules)
  student = load_trained_model(pipeline.stage_dir("student_kd"), mesh, rules)
  prompts = held_out_prompts(recipe.config, tokenizer, int(d.prompts),
                             prompt_len=int(demo.on_policy.prompt_len))
  k = int(d.ttt_steps)
  context = int(sum(len(p) for p in prompts) / len(prompts) + int(d.new_tokens) / 2)
  drafts = {"draft_head": (HeadDraft(head), head_params(head.config)["served"],
                           head_flops_per_token(head.config, context)),
            "student_kd": (ModelDraft(student), _params(student),
                           _per_token_flops(student.config, context))}
  rows = {}
  for name, (draft, params, per_token) in drafts.items():
    table = acceptance_table(teacher, draft, prompts, proposals=k,
                             max_new_tokens=int(d.new_tokens),
                             vocab_limit=int(tokenizer.vocab_size))
    rows[name] = {"params": params, "flops_per_token": per_token,
                  "acceptance": [r.acceptance_length for r in table],
                  "saved": [r.saved for r in table]}
  return {"rows": rows, "k": k, "context": context, "prompts": len(prompts),
          "check": check(rows)}


def check(rows: dict) -> dict:
  """The head against the student at the largest k: acceptance lengths and FLOPs ratio."""
  head, student = rows["draft_head"], rows["student_kd"]
  ratio = head["flops_per_token"] / student["flops_per_token"]
  gap = head["acceptance"][-1] - student["acceptance"][-1]
  return {"flops_ratio": ratio, "acceptance_gap": gap,
          "head_beats_student_at_a_tenth": bool(gap > 0 and ratio <= 0.1)}


def markdown(section: dict, demo) -> list[str]:
  """The report's draft section."""
  k, rows = section["k"], section["rows"]
  head = ["draft", "params", "FLOPs / proposed token"] + [
      f"accept. length k={j}" for j in range(1, k + 1)] + [f"teacher forwards saved (k={k})"]
  lines = [f"\n## Speculative-decoding drafts for the teacher\n",
           f"Greedy speculative decoding of {section['prompts']} held-out prompts x "
           f"{demo.draft.new_tokens} tokens (the teacher's own text; mean context "
           f"{section['context']} tokens). Acceptance length: tokens emitted per teacher forward "
           f"(1 = every proposal rejected).\n"]
  lines += table_lines(head, [[LABELS[name], f"{r['params']:,}", f"{r['flops_per_token']:.3g}"]
                              + [f"{a:.3f}" for a in r["acceptance"]]
                              + [f"{100 * r['saved'][-1]:.1f}%"] for name, r in rows.items()])
  c = section["check"]
  if c["head_beats_student_at_a_tenth"]:
    words = (f"The head beats the student's acceptance length at k={k} by "
             f"{c['acceptance_gap']:.3f} tokens at {c['flops_ratio']:.2f}x its FLOPs per "
             f"proposed token.")
  else:
    short = [] if c["acceptance_gap"] > 0 else [
        f"its acceptance length at k={k} is {-c['acceptance_gap']:.3f} tokens below the "
        f"student's"]
    if c["flops_ratio"] > 0.1:
      short.append(f"it costs {c['flops_ratio']:.2f}x the student's FLOPs per proposed token, "
                   f"not a tenth ({c['flops_ratio'] / 0.1:.1f}x over)")
    words = "The head falls short of beating the student at a tenth of its FLOPs: " + \
        "; ".join(short) + "."
  return lines + ["", words, ""]
