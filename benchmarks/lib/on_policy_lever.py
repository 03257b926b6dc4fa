"""The on-policy candidates of the lever grid,
`on_policy:REMAT:BATCH[:seq_len=W][:new_tokens=T][:micro=M]`: BATCH prompts of W - T tokens,
each continued by T sampled tokens, all sampled at once (the sampling batch), then scored and
learned from in micro-batches of M completions (BATCH / M of them, gradient accumulation; the
trainer's on_policy.micro_batch; default M = BATCH, one micro-batch).

What runs is what the on-policy trainer runs, built from its own pieces: the step is
`make_on_policy_objective` with configs/on_policy.py's divergence (the student samples inside
the compiled step, the teacher grades every completion token), and the decode is timed apart by
the trainer's own sampling-only program (trainers/on_policy/parts.py `sampling_program`: the
same decode, key and prompts as the step's). As the trainer's SamplingClock does, each timed
step first runs that program alone, blocks, then runs the whole step and blocks; the update
(scoring, backward and optimizer) is the difference of the two.

No row stops early: every row samples exactly T tokens, so each step does the same work (a real
run stops rows at EOS). The stop token is the vocabulary's last row, kept out of every draw as a
padded row is (vocab_limit; Qwen's 151,936 rows hold 151,669 tokens): it is never sampled, yet
the completion lengths the sampling program returns still depend on every sampled token, so
the compiler cannot drop the decode (with no stop at all, the lengths are the constant T and
the sampling-only program compiles to nothing). The sampler's tokens/s is set against the decode roofline: a decode step
must read the student's weights once for all rows and each row's KV cache up to its position,
so on a chip of HBM bandwidth BW the sampler cannot beat
  rows * BW / (weight bytes + rows * KV bytes per position * mean context)
tokens/s, the mean context being P + (T - 1) / 2 over the T tokens (the prefill's compute and
every FLOP ignored: an upper bound). `roofline_fraction_with_prefill` adds to that bound's
time what the prefill needs at the chip's peak FLOPs (its matmuls over the B x P prompt tokens,
the output layer left out), since the timed sampling includes the prefill; both are reported,
and `roofline_fraction` is the stricter. Weight bytes are a parameter's at the narrower of its
stored and compute dtypes (the real student's fp32 master weights count 2 bytes, bf16: the
sampling program compiled for a v5e, 4.98 GiB at 6 rows and 5.53 at 8, extrapolates to 3.3 GiB
at none, the fp32 weights' 2.2 and 1.1 more, a bf16 copy's size: cast once, outside the decode
loop, as far as sizes tell), the input embedding table left out unless tied to the output
layer, since its gather reads one row a token.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib import common
from distillax.configs.on_policy import on_policy_section
from distillax.distill.on_policy.eval import prompt_arrays
from distillax.distill.on_policy.losses import on_policy_strategy
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TOKENS, ROW_IDS,
                                                   OnPolicySettings, make_on_policy_objective)
from distillax.framework import backends, flops, throughput
from distillax.framework.vocab_chunks import AUTO
from distillax.models import param_count
from distillax.models.attention.kv_cache import kv_cache_bytes_per_token
from distillax.trainers.on_policy.parts import sampling_program
from distillax.trainers.on_policy.recipe import on_policy_step_flops

KIND = "on_policy"
NEW_TOKENS = 512  # the default T of a candidate without new_tokens=


def new_tokens(v) -> int:
  return int(v.option("new_tokens", NEW_TOKENS))


def micro_batch(v) -> int:
  """Completions per update micro-batch (`micro=`; default the whole sampling batch)."""
  return int(v.option("micro", v.batch))


def accum_steps(v) -> int:
  """Update micro-batches per step: the sampling batch over the micro-batch."""
  M = micro_batch(v)
  if M < 1 or v.batch % M:
    raise ValueError(f"variant {v.name}: micro={M} must divide the sampling batch {v.batch}")
  return v.batch // M


def prompt_len(v) -> int:
  P = v.seq_len - new_tokens(v)
  if P < 1:
    raise ValueError(f"variant {v.name}: seq_len={v.seq_len} leaves no prompt before "
                     f"new_tokens={new_tokens(v)}")
  return P


def settings(v, vocab: int) -> OnPolicySettings:
  """configs/on_policy.py's sampling (temperature 1, one sample a prompt, every step on-policy);
  its stop token the never-drawn last row (module doc): every row samples exactly new_tokens."""
  c = on_policy_section()
  return OnPolicySettings(max_new_tokens=new_tokens(v), num_samples=int(c.num_samples),
                          temperature=float(c.sampling_temperature), eos_id=vocab - 1,
                          pad_id=0, lmbda=1.0, vocab_limit=vocab - 1, cast_weights=True,
                          cache_dtype=cache_dtype(v))


def cache_dtype(v) -> str | None:
  """`kv_int8=True`: the sampler's KV cache in int8 (configs/on_policy.py kv_cache_dtype)."""
  return "int8" if v.option("kv_int8", "False") == "True" else None


def objective(v, vocab: int):
  c = on_policy_section()
  leaf = on_policy_strategy(str(c.divergence), beta=float(c.beta),
                            temperature=float(c.temperature))
  return make_on_policy_objective(leaf, settings(v, vocab), chunk_size=AUTO)


def batch_shapes(v) -> dict[str, jax.ShapeDtypeStruct]:
  """The prompt keys of an on-policy batch (lmbda = 1: no packed data is read)."""
  B, P = v.batch, prompt_len(v)
  return {PROMPT_TOKENS: jax.ShapeDtypeStruct((B, P), jnp.int32),
          PROMPT_LENGTHS: jax.ShapeDtypeStruct((B,), jnp.int32),
          ROW_IDS: jax.ShapeDtypeStruct((B,), jnp.int32)}


def host_batch(v, vocab: int, seed: int) -> dict[str, np.ndarray]:
  """BATCH random prompts of the full prompt length, as the trainer's iterator lays them out."""
  rng = np.random.default_rng(seed)
  P = prompt_len(v)
  return prompt_arrays([rng.integers(1, vocab - 1, P) for _ in range(v.batch)], P, pad_id=0)


def lower_sampler(engine, v, vocab: int, abstract_state, abstract_batch):
  """The trainer's sampling-only program for this variant, lowered (compiled with the step)."""
  return sampling_program(engine, settings(v, vocab)).lower(abstract_state, abstract_batch)


def sampler_memory(low) -> dict | None:
  """The sampling-only program's compiled memory (what sampling the whole batch holds at
  once), None where the compiler gives no figures."""
  if low.sampler_exe is None:
    return None
  stats = backends.compiled_stats(low.sampler_exe)
  return {"peak_bytes": common.peak_bytes(stats), **stats} if stats else None


def decode_weight_bytes(cfg) -> int:
  """Bytes of the weights one decode step reads: every parameter at the narrower of its stored
  and compute dtypes, the input embedding table only when the output layer is tied to it."""
  read = param_count(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim)
  return int(read * min(jnp.dtype(cfg.param_dtype).itemsize, jnp.dtype(cfg.dtype).itemsize))


def kv_bytes_per_position(cfg, cache_dtype=None) -> int:
  """Bytes of keys and values one token adds to the sampler's KV cache (every layer)."""
  return kv_cache_bytes_per_token(cfg, cache_dtype)


def decode_roofline(weight_bytes: int, kv_bytes: int, rows: int, prompt: int, new: int,
                    bandwidth: float | None) -> dict:
  """The decode's bytes per step and the tokens/s HBM bandwidth allows (module doc); None
  without a bandwidth (CPU, an unknown chip)."""
  per_step = weight_bytes + rows * kv_bytes * (prompt + (new - 1) / 2)
  return {"decode_weight_bytes": weight_bytes, "kv_bytes_per_position": kv_bytes,
          "decode_bytes_per_step": per_step, "hbm_bandwidth": bandwidth,
          "roofline_tokens_per_s": None if bandwidth is None else rows * bandwidth / per_step}


def timed(session, low, exe, steps: int) -> dict:
  """Sampling alone, then the whole step, `steps` times after one untimed pair (compiles
  nothing: both programs come compiled); `session.state` carries on."""
  v, sample = low.variant, low.sampler_exe
  batch = low.engine.runner.place_batch(host_batch(v, low.student_cfg.vocab_size, seed=1))
  jax.block_until_ready(sample(session.state, batch))
  t0 = time.perf_counter()
  session.state, metrics = exe(session.state, batch)
  first_loss = float(metrics["loss"])
  warmup_s = time.perf_counter() - t0
  sampling, whole, sampled = [], [], []
  for _ in range(steps):
    t0 = time.perf_counter()
    lengths = jax.block_until_ready(sample(session.state, batch))
    t1 = time.perf_counter()
    session.state, metrics = jax.block_until_ready(exe(session.state, batch))
    sampling.append(t1 - t0)
    whole.append(time.perf_counter() - t1)
    sampled.append(int(np.sum(jax.device_get(lengths))))
  return figures(low, sampling, whole, sampled, session.peak_flops, {
      "warmup_s": warmup_s, "first_loss": first_loss, "final_loss": float(metrics["loss"])})


def figures(low, sampling: list[float], whole: list[float], sampled: list[int],
            peak_flops: float | None, extra: dict) -> dict:
  """The row: medians of the timed steps, the update as step minus sampling, MFU over the
  recipe's on-policy model FLOPs, and the sampler against its roofline."""
  v, cfg = low.variant, low.student_cfg
  P, T = prompt_len(v), new_tokens(v)
  step_s, sampling_s = float(np.median(whole)), float(np.median(sampling))
  tokens = int(np.median(sampled))
  model_flops = on_policy_step_flops(cfg, low.teacher_cfg, v.batch, P, T)
  bandwidth, source = throughput.hbm_bandwidth_per_device()
  roof = decode_roofline(decode_weight_bytes(cfg), kv_bytes_per_position(cfg, cache_dtype(v)),
                         v.batch, P, T, bandwidth)
  rate = tokens / sampling_s
  prefill = flops.forward_flops_breakdown(cfg, v.batch, P)
  prefill_flops = prefill["total"] - prefill["logits"]
  with_prefill = None
  if bandwidth and peak_flops:
    bound_s = prefill_flops / peak_flops + tokens / roof["roofline_tokens_per_s"]
    with_prefill = bound_s / sampling_s
  return {"sampling_batch": v.batch, "micro_batch": micro_batch(v),
          "accum_steps": accum_steps(v), "sampler_memory": sampler_memory(low),
          "step_s": step_s, "step_s_all": whole, "sampling_s": sampling_s,
          "sampling_s_all": sampling, "update_s": float(np.median(np.subtract(whole, sampling))),
          "prompt_len": P, "new_tokens": T, "sampled_tokens": tokens,
          "tokens_per_s": tokens / step_s, "sampled_tokens_per_s": rate,
          **roof, "hbm_source": source,
          "roofline_fraction": None if bandwidth is None else rate / roof["roofline_tokens_per_s"],
          "prefill_flops": prefill_flops, "roofline_fraction_with_prefill": with_prefill,
          "model_flops": model_flops, "tflops_per_s": model_flops / step_s / 1e12,
          "mfu_causal": throughput.mfu(model_flops, step_s, 1, peak_flops), **extra}
