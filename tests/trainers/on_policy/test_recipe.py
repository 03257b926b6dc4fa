"""The on-policy recipe: lmbda = 0 is the distill recipe's step bit for bit; every jit preset
and the shard_map / pmap / vmap backends give the same numbers; prompts from every layout;
QAT and LoRA students; the CLI with overrides and its one-line errors."""

import json
import os

import jax
import numpy as np
import pytest

from distillax import main as cli
from distillax.configs import distill as distill_config
from distillax.configs import on_policy as op_config
from distillax.data import default_data_config, make_tokenizer
from distillax.distill.on_policy.objective import PROMPT_KEYS
from distillax.framework import token_loss_impl
from distillax.trainers import recipe_for
from tests.data import chat_testing as ct

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG = os.path.join(ROOT, "distillax/configs/on_policy.py")


def _small(config, **on_policy):
  """Fewer sampled tokens: every compile here is of a whole sampling + training step."""
  config.on_policy.prompt_len, config.on_policy.max_new_tokens = 6, 6
  config.on_policy.num_samples, config.on_policy.time_sampling = 1, False
  for k, v in on_policy.items():
    config.on_policy[k] = v
  return config


def _steps(config, batches, steps=2):
  """(per-step metrics, final params) of `steps` steps from the recipe's fresh state."""
  recipe = recipe_for(config)
  engine = recipe.build_engines().main
  student, extras = recipe.build(abstract=False)
  state = engine.init_state(student, extras, int(config.seed))
  rows = []
  for batch in batches[:steps]:
    state, metrics = engine.runner(state, engine.runner.place_batch(batch))
    rows.append({k: np.asarray(v) for k, v in jax.device_get(metrics).items()})
  return rows, jax.device_get(engine.runner.fetch_state(state).params)


def _batches(config, n=2):
  it = recipe_for(config).train_iterator()
  return [next(it) for _ in range(n)]


def test_lmbda_0_is_the_distill_step_bit_for_bit():
  op = _small(op_config.get_config("tiny"), lmbda=0.0)
  kd = distill_config.get_config("tiny")  # both jobs' 'auto': the vocabulary slices
  batches = _batches(op, 1)
  op_rows, op_params = _steps(op, batches, 1)
  kd_rows, kd_params = _steps(kd, [{k: v for k, v in b.items() if k not in PROMPT_KEYS}
                                   for b in batches], 1)
  assert set(kd_rows[0]) <= set(op_rows[0])
  for k, v in kd_rows[0].items():
    np.testing.assert_array_equal(op_rows[0][k], v, err_msg=k)
  for a, b in zip(jax.tree.leaves(op_params), jax.tree.leaves(kd_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("divergence", ["gjsd", "sampled_kl"])
def test_auto_scores_either_divergence_over_vocabulary_slices(divergence):
  """train.loss_impl='auto': either on-policy loss from one teacher is the slices' (its
  off-policy and eval objectives too, the strategy being one LogitKD): the traced step's token
  losses ran over vocabulary slices only."""
  recipe = recipe_for(_small(op_config.get_config("tiny"), divergence=divergence))
  assert recipe.loss_impl == "sliced" and recipe.sliced_strategy()
  with token_loss_impl.recorded_choices() as ran:
    jax.eval_shape(recipe.objective(train=True), *recipe.build(abstract=True),
                   recipe.batch_shapes(), jax.random.key(0))
  assert ran and {k.split(" (")[0] for k in ran} == {"sliced"}


# (backend, partitioning strategy, mesh model axis)
LAYOUTS = [("jit", "fsdp", 1), ("jit", "dp", 1), ("jit", "tp", 2), ("jit", "fsdp_tp", 2),
           ("shard_map", "dp", 1), ("pmap", "dp", 1), ("vmap", "dp", 1)]


@pytest.fixture(scope="module")
def reference():
  config = _small(op_config.get_config("tiny"), divergence="sampled_kl")
  batches = _batches(config)
  return config, batches, _steps(config, batches)


@pytest.mark.parametrize("backend,strategy,model", LAYOUTS[1:],
                         ids=[f"{b}-{s}" for b, s, _ in LAYOUTS[1:]])
def test_backends_and_presets_sample_and_train_alike(reference, backend, strategy, model):
  config, batches, (want_rows, want_params) = reference
  config = config.copy_and_resolve_references()
  config.backend, config.partitioning.strategy, config.mesh.model = backend, strategy, model
  _assert_alike(*_steps(config, batches), want_rows, want_params)


def test_micro_batches_on_a_mesh_sample_and_train_alike(reference):
  """Issue 53 on 8 devices (4 data x 2 model): the step samples its 8 completions at once and
  learns from them 4 at a time (2 micro-batches): the same samples and update as the
  reference's one micro-batch."""
  config, batches, (want_rows, want_params) = reference
  config = config.copy_and_resolve_references()
  config.partitioning.strategy, config.mesh.model = "fsdp_tp", 2
  config.on_policy.micro_batch = 4
  assert recipe_for(config).accum_steps == 2
  _assert_alike(*_steps(config, batches), want_rows, want_params)


def _assert_alike(rows, params, want_rows, want_params, params_atol=1e-6):
  for got, want in zip(rows, want_rows):
    # Same samples: the completion statistics agree exactly, the losses to rounding.
    assert float(got["completion_length"]) == float(want["completion_length"])
    assert float(got["tokens"]) == float(want["tokens"])
    for k in ("loss", "reverse_kl", "teacher_nll", "grad_norm"):
      np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=2e-5, err_msg=k)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=params_atol)


def test_prompts_from_every_layout(tmp_path):
  """Chats: the turns before the last answer with the template's generation prompt (as
  transformers renders them); prompt/completion: the prompt; text: its first prompt_len
  tokens. The chat's end of turn is a stop token."""
  folder = ct.save_tokenizer(tmp_path / "tokenizer", ct.CHATML)
  hf_tok = ct.load_hf(folder)
  chats = ct.conversations(12, seed=1)
  sources = {
      "messages": ct.write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in chats]),
      "prompt_completion": ct.write_jsonl(tmp_path / "pc.jsonl", [
          {"prompt": f"def f{i}(x):", "completion": " return x"} for i in range(12)]),
      "text": ct.write_jsonl(tmp_path / "text.jsonl", [
          {"text": f"document number {i} has some words"} for i in range(12)])}
  found = {}
  for layout, source in sources.items():
    config = op_config.get_config("tiny")
    config.data.source, config.data.tokenizer = source, f"hf:{folder}"
    config.data.layout, config.data.validation_fraction = layout, 0.0
    config.on_policy.prompt_len, config.on_policy.num_prompts = 96, 100
    recipe = recipe_for(config)
    found[layout] = {tuple(p.tolist()) for p in recipe.prompts("train")}
  want_chats = {tuple(hf_tok.apply_chat_template(
      m[:max(i for i, t in enumerate(m) if t["role"] == "assistant")],
      add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for m in chats}
  want_chats = {p for p in want_chats if len(p) <= 96}
  assert found["messages"] == want_chats and want_chats
  bos = hf_tok.bos_token_id
  assert found["prompt_completion"] == {
      tuple([bos] + hf_tok(f"def f{i}(x):", add_special_tokens=False).input_ids)
      for i in range(12)}
  assert found["text"] == {tuple(([bos] + hf_tok(f"document number {i} has some words",
                                                  add_special_tokens=False).input_ids)[:96])
                           for i in range(12)}
  assert hf_tok.convert_tokens_to_ids("<|im_end|>") in recipe.settings.stop_ids
  assert recipe.settings.eos_id == hf_tok.eos_token_id


def test_lora_student_trains_its_adapters_on_its_own_samples():
  config = _small(op_config.get_config("tiny"))
  config.lora.module_regex, config.lora.rank = "layers/.*/attn/.*", 4
  rows, params = _steps(config, _batches(config), 1)
  assert np.isfinite(float(rows[0]["loss"])) and float(rows[0]["completion_length"]) > 0
  names = {"/".join(str(getattr(k, "key", k)) for k in path)
           for path, _ in jax.tree_util.tree_leaves_with_path(params)}
  assert names and all("lora" in n for n in names), names


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _assert_router_losses_enter_the_loss(row, terms, w_aux=0.5, w_z=0.25):
  """A step's logged loss is its objective's weighted terms (`terms`: {logged name: weight})
  plus the router-loss weights times the logged router losses; the expert loads are logged per
  layer, nothing dropped (dropless)."""
  aux, z = float(row["moe_aux_loss"]), float(row["router_z_loss"])
  assert aux >= 1.0 - 1e-6 and z > 0  # the Switch loss is 1 at best; the z-loss is positive
  assert float(row["expert_load_max_over_mean_l0"]) >= 1.0
  assert float(row["expert_tokens_dropped_l0"]) == 0.0
  want = sum(w * float(row[k]) for k, w in terms.items()) + w_aux * aux + w_z * z
  np.testing.assert_allclose(float(row["loss"]), want, rtol=1e-5)


def test_cli_q4_0_moe_student_with_overrides_writes_figures_and_samples(tmp_path):
  """A q4_0 mixture-of-experts student (4 experts, top-2) with router-loss weights, half its
  steps on its own samples: every step's loss is its branch's term plus the weights times the
  logged router losses (the objective's router terms against numpy:
  tests/distill/on_policy/test_objective.py); eval rows carry the router figures too."""
  workdir = tmp_path / "run"
  code = cli.main(["distillax", "train", "--config", f"{CONFIG}:tiny,q4_0", "--workdir",
                   str(workdir), "--config.train.steps=3", "--config.train.eval_every=3",
                   "--config.train.log_every=1", "--config.on_policy.divergence=sampled_kl",
                   "--config.on_policy.lmbda=0.5", "--config.on_policy.max_new_tokens=8",
                   "--config.model.num_experts=4", "--config.train.moe_aux_loss=0.5",
                   "--config.train.router_z_loss=0.25"])
  assert code == 0
  rows = _rows(workdir)
  train = [r for r in rows if "loss" in r]
  for key in ("reverse_kl", "teacher_nll", "completion_length", "eos_rate", "on_policy",
              "sampled_tokens_per_s", "sampling_share"):
    assert all(np.isfinite(r[key]) for r in train), key
  assert all(r["completion_length"] <= 8 for r in train)
  # Both branches ran (the seed's draws); the one a step did not take reports 0 for its term.
  assert {r["on_policy"] for r in train} == {0.0, 1.0}
  kd_weight = float(distill_config.get_config("tiny").distill.logit.weight)
  for r in train:
    _assert_router_losses_enter_the_loss(r, {"sampled_kl": 1.0, "logit_kd": kd_weight})
  evals = [r for r in rows if "eval_loss" in r]
  assert evals and all(k in evals[-1] for k in (
      "eval_on_policy_teacher_nll", "eval_on_policy_reverse_kl", "eval_perplexity",
      "eval_moe_aux_loss", "eval_router_z_loss", "eval_expert_load_max_over_mean_l0"))
  assert evals[-1]["eval_expert_tokens_dropped_l0"] == 0.0  # dropless
  samples = [json.loads(line) for line in
             (workdir / "on_policy_samples" / "step_000003.jsonl").read_text().splitlines()]
  assert len(samples) == 4 and all(len(s["completion_ids"]) <= 8 for s in samples)
  # Every sampled id is a token: the byte tokenizer's 259 ids, not the vocabulary's padded rows
  # (the tiny model has 384), which the completion text would silently drop.
  ids = [i for s in samples for i in s["completion_ids"]]
  assert ids and max(ids) < 259, ids
  assert json.loads((workdir / "config.json").read_text())["qat"]["rules"]


@pytest.mark.parametrize("override, fragment", [
    ("--config.on_policy.lmbda=2.0", "on_policy.lmbda"),
    ("--config.on_policy.divergence=kl", "on_policy.divergence"),
    ("--config.on_policy.max_new_tokens=200", "max_seq_len"),
    ("--config.on_policy.num_samples=0", "on_policy.num_samples"),
    ("--config.on_policy.kv_cache_dtype=fp8", "on_policy.kv_cache_dtype='fp8'"),
    # tiny: 8 prompts x 2 samples = 16 completions a step
    ("--config.on_policy.micro_batch=3", "on_policy.micro_batch=3 must be a multiple of "
     "on_policy.num_samples=2 that divides the sampling batch (train.batch_size x num_samples "
     "= 16 completions), e.g. 4, 8, 16"),
    ("--config.on_policy.micro_batch=4 --config.train.accum_steps=2",
     "on_policy.micro_batch=4 makes 4 micro-batches per step but train.accum_steps=2")])
def test_bad_on_policy_fields_fail_in_one_line(tmp_path, capsys, override, fragment):
  workdir = tmp_path / "bad"
  code = cli.main(["distillax", "train", "--config", f"{CONFIG}:tiny", "--workdir",
                   str(workdir), *override.split()])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and fragment in err[0], err
  assert not workdir.exists()


@pytest.mark.parametrize("micro_batch, accum_steps, want", [(0, 1, 1), (0, 2, 2), (4, 1, 4),
                                                            (4, 4, 4), (16, 1, 1), (2, 1, 8)])
def test_micro_batch_sets_the_steps_micro_batches(micro_batch, accum_steps, want):
  """Issue 53: the update micro-batches of a step of 16 completions (8 prompts x 2 samples)."""
  from distillax.trainers.on_policy.recipe import micro_batches
  assert micro_batches(16, 2, micro_batch, accum_steps) == want


def test_plan_line_sizes_the_sampler_per_device():
  """8 completions of 6 + 4 tokens over 4 data devices: 2 rows x 10 positions of KV cache
  (2 layers x K and V x 2 kv heads x 8 features x 2 bytes = 128 bytes a position: 2,560
  bytes), and the fp32 weights' bf16 copy (400 -> 200 bytes a device, as cast)."""
  import types
  from distillax.models.config import TransformerConfig
  from distillax.trainers.on_policy.recipe import sampling_memory, sampling_plan_line
  from distillax.distill.on_policy.objective import OnPolicySettings
  cfg = TransformerConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2,
                          num_kv_heads=2, head_dim=8, mlp_dim=32, max_seq_len=16,
                          dtype="bfloat16")
  settings = OnPolicySettings(max_new_tokens=4, cast_weights=True)
  assert sampling_memory(cfg, 2, 10, 400, settings) == {"kv_cache_bytes": 2560,
                                                        "weights_copy_bytes": 200}
  no_cast = sampling_memory(cfg, 2, 10, 400, OnPolicySettings(max_new_tokens=4))
  assert no_cast["weights_copy_bytes"] == 0
  # An int8 cache (a scanned stack): 2 layers x K and V x 2 kv heads x (8 one-byte codes + a
  # 4-byte scale) = 96 bytes a position, 1,920 for 2 rows x 10.
  int8 = sampling_memory(cfg.replace(scan_layers=True), 2, 10, 400,
                         OnPolicySettings(max_new_tokens=4, cache_dtype="int8"))
  assert int8["kv_cache_bytes"] == 1920
  line = sampling_plan_line(cfg, 8, 2, 6, settings, {"params_bytes_per_device": 400}, data=4)
  assert line == ("on-policy batches: sampling 8 completions of 6 + 4 tokens at once (KV cache "
                  f"{2560 / 2**30:.3g} GiB + the student's weights in bfloat16 "
                  f"{200 / 2**30:.3g} GiB per device, before the update), update micro-batch 4 "
                  "completions x 2 per step (in the compiled step's peak)")


def test_a_sample_past_the_students_max_seq_len_is_one_line():
  """Both on-policy recipes (same tokenizer and cross-tokenizer) size samples through it."""
  import types
  from distillax.errors import ConfigError
  from distillax.trainers.on_policy.recipe import sample_width
  settings, model = types.SimpleNamespace(max_new_tokens=24), types.SimpleNamespace(max_seq_len=64)
  assert sample_width(40, settings, model) == 64
  with pytest.raises(ConfigError, match=r"on_policy.prompt_len=41 \+ on_policy.max_new_tokens=24 "
                     r"exceeds model.max_seq_len=64; shorten one of them"):
    sample_width(41, settings, model)


@pytest.mark.parametrize("long_split", ["train", "eval"])
def test_prompts_longer_than_prompt_len_fail_before_any_compile(tmp_path, capsys, monkeypatch,
                                                                long_split):
  """Issue 48: the held-out prompts were read at the first eval, after the compile and the
  steps before it (all lost, and the workdir then belonged to the failed job). Now the train
  and the eval prompts are read with the data check: one line naming the length that admits the
  shortest prompt, exit 2, nothing compiled, and the workdir left free for the corrected
  command."""
  from distillax.trainers.on_policy.recipe import OnPolicyRecipe
  from distillax.trainers.workdir import check_workdir

  def no_compile(self, *args, **kwargs):
    raise AssertionError("compiled before the prompts were checked")
  monkeypatch.setattr(OnPolicyRecipe, "build_engines", no_compile)
  words = "the student samples its own answers and the teacher grades each token of them"
  prompts = {"short": [f"q{i}" for i in range(12)],
             "long": [f"{words} {i} {words}" for i in range(12)]}
  files = {kind: ct.write_jsonl(tmp_path / f"{kind}.jsonl", [
      {"prompt": p, "completion": " yes"} for p in texts]) for kind, texts in prompts.items()}
  train, held_out = ((files["long"], files["short"]) if long_split == "train"
                     else (files["short"], files["long"]))
  workdir = tmp_path / "run"
  argv = ["distillax", "train", "--config", f"{CONFIG}:tiny", "--workdir", str(workdir),
          f"--config.data.source={train}", f"--config.data.eval_source={held_out}",
          "--config.data.layout=prompt_completion"]
  code = cli.main(argv)
  err = capsys.readouterr().err.strip().splitlines()
  # The shortest long prompt, tokenized here as the recipe reads a prompt: [BOS] + its text.
  config = op_config.get_config("tiny")
  tokenizer = make_tokenizer(config.data.tokenizer)
  shortest = min(1 + len(tokenizer.encode(p)) for p in prompts["long"])
  assert shortest > config.on_policy.prompt_len
  assert code == 2 and len(err) == 1, err
  assert (f"no {long_split} document of '{files['long']}' gives a prompt of at most "
          f"on_policy.prompt_len=8 tokens; raise it, e.g. --config.on_policy.prompt_len="
          f"{shortest}") in err[0], err
  assert not (workdir / "job.json").exists() and not (workdir / "config.json").exists()
  config.data.source, config.data.eval_source = train, held_out
  config.data.layout, config.on_policy.prompt_len = "prompt_completion", shortest
  assert check_workdir(str(workdir), config).summary is None  # the corrected job may run there


def _prompt_files(tmp_path, train_words: int, eval_texts: list[str]):
  """A prompt/completion train file whose prompts all need `train_words` words, and a held-out
  one of `eval_texts`."""
  train = [" ".join(["word"] * train_words) + f" {i}" for i in range(12)]
  return (ct.write_jsonl(tmp_path / "train.jsonl", [{"prompt": p, "completion": " yes"}
                                                     for p in train]),
          ct.write_jsonl(tmp_path / "eval.jsonl", [{"prompt": p, "completion": " yes"}
                                                   for p in eval_texts]))


def test_the_suggested_prompt_len_fits_both_splits_when_followed(tmp_path, capsys):
  """Issue 55 point 6: with train prompts too long for prompt_len and held-out ones longer
  still, the check suggested each split's own length (36 for train, 55 for eval here), and
  following the first failed on the second. Now every line suggests one setting that admits
  both splits' shortest prompts (and a max_new_tokens that still fits the student's
  max_seq_len), and the job configured with it reads its prompts."""
  import re
  train, held_out = _prompt_files(tmp_path, 4, [" ".join(["longer"] * 4) + f" {i}"
                                                for i in range(8)])
  argv = ["distillax", "train", "--config", f"{CONFIG}:tiny", "--workdir",
          str(tmp_path / "run"), f"--config.data.source={train}",
          f"--config.data.eval_source={held_out}", "--config.data.layout=prompt_completion"]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  suggested = dict(re.findall(r"--config\.on_policy\.(\w+)=(\d+)", err))
  config = op_config.get_config("tiny")
  tokenizer = make_tokenizer(config.data.tokenizer)
  need = 1 + len(tokenizer.encode(" ".join(["longer"] * 4) + " 0"))
  # Every line (one a split) suggests the same length: the one that admits both.
  assert set(re.findall(r"--config\.on_policy\.prompt_len=(\d+)", err)) == {str(need)}, err
  config.data.source, config.data.eval_source = train, held_out
  config.data.layout = "prompt_completion"
  for field, value in suggested.items():
    config.on_policy[field] = int(value)
  recipe = recipe_for(config)
  assert len(recipe.prompts("train")) > 0 and len(recipe.prompts("eval")) == 8


def test_eval_prompts_left_out_are_said_with_their_count(tmp_path, caplog):
  """Issue 55 point 6: on-policy eval used 2 of its 8 prompts and no line said so. Now one
  warning line gives the count left out and the prompt_len that keeps them all, which does."""
  import logging
  short = [f"q{i}" for i in range(2)]
  long = [" ".join(["longer"] * 3) + f" {i}" for i in range(6)]
  train, held_out = _prompt_files(tmp_path, 1, short + long)
  config = op_config.get_config("tiny")
  config.data.source, config.data.eval_source = train, held_out
  config.data.layout = "prompt_completion"
  config.on_policy.prompt_len = 8
  with caplog.at_level(logging.WARNING):
    assert len(recipe_for(config).prompts("eval")) == 2
  lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
  assert len(lines) == 1, lines
  tokenizer = make_tokenizer(config.data.tokenizer)
  longest = max(1 + len(tokenizer.encode(p)) for p in long)
  assert lines[0] == (f"on_policy.prompt_len=8: 6 of the eval prompts are longer and left out, "
                      f"2 used of the 8 asked for; --config.on_policy.prompt_len={longest} "
                      f"keeps them all")
  config.on_policy.prompt_len = longest
  assert len(recipe_for(config).prompts("eval")) == 8


def test_only_a_plain_student_samples_from_weights_cast_once():
  """A QAT student quantizes its stored weights and a LoRA one adds to them: casting them first
  would change what they sample, so only a plain student gets the cast (issue 53)."""
  assert recipe_for(op_config.get_config("tiny")).settings.cast_weights
  assert not recipe_for(op_config.get_config("tiny,q4_0")).settings.cast_weights
