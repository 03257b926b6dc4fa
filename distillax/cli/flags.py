"""What the command line accepts, as data: the commands, what each does, the flags each reads
and every flag's kind, default and help. main.py defines the absl flags from these tables, help.py
prints them and error_lines.py names them in its fixes, so a flag is described in one place.
"""

from __future__ import annotations

COMMANDS = ("train", "plan", "export", "cache-teacher", "demo", "generate", "eval", "expert-load")
USAGE = ("usage: distillax {train,plan,export,cache-teacher,demo,generate,eval,expert-load} "
         "--config "
         "<file.py>[:arg] [--workdir DIR] [--config.key=value ...]")
# Commands whose --config is optional: a run's own config.json says what they need.
CONFIG_OPTIONAL = ("generate", "eval", "export", "expert-load")
ABOUT = {
    "train": "train the job a config describes in --workdir; the same command again resumes it",
    "plan": "compile the step for --devices simulated devices (or, with --target, for a TPU "
            "slice or GPU nodes with their own compiler) and print where every array lives and "
            "what each device holds; exit 3 when it does not fit; nothing is trained or written",
    "export": "write the trained student of the run in --workdir to --output (Hugging Face "
              "safetensors, GGUF for llama.cpp, or the legacy quantized format only distillax "
              "reads)",
    "cache-teacher": "run a distill config's teacher over the data once and store its top-k "
                     "logits (or, --kind hidden, its final hidden states and LM head), to "
                     "distill without a teacher in the step",
    "demo": "the end-to-end demo: teacher, students from scratch and distilled, PTQ and QAT, "
            "then a report",
    "generate": "continue --prompt (or answer the chat turns of --messages) with the model in "
                "--model (a run's workdir, a Hugging Face directory or an export) and print it",
    "eval": "print the exact eval loss and perplexity of --model (a run, or a Hugging Face "
            "directory with a --config naming the data) on its validation split; with --tasks, "
            "lm-evaluation-harness tasks' metrics (the eval extra); with --against, how far "
            "it moved from its full-precision twin; with --draft, a speculative-decoding draft's "
            "acceptance lengths",
    "expert-load": "print each mixture-of-experts layer's share of routed tokens per expert on "
                   "the job's train data, for --model or the --config's teacher; --keep_top N "
                   "prints the student.from_teacher.experts that keeps the N most loaded",
}
# The flags that launch a process as one of several (jax.distributed).
DISTRIBUTED_FLAGS = ("coordinator_address", "num_processes", "process_id")
# The flags each command reads besides --config and --verbose.
COMMAND_FLAGS = {
    "train": ("workdir", "devices") + DISTRIBUTED_FLAGS,
    "plan": ("devices", "memory_gb", "target", "slices", "nodes", "search"),
    "export": ("workdir", "output", "format", "quant", "devices") + DISTRIBUTED_FLAGS,
    "cache-teacher": ("workdir", "kind", "devices") + DISTRIBUTED_FLAGS,
    "demo": ("workdir", "devices") + DISTRIBUTED_FLAGS,
    "generate": ("model", "prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p",
                 "seed", "full_precision", "devices"),
    "eval": ("model", "tasks", "num_fewshot", "limit", "output", "against", "generate",
             "max_new_tokens", "draft", "proposals", "temperature", "devices") + DISTRIBUTED_FLAGS,
    "expert-load": ("model", "json", "keep_top", "batches", "devices"),
}
# Flags that name a directory: made absolute (from the current directory) before a job sees them.
PATH_FLAGS = ("workdir", "output", "model", "json", "against", "generate", "draft")
# name -> (absl flag kind, default, placeholder in --help, help)
FLAGS = {
    "workdir": ("string", None, "DIR", "the run's directory (config.json, metrics, checkpoints); "
                                       "export reads it, cache-teacher writes the cache there"),
    "kind": ("string", None, "KIND", "cache-teacher: topk (default: cache.kind) | hidden (final "
                                     "hidden states + LM head: exact logits, any strategy)"),
    "devices": ("integer", None, "N", "simulate N CPU devices (plan; training on a CPU host)"),
    "memory_gb": ("float", None, "GIB", "per-device memory to check the plan against (default "
                                        "with --target: the chip's)"),
    "target": ("string", None, "TARGET", "compile with a TPU's or GPU's own compiler from this "
                                         "host: tpu:v5e-4 | tpu:v5p-128 | tpu:v6e-64 | "
                                         "tpu:v4-32 | tpu:tpu7x-16 | gpu:h100x8 | gpu:h200x8 | "
                                         "gpu:b200x8 (the aot / aot-gpu extras)"),
    "slices": ("integer", None, "N", "--target tpu:...: N slices over DCN (multi-slice)"),
    "nodes": ("integer", None, "N", "--target gpu:...: N nodes of that many GPUs"),
    "search": ("bool", False, "", "--target: find the largest per-device batch, then the "
                                  "cheapest model.remat, that fit"),
    "output": ("string", None, "DIR", "export: new or empty directory to write the exported "
                                      "model to; eval --tasks: a JSON file for the metrics"),
    "tasks": ("string", None, "T1,T2", "eval: lm-eval tasks (names, or task YAML files over "
                                       "local data), e.g. distillax_code_mc"),
    "num_fewshot": ("integer", None, "N", "eval --tasks: few-shot examples per prompt"),
    "limit": ("integer", None, "N", "eval --tasks: documents per task at most"),
    "generate": ("string", None, "FILE", "eval: a JSONL of prompt/completion records; prints "
                                         "BLEU, chrF and ROUGE-L of the model's greedy "
                                         "completions against them"),
    "against": ("string", None, "DIR", "eval: the full-precision twin (a run or a Hugging Face "
                                       "directory) to compare --model's next-token "
                                       "distributions with: KL, top-1 / top-p agreement, "
                                       "perplexity ratio"),
    "draft": ("string", None, "DIR", "eval: a speculative-decoding draft (an EAGLE-3 head run, or "
                                     "a whole model with --model naming its target); prints the "
                                     "mean acceptance length at 1..--proposals tokens"),
    "proposals": ("integer", None, "K", "eval --draft: most tokens the draft proposes a round "
                                        "(default: the head's draft.ttt_steps; 4 for a model)"),
    "format": ("string", "hf", "FORMAT", "hf (safetensors) | gguf (llama.cpp) | quantized "
                                         "(legacy: only distillax reads it) | speculators (an "
                                         "EAGLE-3 head for vLLM)"),
    "quant": ("string", None, "TYPE", "--format gguf: f32 (default) | f16 | q8_0 | q4_0 (q8_0/q4_0 "
                                      "where qat.rules say, every matmul without rules)"),
    "coordinator_address": ("string", None, "HOST:PORT", "address of process 0 (multi-process)"),
    "num_processes": ("integer", None, "N", "processes in the job (multi-process)"),
    "process_id": ("integer", None, "I", "index of this process (multi-process)"),
    "verbose": ("bool", False, "", "also show the INFO lines of orbax, jax, grain and absl"),
    "model": ("string", None, "DIR", "a run's --workdir, a Hugging Face checkpoint directory or "
                                     "an export (generate, eval, expert-load)"),
    "prompt": ("string", None, "TEXT", "the text to continue (BOS first when the tokenizer has "
                                       "one)"),
    "messages": ("string", None, "JSON", "chat turns, a JSON list of {\"role\", \"content\"} "
                                         "or a .json file of one, rendered with the tokenizer's "
                                         "chat template"),
    "max_new_tokens": ("integer", 128, "N", "tokens to generate at most"),
    "temperature": ("float", 0.0, "T", "sampling temperature; 0 = greedy"),
    "top_k": ("integer", None, "K", "sample from the K most likely tokens only"),
    "top_p": ("float", None, "P", "sample from the smallest set of tokens with mass P"),
    "seed": ("integer", 0, "N", "sampling seed"),
    "json": ("string", None, "FILE", "expert-load: also write the counts and shares (and the "
                                     "kept experts) to this JSON file"),
    "keep_top": ("integer", None, "N", "expert-load: print the flag keeping each layer's N "
                                       "most loaded experts"),
    "batches": ("integer", 8, "N", "expert-load: train batches of the job's data to route"),
    "full_precision": ("bool", False, "", "decode a QAT run's plain weights, not the fake-quant "
                                          "forward it trained (the default, as eval and its GGUF "
                                          "export run it)"),
}


def flag_values(argv: list[str], name: str) -> list[str]:
  """Every value given to `--name`, in order: a flag may be given more than once (absl keeps
  the last; a config override that does not parse fails at the first such value)."""
  out = []
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      out.append(arg.split("=", 1)[1])
    elif arg == f"--{name}" and i + 1 < len(argv):
      out.append(argv[i + 1])
  return out


def flag_value(argv: list[str], name: str) -> str | None:
  """The value absl keeps for `--name` (as `--name=v` or `--name v`: the last one given), or
  None; read straight from argv for what must be known before absl parses (--devices,
  --config's file)."""
  values = flag_values(argv, name)
  return values[-1] if values else None
