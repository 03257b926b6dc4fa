"""lm-eval requests per second: distillax's adapter against lm-eval's own Hugging Face backend.

  python benchmarks/task_eval.py [--quick]

One random Llama (transformers, width 256, 4 layers, a 2,048-id BPE trained on the embedded
corpus, max_position_embeddings 256) saved to a temporary folder; distillax loads that folder
and lm-eval's HFLM loads it too (float32, CPU, batch 8 both). Both answer the same requests: the
shipped local task's 12 snippets x 3 choices as loglikelihood requests (repeated), and the 12
snippets as greedy generate_until requests (up to 16 tokens, to the end of the line). Neither
scores a repeat again: HFLM runs one forward per group of requests sharing context and all but
the last continuation token (its logits cache), distillax's TokenScorer one per distinct row. Each
backend runs every kind once to warm up (distillax compiles there, HFLM has nothing to compile),
then once timed; requests/s of the timed run and the ratio are reported, with the largest
per-request |Δ log-likelihood| between the two and whether the generations are the same text.
HFLM runs with 1 torch thread and with one per core, and its faster figure is the reference: on
a busy host, torch's threads wait on each other (a forward 10-20x slower with 2 threads than 1
at load 19 on 2 cores). The figure is one run, not a median.

--quick: fewer repeats. Writes benchmarks/results/task_eval.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax.data import stdlib_files  # noqa: E402
from distillax.eval.harness import DistillaxLM  # noqa: E402
from distillax.eval.lm_tasks import LOCAL_TASKS  # noqa: E402
from distillax.generate import load_model_dir  # noqa: E402

VOCAB = 2048


def corpus_lines() -> list[str]:
  root, _ = stdlib_files()
  with open(os.path.join(root, "os.py"), encoding="utf-8") as f:
    return [line for line in f.read().splitlines() if line.strip()]


def save_model(folder: str) -> None:
  """A BPE whose encoding starts with BOS, and a random Llama, saved as transformers saves."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(corpus_lines(), trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>").save_pretrained(folder)
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)


def requests(repeats: int) -> tuple[list, list]:
  with open(os.path.join(LOCAL_TASKS, "distillax_code", "code_completion.jsonl")) as f:
    docs = [json.loads(line) for line in f]
  loglik = [Instance("loglikelihood", {}, (d["context"], c), i)
            for i, (d, c) in enumerate((d, c) for d in docs for c in d["choices"])] * repeats
  until = {"until": ["\n"], "do_sample": False, "max_gen_toks": 16}
  generate = [Instance("generate_until", {}, (d["context"], until), i) for i, d in enumerate(docs)]
  return loglik, generate


def timed(fn, reqs) -> tuple[list, float]:
  fn(reqs)  # warm-up: distillax compiles its length buckets and the sampler here
  start = time.perf_counter()
  out = fn(reqs)
  return out, len(reqs) / (time.perf_counter() - start)


def main() -> int:
  args = subproc.parse_args(subproc.base_parser(__doc__.splitlines()[0]))
  loglik, generate = requests(2 if args.quick else 8)
  with tempfile.TemporaryDirectory() as folder:
    save_model(folder)
    ours = DistillaxLM(load_model_dir(folder), batch_size=8)
    hflm = HFLM(pretrained=folder, device="cpu", batch_size=8, dtype="float32")
    rows = []
    ours_ll, ours_ll_rate = timed(ours.loglikelihood, loglik)
    ours_gen, ours_gen_rate = timed(ours.generate_until, generate)
    torch_threads = {}
    for threads in (1, os.cpu_count() or 1):
      torch.set_num_threads(threads)
      hf_ll, ll_rate = timed(lambda r: hflm.loglikelihood(r, disable_tqdm=True), loglik)
      hf_gen, gen_rate = timed(lambda r: hflm.generate_until(r, disable_tqdm=True), generate)
      torch_threads[threads] = {"loglikelihood_per_s": ll_rate, "generate_until_per_s": gen_rate}
    hf_ll_rate = max(t["loglikelihood_per_s"] for t in torch_threads.values())
    hf_gen_rate = max(t["generate_until_per_s"] for t in torch_threads.values())
  delta = max(abs(a[0] - b[0]) for a, b in zip(ours_ll, hf_ll))
  for kind, n, mine, theirs in (("loglikelihood", len(loglik), ours_ll_rate, hf_ll_rate),
                                ("generate_until", len(generate), ours_gen_rate, hf_gen_rate)):
    rows.append({"requests": kind, "count": n, "distillax_per_s": mine, "hflm_per_s": theirs,
                 "ratio": mine / theirs})
  print(common.format_table(rows, [
      ("requests", lambda r: r["requests"]), ("count", lambda r: r["count"]),
      ("distillax_per_s", lambda r: f"{r['distillax_per_s']:.1f}"),
      ("hflm_per_s", lambda r: f"{r['hflm_per_s']:.1f}"),
      ("ratio", lambda r: common.fmt_ratio(r["ratio"]))]))
  print(f"max |Δ loglik| {delta:.2e}; same generations: {ours_gen == hf_gen}")
  payload = {"machine": common.machine_info(), "quick": args.quick, "rows": rows,
             "max_abs_loglik_delta": delta, "same_generations": ours_gen == hf_gen,
             "hflm_by_torch_threads": torch_threads,
             "compiled_score_shapes": sorted(ours.scorer.compiled_shapes)}
  path = common.write_json(args.out, "task_eval", payload)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
