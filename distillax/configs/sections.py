"""Every config section's defaults, each in one place. A job config composes the sections it
needs (`configs/common.base_config` and the job files); the CLI's `--config.a.b=v` overrides are
type-checked against these values. Each field has a one-line comment.

The `data` and `optimizer` sections live with the code that reads them
(`distillax.data.default_data_config`, `distillax.framework.optim.default_optimizer_config`).
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def mesh_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.data = -1  # data-parallel axis size; -1 = whatever the model axis leaves
  c.model = 1  # tensor-parallel axis size
  c.dcn_data = 1  # slices along data over DCN (multi-slice pods)
  c.dcn_model = 1  # slices along model over DCN (rarely useful)
  return c


def partitioning_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.strategy = "fsdp"  # dp | fsdp | tp | fsdp_tp | tp_sp | fsdp_tp_sp | fsdp_ep | ep_tp | registered
  c.rules = ()  # extra (logical, mesh axes) rules placed before the preset's
  c.replicate_indivisible = False  # replicate dims a mesh axis does not divide
  # auto | per_step | per_use. With parameters replicated over data (dp, tp): per_step sums
  # micro-batches and tied weights locally and all-reduces once per step; per_use lets the
  # compiler reduce each contribution where it is made (overlappable with backward). auto picks
  # per_step under accumulation or tied embeddings. fsdp/fsdp_tp always reduce per use.
  c.gradient_reduction = "auto"
  return c


def train_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.steps = 200  # optimizer steps in the run
  c.batch_size = 16  # global batch, in sequences
  c.seq_len = 128  # tokens per sequence
  c.accum_steps = 1  # micro-batches per step (gradient accumulation inside the step)
  c.log_every = 10  # steps between metric rows
  c.eval_every = 50  # steps between evals (0 = only at the end)
  c.eval_batches = 8  # batches per eval
  # The eval figure the rollback guard and early stop watch, in its own direction
  # (framework/eval_rules.py); None = the one the job's objective lowers: eval_perplexity (lm,
  # sequence_kd), eval_objective (distillation), eval_on_policy_reverse_kl (on_policy). Also
  # eval_loss (next-token CE), eval_accuracy (lm, sequence_kd), eval_on_policy_teacher_nll
  # (on_policy) and, with eval.generate, eval_bleu, eval_chrf, eval_rouge_l (higher is better).
  c.rollback_metric = config_dict.placeholder(str)
  c.rollback_threshold = 0.05  # roll back when that figure worsens this share of its best
  c.rollback_lr_factor = 0.5  # learning-rate scale after a rollback
  c.max_rollbacks = 2  # rollbacks allowed before the run fails
  c.early_stop_evals = 0  # evals without improvement of rollback_metric before stopping; 0 = off
  c.progress = True  # progress bar with ETA on the console
  # workdir of an earlier run whose final weights start this one, or a Hugging Face checkpoint
  # directory (the student then has its shape, as with student.hf_path)
  c.init_from = ""
  # Mixture-of-experts students (model.num_experts > 0) in lm, sequence_kd and distill jobs:
  c.moe_aux_loss = 0.0  # weight of the Switch load-balancing loss (1 when balanced)
  c.router_z_loss = 0.0  # weight of the router z-loss: mean squared logsumexp of router logits
  # How the train losses over the vocabulary run: auto (sliced where it may, else chunked) |
  # chunked (the vocabulary-chunk engine, chunks of positions) | sliced (slices of the vocabulary
  # over every position: next-token CE, and a distill job's LogitKD forward KL with one teacher;
  # an output layer neither adapted nor quantized). Every eval keeps the chunked engine.
  c.loss_impl = "auto"
  # What the trained student will be exported as, checked before anything compiles: "gguf"
  # refuses at start a student llama.cpp would run differently (a Gemma 3 student of blocks
  # whose sliding layers break its five-in-six pattern, say); "hf" or "" = not checked ("":
  # a student whose GGUF export would be refused gets one warning line at start).
  c.export_format = ""
  return c


def eval_section() -> ml_collections.ConfigDict:
  """What each in-training eval measures besides the validation loss."""
  c = ml_collections.ConfigDict()
  # A held-out prompt/completion JSONL whose prompts are greedily completed at each eval and
  # scored against its completions (eval_bleu, eval_chrf, eval_rouge_l; the eval extra);
  # '' = off
  c.generate = ""
  c.max_new_tokens = 32  # tokens each completion may take (fewer when it emits EOS)
  return c


def checkpoint_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.every_steps = 100  # steps between checkpoints (0 = only at the end)
  c.keep = 2  # newest checkpoints kept
  c.keep_best = 1  # best checkpoints by train.rollback_metric kept besides the newest
  c.async_save = True  # write checkpoints in the background
  return c


def qat_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Fake-quant rules, first match wins. Each rule is a (module path regex, weight qtype int8|
  # int4|nf4|float8_e4m3fn, activation qtype int8|float8_e4m3fn|None, tile size or None = per
  # channel) tuple or a dict with those names ({"module_path": ..., "weight_qtype": ...}).
  # Empty = no quantization-aware training.
  c.rules = ()
  c.start_step = 0  # full-precision steps before fake quantization starts
  c.schedule = ()  # progressive QAT: ((step, rules), ...) stages, fp before the first; () = off
  # Rules of int8 weights + int8 activations per channel run their forward matmuls as int8
  # dots (s8 x s8 -> s32, the int8 MXU rate on a TPU) instead of fake-quant bf16 ones.
  c.int8_matmul = False
  # With int8_matmul, the backward's two matmuls (dx, dw) in int8 too, the cotangent rounded
  # per token or per channel (MaxText's int8 training): every matmul at the int8 rate.
  c.int8_backward = False
  return c


def lora_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.module_regex = ""  # matmul weights that get adapters, e.g. 'layers/(.*/)?attn/.*'; '' = off
  c.rank = 8  # adapter rank
  c.alpha = 16.0  # adapter scaling numerator (scale = alpha / rank)
  c.dropout = 0.0  # dropout on the adapter input during training (0: PEFT's and torchtune's)
  c.base_qtype = ""  # QLoRA: store frozen base weights as nf4 | int4 ('' = full precision)
  c.base_tile_size = 64  # QLoRA: inputs per quantization scale tile
  return c


def profile_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.start_step = -1  # first step traced with jax.profiler (-1 = off)
  c.num_steps = 3  # steps in the traced window
  return c


def runtime_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.coordinator_address = ""  # HOST:PORT of process 0 for multi-process runs
  c.num_processes = 0  # processes in the job (0 = single process or auto)
  c.process_id = -1  # this process's index (-1 = from the environment)
  c.auto_detect = False  # let JAX detect a TPU pod / SLURM / Open MPI cluster
  return c


def teacher_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = ""  # a distillax run whose newest checkpoint is the teacher
  c.hf_path = ""  # or a Hugging Face checkpoint directory (config.json + safetensors)
  c.preset = "demo_teacher"  # or a preset with fresh weights (tests, benchmarks)
  c.param_dtype = ""  # override the teacher's parameter dtype ('' = as stored)
  # Override the teacher's compute dtype ('' = as stored: float32 for presets); 'bfloat16' runs
  # its forward, output layer included, in bf16 (fp32 accumulation and fp32 logits).
  c.dtype = ""
  # Keep the frozen teacher's matmul weights (attention, MLP, experts, output layer or tied
  # embedding) as int8 codes + per-channel scales, half its bf16 memory, and run those matmuls
  # as int8 x int8 -> int32 dots with each input quantized per token (quant/int8_model.py).
  c.int8 = False
  # How the teacher's attention runs: auto | reference | blockwise | cudnn | splash | tokamax;
  # '' = as the student's (model.attention_impl), so one flag sets both models'
  c.attention_impl = ""
  c.cache_dir = ""  # an offline teacher cache (distillax cache-teacher): train without a teacher
  # The teacher's tokenizer when it differs from the student's (distill.objective=
  # 'cross_tokenizer'): 'byte' | 'hf:<tokenizer.json or its folder>'; '' = the teacher
  # checkpoint's tokenizer.json, else data.tokenizer
  c.tokenizer = ""
  return c


def teachers_entry(name: str, weight: float = 1.0, **fields) -> ml_collections.ConfigDict:
  """One entry of a `teachers` list (configs/distill_multi_teacher.py): a teacher section (its
  source: workdir / hf_path / preset, and dtype overrides) plus a name and a weight."""
  c = teacher_section()
  # Each of several teachers runs the student's attention_impl: the entries keep the fields
  # that earlier runs' `teachers` lists hold (a list is compared whole for the job's identity).
  del c["attention_impl"]
  c.name = name  # what routing rules, metrics and the workdir's teachers.json call it
  c.weight = float(weight)  # its share of the mixture (distill.teachers_mode='mixture')
  c.update(fields)
  return c


def multi_teacher_distill_section() -> ml_collections.ConfigDict:
  """The distill section of a several-teacher job: the strategies' fields and how the
  teachers become one KD target."""
  c = distill_section()
  # mixture: the target is sum_i w_i softmax(t_i / T) over `teachers` (weights normalised);
  # routing: each record's KD term reads only the teacher its batch's teacher index names
  c.teachers_mode = "mixture"
  # routing: (data source, teacher name) pairs, e.g. (('math/*.jsonl', 'a'), ('code', 'b')):
  # each batch takes equal rows from every source's own pipeline, taught by its teacher
  c.routes = ()
  return c


def student_section() -> ml_collections.ConfigDict:
  """Where the student's first weights come from, besides fresh ones and `train.init_from`. A
  student from either source has that source's shape (the `model` section keeps only how it
  runs: param_dtype, dtype, scan_layers, remat)."""
  c = ml_collections.ConfigDict()
  c.hf_path = ""  # a Hugging Face checkpoint directory (config.json + safetensors) to start from
  c.from_teacher = ml_collections.ConfigDict()
  # Teacher blocks the student starts as, e.g. (0, 2, 4): embeddings, final norm and head come
  # with them; () = off
  c.from_teacher.layers = ()
  # Mixture-of-experts teacher: the experts each copied block keeps (student expert j = teacher
  # expert experts[j]), e.g. (0, 3, 5) in every layer or ((0, 3), (1, 2)) per student layer, as
  # `distillax expert-load --keep_top N` prints them; () = all
  c.from_teacher.experts = ()
  return c


def distill_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Tokens per logit chunk (student and teacher together). -1 = auto: per device, the most
  # positions whose fp32 logits of one model (rows on the device x positions x vocab on the
  # device x 4 bytes) fit 128 MiB, capped at the sequence; 0 = unchunked [B, L, V] logits.
  # Chunked, no logit array of the whole batch exists and the student's logit gradient is
  # formed in the same pass as the loss (framework/vocab_chunks.py, shared with next-token CE).
  c.chunk_size = -1
  # strategies (the weighted strategies below; teacher and student share one tokenizer) |
  # cross_tokenizer (a teacher of teacher.tokenizer: the two tokenizations of each text aligned
  # by bytes; the `cross_tokenizer` sub-section below)
  c.objective = "strategies"
  c.cross_tokenizer = ml_collections.ConfigDict()
  c.cross_tokenizer.temperature = 2.0  # softmax temperature of both models
  c.cross_tokenizer.alpha = 0.7  # share of the soft terms; 1 - alpha goes to hard-label CE
  c.cross_tokenizer.exact_weight = 1.0  # KL over the shared vocabulary, one-to-one groups
  c.cross_tokenizer.span_weight = 1.0  # Bernoulli KL of span probabilities, groups that differ
  c.cross_tokenizer.uld_weight = 1.0  # ULD (sorted-probability L1) on those groups
  c.cross_tokenizer.teacher_seq_len = 0  # teacher tokens per row; 0 = train.seq_len
  c.logit = ml_collections.ConfigDict()
  c.logit.weight = 1.0  # weight of LogitKD in the total loss (0 = off)
  c.logit.temperature = 2.0  # softmax temperature of both models
  c.logit.alpha = 0.7  # share of the soft (teacher) term; 1 - alpha goes to hard-label CE
  c.logit.divergence = "forward_kl"  # forward_kl | reverse_kl | jsd
  c.logit.beta = 0.5  # JSD mixing weight
  c.logit.top_k = 0  # compare over the teacher's top-k tokens (+ a rest bucket); 0 = full vocab
  # AttentionTransfer, FeaturePooling, FeatureProjection: one sub-section each.
  for name, loss in (("attention", "kl"), ("feature_pooling", "cosine"),
                     ("feature_projection", "cosine")):
    s = ml_collections.ConfigDict()
    s.weight = 0.0  # weight of this strategy in the total loss (0 = off)
    # "s:t,..." student->teacher blocks (attention) or hidden states (features; 0 =
    # embeddings); auto maps each student layer to the same relative depth
    s.layer_map = "auto"
    s.loss = loss  # kl | mse (attention); cosine | mse (features)
    c[name] = s
  # RouterKD: each MoE student router's softmax imitates its teacher layer's (KL per token,
  # averaged over layers), restricted to the experts the student kept: needs a student of
  # teacher blocks (student.from_teacher.layers / .experts) or one with the teacher's experts.
  c.router = ml_collections.ConfigDict()
  c.router.weight = 0.0  # weight of router distillation in the total loss (0 = off)
  return c


def cache_section() -> ml_collections.ConfigDict:
  """Read by `distillax cache-teacher`."""
  c = ml_collections.ConfigDict()
  c.num_batches = 100  # train batches (train.batch_size x train.seq_len) the teacher runs over
  c.kind = "topk"  # topk (its top-k log-probs at one T) | hidden (final hidden states + LM head)
  c.top_k = 32  # teacher tokens kept per position (the rest is one bucket of missing mass)
  c.dtype = "bfloat16"  # kind=hidden: stored hidden states, bfloat16 | float32 (exact logits)
  c.dir = ""  # where the cache goes ('' = --workdir)
  c.rows_per_file = 4096  # rows per ArrayRecord file
  return c


def sequence_kd_section() -> ml_collections.ConfigDict:
  # The samples a frozen model writes before training: sequence_kd's teacher, or a draft job's
  # target with draft.regenerate=True (trainers/teacher_samples.py).
  c = ml_collections.ConfigDict()
  c.num_prompts = 256  # train documents whose beginnings become prompts
  # Prompt tokens per text document (BOS included; shorter documents give less). Chat and
  # prompt/completion records give their whole prompt, and are skipped when it is longer.
  c.prompt_len = 32
  c.max_new_tokens = 96  # teacher tokens generated per prompt (fewer if it emits EOS)
  c.temperature = 1.0  # teacher sampling temperature (0 = greedy decoding)
  c.top_k = 0  # sample from the teacher's top-k tokens only (0 = off)
  c.top_p = 1.0  # nucleus sampling mass (1 = off)
  c.batch_size = 32  # prompts per generation call (rounded up to the data-parallel size)
  # Each text sample starts with its prompt (False: continuation only); a draft's samples are
  # always a prompt and its answer.
  c.include_prompt = True
  c.output = ""  # the JSONL written ('' = <workdir>/teacher_samples.jsonl)
  return c


__all__ = ["cache_section", "checkpoint_section", "distill_section", "eval_section",
           "lora_section", "mesh_section", "partitioning_section", "profile_section",
           "qat_section", "runtime_section", "sequence_kd_section", "student_section",
           "teacher_section", "train_section"]
