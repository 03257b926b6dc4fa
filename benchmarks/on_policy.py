"""On-policy distillation: where a step's time goes, sampling speed, and TRL's GKDTrainer.

  python benchmarks/on_policy.py [--quick] [--reps N]
  # with TRL alongside (a scratch venv; never a distillax dependency):
  python3.11 -m venv /tmp/trl_venv && /tmp/trl_venv/bin/pip install trl==1.16.0 \\
      torch==2.13.0 transformers==5.24.0
  python benchmarks/on_policy.py --trl-python /tmp/trl_venv/bin/python

One CPU device, fp32, the demo bodies (demo_student <- demo_teacher, byte vocabulary) or with
--quick the tiny preset's widths. B prompts of random token ids (lengths P/2..P, the same ids on
both sides), one completion each of exactly T tokens (no stop token: both systems sample the
same number of tokens), temperature 1, the generalized JSD (beta 0.5, T 1), lmbda 1, AdamW.

distillax, each program compiled on its own and timed on the same arrays in interleaved rounds:
  step      the train step the on_policy recipe compiles: sampling, scoring and update in one
  sampling  the step's decode alone (distill.on_policy.sample_rollout)
  scoring   teacher and student forwards and the loss over fixed completions (no gradient)
  update    step - sampling - scoring: the student's backward and the optimizer (derived)
  sampler   models.sampler.Sampler on the same prompts: the inference sampler alone
Sampled tokens/s = B * T / seconds. TRL (when --trl-python is given):
benchmarks/lib/on_policy_trl.py runs in that interpreter on the same two models written by
distillax's Hugging Face export (models/hf.save), the same prompts, T and batch; a GKDTrainer
step is its training_step (HF generate with a KV cache, then the student's and teacher's
forwards, the JSD and backward) plus the optimizer step, torch on --trl-threads threads
(default 1, see lib/on_policy_trl.py).
Its figures come back as JSON; the ratio is distillax step tokens/s over TRL's (target >= 3x).
The first-step student logits of both systems on prompt 0 are compared (the same weights reach
both).

Writes benchmarks/results/on_policy.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
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
from distillax.data import ByteTokenizer, padded_vocab_size  # noqa: E402
from distillax.distill import TEACHER  # noqa: E402
from distillax.distill.on_policy.objective import (OnPolicySettings, make_on_policy_objective,  # noqa: E402
                                         sample_rollout, score_rollout, scoring_batch)
from distillax.distill.on_policy.eval import prompt_arrays  # noqa: E402
from distillax.distill.on_policy.losses import GeneralizedJSD  # noqa: E402
from distillax.framework import build_engine  # noqa: E402
from distillax.models import abstract_model, get_preset
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.sampler import Sampler  # noqa: E402

TRL_SCRIPT = Path(__file__).resolve().parent / "lib" / "on_policy_trl.py"  # its own interpreter

BETA, TEMPERATURE = 0.5, 1.0
TARGET_RATIO = 3.0


def settings(quick: bool) -> dict:
  if quick:
    return {"models": "tiny", "batch": 4, "prompt_len": 8, "max_new_tokens": 8, "reps": 2}
  return {"models": "demo", "batch": 8, "prompt_len": 32, "max_new_tokens": 64, "reps": 5}


def model_configs(s: dict, vocab: int):
  if s["models"] == "tiny":
    tiny = get_preset("tiny", vocab_size=vocab, tie_embeddings=True, num_layers=1)
    return tiny, tiny.replace(num_layers=2)
  return (get_preset("demo_student").replace(vocab_size=vocab),
          get_preset("demo_teacher").replace(vocab_size=vocab))


def prompts(s: dict, vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  P = s["prompt_len"]
  return [rng.integers(4, vocab, int(rng.integers(P // 2, P + 1))).tolist()
          for _ in range(s["batch"])]


def on_policy_settings(s: dict, pad_id: int):
  return OnPolicySettings(max_new_tokens=s["max_new_tokens"], temperature=1.0, eos_id=None,
                          pad_id=pad_id)


# ---- distillax ----------------------------------------------------------------------------------

class DistillaxPrograms:
  """The on-policy step and its parts, compiled separately over one state and batch."""

  def __init__(self, s: dict, student_cfg, teacher_cfg, prompt_ids, pad_id: int):
    self.settings = on_policy_settings(s, pad_id)
    self.leaf = GeneralizedJSD(beta=BETA, temperature=TEMPERATURE)
    objective = make_on_policy_objective(self.leaf, self.settings)
    self.host_batch = prompt_arrays([np.asarray(p) for p in prompt_ids],
                                    s["prompt_len"], pad_id)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self.host_batch.items()}
    mesh = pt.create_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
    rules = pt.rules_from_config({"strategy": "fsdp"})
    start = time.perf_counter()
    self.engine = build_engine(abstract_model(student_cfg),
                               {TEACHER: abstract_model(teacher_cfg)}, objective,
                               common.benchmark_optimizer(), 1000, mesh, rules, "jit", shapes)
    self.compile_s = time.perf_counter() - start
    self.models = (common.host_model(student_cfg, 0), common.host_model(teacher_cfg, 1))
    self.stepper = common.Stepper(self.engine, self.models[0], self.host_batch,
                                  extras={TEACHER: self.models[1]})
    self._parts()

  def _parts(self):
    defs, settings, leaf = self.engine.layout.defs, self.settings, self.leaf
    key = jax.random.key(0)

    def sample(state, batch):
      student, _ = defs.merge(state.params, state.frozen)
      return sample_rollout(student, batch, key, settings)

    def score(state, rollout):
      student, extras = defs.merge(state.params, state.frozen)
      return score_rollout(leaf, student, extras, scoring_batch(rollout, settings.pad_id)).loss_sum

    self.sample, self.score = jax.jit(sample), jax.jit(score)
    self.batch = self.stepper.batch
    self.rollout = jax.block_until_ready(self.sample(self.stepper.state, self.batch))
    self.sampler = Sampler(self.models[0])

  def runs(self) -> dict:
    """name -> (steps -> None), each blocking on its result."""
    s = self.settings
    hb = self.host_batch

    def repeat(fn):
      def run(steps):
        for _ in range(steps):
          jax.block_until_ready(fn())
      return run

    return {"step": self.stepper,
            "sampling": repeat(lambda: self.sample(self.stepper.state, self.batch)),
            "scoring": repeat(lambda: self.score(self.stepper.state, self.rollout)),
            "sampler": repeat(lambda: self.sampler(
                hb["prompt_tokens_BxP"], hb["prompt_lengths_B"], max_new_tokens=s.max_new_tokens,
                temperature=1.0, pad_id=s.pad_id, seed=0).tokens_BxT)}

  def first_logits(self, prompt) -> list[float]:
    out = self.models[0](jnp.asarray([prompt], jnp.int32)).logits_BxLxV
    return np.asarray(out[0, -1]).tolist()


def measure_distillax(s: dict, programs: DistillaxPrograms) -> dict:
  times, _ = common.interleaved(programs.runs(), reps=s["reps"], steps_per_rep=1,
                                warmup_steps=1)
  med = {name: common.median(t) for name, t in times.items()}
  tokens = s["batch"] * s["max_new_tokens"]
  med["update"] = max(med["step"] - med["sampling"] - med["scoring"], 0.0)
  return {"seconds": med, "seconds_all": times, "sampled_tokens": tokens,
          "step_tokens_per_s": tokens / med["step"],
          "sampling_tokens_per_s": tokens / med["sampling"],
          "sampler_tokens_per_s": tokens / med["sampler"],
          "share": {k: med[k] / med["step"] for k in ("sampling", "scoring", "update")},
          "losses": programs.stepper.losses, "compile_s": programs.compile_s}


# ---- TRL (optional, another interpreter) --------------------------------------------------------

def export_models(programs: DistillaxPrograms, tokenizer, folder: Path) -> dict:
  paths = {}
  for name, model in zip(("student", "teacher"), programs.models):
    paths[name] = str(folder / name)
    graph, state = nnx.split(model)  # host (numpy) values -> device arrays, as export reads them
    hf.save(nnx.merge(graph, jax.tree.map(jnp.asarray, state)), paths[name], tokenizer=tokenizer)
  return paths


def run_trl(python: str, s: dict, paths: dict, prompt_ids, pad_id: int, folder: Path) -> dict:
  spec = {"student": paths["student"], "teacher": paths["teacher"], "prompts": prompt_ids,
          "max_new_tokens": s["max_new_tokens"], "beta": BETA, "temperature": TEMPERATURE,
          "reps": s["reps"], "pad_id": pad_id, "out": str(folder / "trl.json"),
          "threads": s["trl_threads"]}
  (folder / "trl_spec.json").write_text(json.dumps(spec))
  # -P: the script's folder must not shadow packages (as benchmarks/peft.py would shadow peft)
  proc = subprocess.run([python, "-P", str(TRL_SCRIPT), str(folder / "trl_spec.json")],
                        capture_output=True, text=True, timeout=3600,
                        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
  if proc.returncode != 0:
    raise RuntimeError(f"TRL run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
  return json.loads((folder / "trl.json").read_text())


def print_report(s: dict, d: dict, trl: dict | None) -> None:
  sec = d["seconds"]
  rows = [{"part": k, "ms": sec[k], "share": d["share"].get(k)} for k in
          ("sampling", "scoring", "update", "step")]
  print(common.format_table(rows, [
      ("distillax step part", lambda r: r["part"]), ("ms", lambda r: common.fmt_ms(r["ms"])),
      ("share of step", lambda r: "-" if r["share"] is None else f"{100 * r['share']:.0f}%")]))
  print(f"sampled tokens/s: step {d['step_tokens_per_s']:.0f}, sampling program "
        f"{d['sampling_tokens_per_s']:.0f}, Sampler alone {d['sampler_tokens_per_s']:.0f}")
  if trl:
    print(f"TRL GKDTrainer ({trl['torch_threads']} torch threads): step "
          f"{common.fmt_ms(trl['step_s'])} ms (generate "
          f"{common.fmt_ms(trl['generate_s'])} ms), {trl['step_tokens_per_s']:.0f} sampled "
          f"tokens/s; distillax / TRL = {d['step_tokens_per_s'] / trl['step_tokens_per_s']:.2f}x")


def main() -> int:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=0, help="timed rounds")
  parser.add_argument("--trl-python", default="", help="an interpreter with trl installed")
  parser.add_argument("--trl-threads", type=int, default=1,
                      help="torch intra-op threads of the TRL run (see lib/on_policy_trl.py)")
  args = subproc.parse_args(parser)

  s = settings(args.quick)
  s["reps"] = args.reps or s["reps"]
  s["trl_threads"] = args.trl_threads
  tokenizer = ByteTokenizer()
  vocab = padded_vocab_size(tokenizer)
  student_cfg, teacher_cfg = model_configs(s, vocab)
  prompt_ids = prompts(s, tokenizer.vocab_size)
  load = os.getloadavg()
  programs = DistillaxPrograms(s, student_cfg, teacher_cfg, prompt_ids, tokenizer.pad_id)
  print(f"distillax compiled in {programs.compile_s:.0f}s; load {load}", flush=True)
  trl, check = None, None
  with tempfile.TemporaryDirectory(dir=os.environ.get("ON_POLICY_BENCH_TMP")) as tmp:
    if args.trl_python:
      paths = export_models(programs, tokenizer, Path(tmp))
      trl = run_trl(args.trl_python, s, paths, prompt_ids, tokenizer.pad_id, Path(tmp))
      ours = programs.first_logits(prompt_ids[0])
      check = max(abs(a - b) for a, b in zip(ours, trl["first_logits"]))
    d = measure_distillax(s, programs)
  print(f"\n{'tiny' if s['models'] == 'tiny' else 'demo_student <- demo_teacher'}, "
        f"{s['batch']} prompts of <= {s['prompt_len']} tokens, {s['max_new_tokens']} sampled "
        f"tokens each, fp32, one {common.machine_info()['platform']} device")
  print_report(s, d, trl)
  checks = []
  if trl:
    ratio = d["step_tokens_per_s"] / trl["step_tokens_per_s"]
    checks = [{"check": "same student logits in both systems (max abs diff)", "value": check,
               "target": 1e-3, "pass": check <= 1e-3, "required": True},
              {"check": "distillax sampled tokens/s over TRL's", "value": ratio,
               "target": TARGET_RATIO, "pass": ratio >= TARGET_RATIO}]
    for c in checks:
      print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['check']}: {c['value']:.3g} "
            f"(target {c['target']})")
  path = common.write_json(args.out, "on_policy", {
      "machine": common.machine_info(), "quick": args.quick, "settings": s,
      "student": common.config_summary(student_cfg), "teacher": common.config_summary(teacher_cfg),
      "load_avg_before": load, "load_avg_after": os.getloadavg(), "distillax": d, "trl": trl,
      "checks": checks})
  print(f"\nwrote {path}")
  return 0 if all(c["pass"] for c in checks if c.get("required")) else 1


if __name__ == "__main__":
  sys.exit(main())
