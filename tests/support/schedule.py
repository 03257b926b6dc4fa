"""The order the suite's files reach xdist's two workers: heaviest first.

`make test` gives whole files to workers (--dist loadfile) in collection order
(--no-loadscope-reorder); xdist's own reorder sends the files with the most tests first, which
leaves the heavy files of one or two tests (a SIGKILL resume, a CLI walkthrough, the demo) to
the end, where one worker runs them while the other idles. Sending the known-heavy files first
and the rest by test count lets the many small files even out the two workers' ends.

HEAVY_FILES: the files of 12 s or more of one worker's time, in that order, from a --durations
run of the whole suite on a 2-core host (the suite's order only, never a test's outcome: a file
missing here, or no longer there, only runs later).
"""

from __future__ import annotations

from collections import Counter

HEAVY_FILES = (
    "tests/test_configs.py", "tests/plan/test_target.py", "tests/test_main.py",
    "tests/test_families_compose.py", "tests/trainers/test_base.py",
    "tests/framework/test_backends.py", "tests/trainers/on_policy/test_recipe.py",
    "tests/benchmarks/test_accelerator_bench.py", "tests/trainers/test_recipe.py",
    "tests/framework/test_gradient_reduction.py", "tests/distill/test_multi_teacher.py",
    "tests/trainers/on_policy/test_resume.py", "tests/distill/on_policy/test_sliced.py",
    "tests/test_expert_load.py", "tests/distill/on_policy/test_objective.py",
    "tests/models/test_transformer.py", "tests/benchmarks/test_scripts.py",
    "tests/framework/test_token_rows.py", "tests/models/hf/test_gemma4.py",
    "tests/eval/test_generate.py", "tests/quant/test_recovery.py",
    "tests/test_walkthrough_hf.py", "tests/framework/test_expert_parallel.py",
    "tests/trainers/test_saved.py", "tests/models/test_sampler.py",
    "tests/models/test_sharding_goldens.py", "tests/trainers/test_cross_tokenizer_resume.py",
    "tests/edge/test_llama_cpp.py", "tests/test_cli.py", "tests/trainers/test_workdir.py",
    "tests/trainers/on_policy/test_sampler_devices.py",
    "tests/benchmarks/test_plan_targets_bench.py", "tests/test_export_gguf.py",
    "tests/quant/test_lora.py", "tests/plan/test_local.py", "tests/test_docstring_commands.py",
    "tests/test_draft.py", "tests/distill/test_hidden_cache.py",
    "tests/framework/test_evaluation.py", "tests/framework/run/test_checkpoint.py",
    "tests/trainers/test_multi_teacher_resume.py", "tests/distill/on_policy/test_losses.py",
    "tests/framework/run/test_runtime.py", "tests/models/test_speculative.py",
    "tests/benchmarks/test_qat_bench.py", "tests/distill/test_training_from_cache.py",
    "tests/models/attention/test_impls.py", "tests/quant/test_ggml.py",
    "tests/models/hf/test_qwen35.py", "tests/models/hf/test_deepseek.py",
    "tests/models/hf/test_gemma3.py", "tests/distill/on_policy/test_two_batches.py",
    "tests/quant/test_moe.py", "tests/benchmarks/test_edge_bench.py",
    "tests/models/attention/test_decode.py", "tests/distill/test_vocab_passes.py",
    "tests/framework/test_vocab_slices.py", "tests/quant/test_round_once.py",
    "tests/quant/test_qlora_dequant.py", "tests/models/hf/test_llama4.py",
    "tests/edge/test_export.py", "tests/trainers/test_students.py",
    "tests/trainers/test_qat_schedule.py", "tests/edge/test_moe.py", "tests/models/hf/test_moe.py",
    "tests/data/test_records.py", "tests/models/attention/test_mla.py",
    "tests/benchmarks/test_kd_vocab_bench.py", "tests/test_cli_errors.py",
    "tests/framework/test_chunked_loss.py", "tests/models/test_gated_deltanet.py",
    "tests/distill/cross_tokenizer/test_uld.py", "tests/distill/cross_tokenizer/test_losses.py",
    "tests/quant/test_int8.py",
)


def heaviest_first(items: list) -> None:
  """Sorts pytest's items in place: HEAVY_FILES in their order, then the other files by their
  number of tests (most first); a file's own tests keep their order and stay together."""
  path_of = lambda item: item.nodeid.split("::")[0]
  rank = {path: i for i, path in enumerate(HEAVY_FILES)}
  counts = Counter(path_of(item) for item in items)

  def key(item):
    path = path_of(item)
    return (rank[path], 0, path) if path in rank else (len(rank), -counts[path], path)

  items.sort(key=key)
