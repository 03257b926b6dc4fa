"""TRL's GKDTrainer on the job benchmarks/on_policy.py measures in distillax (run by it).

  /tmp/trl_venv/bin/python -P benchmarks/lib/on_policy_trl.py SPEC.json

Runs in an interpreter with trl, torch and transformers (never distillax's own environment):
SPEC.json names the two models distillax exported (config.json + safetensors + tokenizer), the
prompts as token ids, max_new_tokens, beta, temperature, reps and where to write the result.
GKDConfig(lmbda=1): every step samples. A step is what the HF Trainer loop does per step:
GKDTrainer.training_step (HF generate with the KV cache, the student's and teacher's
forwards, the generalized JSD and backward), then the optimizer and scheduler steps. Prompts go
in left-padded, as TRL's collator and HF generate want them; no stop token (eos_token_id None),
so every completion has exactly max_new_tokens tokens, as on the distillax side. `generate`
alone (TRL's generate_on_policy_outputs) is timed too. torch runs `threads` intra-op threads
(default 1): on a shared 2-core machine its 2 spinning OpenMP threads made the same HF generate
60x slower (measured: 8 x 64 tokens of demo_student in 30 s with 2 threads, 0.47 s with 1).
"""

import json
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")  # before torch, transformers and trl import

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402


def _inputs(prompts, pad_id):
  width = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
  mask = torch.zeros((len(prompts), width), dtype=torch.long)
  for i, p in enumerate(prompts):  # left padding
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  return {"prompts": ids, "prompt_attention_mask": mask, "input_ids": ids.clone(),
          "attention_mask": mask.clone(), "labels": torch.full_like(ids, -100)}


def _trainer(spec, folder):
  torch.manual_seed(0)
  tokenizer = AutoTokenizer.from_pretrained(spec["student"])
  load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  args = GKDConfig(output_dir=folder, lmbda=1.0, beta=spec["beta"],
                   temperature=spec["temperature"], max_new_tokens=spec["max_new_tokens"],
                   per_device_train_batch_size=len(spec["prompts"]), report_to=[],
                   use_cpu=True, bf16=False, fp16=False, save_strategy="no", max_steps=1000,
                   logging_steps=10**9, disable_dropout=True)
  trainer = GKDTrainer(model=load(spec["student"]), teacher_model=load(spec["teacher"]),
                       args=args, processing_class=tokenizer,
                       # required by the constructor; the steps below take their own inputs
                       train_dataset=Dataset.from_dict({"messages": [[
                           {"role": "user", "content": "x"},
                           {"role": "assistant", "content": "y"}]]}))
  # No stop token: exactly max_new_tokens per completion, the distillax side's work.
  trainer.generation_config.eos_token_id = None
  trainer.generation_kwargs["eos_token_id"] = None
  trainer.create_optimizer_and_scheduler(num_training_steps=1000)
  trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets before its steps
  return trainer


def main(spec_path: str) -> int:
  spec = json.load(open(spec_path))
  torch.set_num_threads(int(spec.get("threads", 1)))
  with tempfile.TemporaryDirectory() as folder:
    trainer = _trainer(spec, folder)
    model, prompts = trainer.model, spec["prompts"]
    with torch.no_grad():
      first = model(torch.tensor([prompts[0]])).logits[0, -1].tolist()
    inputs = _inputs(prompts, spec["pad_id"])
    lengths = []

    def step():
      start = time.perf_counter()
      loss = trainer.training_step(model, dict(inputs))
      trainer.optimizer.step()
      trainer.lr_scheduler.step()
      model.zero_grad()
      return time.perf_counter() - start, float(loss)

    def generate():
      start = time.perf_counter()
      with torch.no_grad():
        ids, mask, _ = trainer.generate_on_policy_outputs(model, dict(inputs),
                                                          trainer.generation_config)
      lengths.append(int(mask[:, inputs["prompts"].shape[1]:].sum()))
      return time.perf_counter() - start

    step()  # warm-up
    generate()
    steps, gens, losses = [], [], []
    for _ in range(int(spec["reps"])):  # interleaved: the machine's slow moments hit both
      seconds, loss = step()
      steps.append(seconds)
      losses.append(loss)
      gens.append(generate())
  tokens = len(prompts) * int(spec["max_new_tokens"])
  assert all(n == tokens for n in lengths), (lengths, tokens)
  step_s, gen_s = statistics.median(steps), statistics.median(gens)
  result = {"step_s": step_s, "step_s_all": steps, "generate_s": gen_s, "generate_s_all": gens,
            "sampled_tokens": tokens, "step_tokens_per_s": tokens / step_s,
            "generate_tokens_per_s": tokens / gen_s, "losses": losses, "first_logits": first,
            "torch_threads": torch.get_num_threads(),
            "versions": {m: __import__(m).__version__ for m in ("trl", "torch", "transformers")}}
  with open(spec["out"], "w") as f:
    json.dump(result, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
