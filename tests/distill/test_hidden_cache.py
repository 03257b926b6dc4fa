"""Hidden-state teacher caches: the teacher's final hidden states on disk plus its frozen head
give back its logits, so KD from the cache equals KD from the live teacher for every logit
strategy (the second code path is the live teacher, side by side in one step)."""

import json
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from distillax.distill import LogitKD, make_distill_objective, read_teacher_cache
from distillax.distill.teacher_cache import read_cache_info, write_teacher_cache
from distillax.distill.teacher_head import (HEAD_FILE, TEACHER_HIDDEN, fingerprint, head_of,
                                            load_head)
from distillax.errors import UserError
from tests.distill import helpers as h
from tests.support.models import NORMS_NEAR_ONE, random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A bfloat16 cache rounds each hidden state to 8 mantissa bits; measured here the losses move by
# 1e-7 (top-k) to 1.5e-4 (reverse KL) relative.
BF16_RTOL = 1e-3


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
  student, teacher = h.make_models(7)
  batches = [h.make_batch(seed=s) for s in (20, 21)]
  root = tmp_path_factory.mktemp("hidden")
  infos = {dtype: write_teacher_cache(teacher, iter(batches), str(root / dtype), kind="hidden",
                                      hidden_dtype=dtype, rows_per_file=3)
           for dtype in ("float32", "bfloat16")}
  return student, teacher, batches, root, infos


STRATEGIES = {  # every divergence, top-k, several temperatures, whole and chunked logits
    "forward_kl": (LogitKD(temperature=1.0, alpha=0.5, divergence="forward_kl"), None),
    "reverse_kl": (LogitKD(temperature=2.0, alpha=1.0, divergence="reverse_kl"), 5),
    "jsd": (LogitKD(temperature=1.5, alpha=0.7, divergence="jsd", beta=0.3), 5),
    "top_k": (LogitKD(temperature=3.0, alpha=0.7, divergence="forward_kl", top_k=5), 7),
}


GRAD_CHECKED = "jsd"  # the strategy whose student gradients are compared too


@pytest.fixture(scope="module")
def steps(caches):
  """{strategy: {teacher: (loss, sums)}} for the live teacher and both caches, and the student
  gradients of GRAD_CHECKED against the live teacher and the fp32 cache, from one compiled
  function (one step each, the same student and batch)."""
  student, teacher, _, root, infos = caches
  batch = h.to_jnp(next(iter(read_teacher_cache(str(root / "float32"), batch_size=2))))
  bf16 = next(iter(read_teacher_cache(str(root / "bfloat16"), batch_size=2)))[TEACHER_HIDDEN]
  heads = {d: load_head(str(root / d), infos[d].head_fingerprint) for d in infos}
  sg, ss = nnx.split(student)

  @jax.jit
  def run(ss, teacher, heads, bf16):
    teachers = {"live": (teacher, batch), "float32": (heads["float32"], batch),
                "bfloat16": (heads["bfloat16"], {**batch, TEACHER_HIDDEN: bf16})}
    out, grads = {}, {}
    for name, (strategy, chunk) in STRATEGIES.items():
      objective = make_distill_objective(strategy, chunk_size=chunk, metrics=True)

      def loss(ss, extras, batch):
        result = objective(nnx.merge(sg, ss), extras, batch, None)
        return result.loss_sum, result.sums
      out[name] = {k: loss(ss, {"teacher": t}, b) for k, (t, b) in teachers.items()}
      if name == GRAD_CHECKED:
        grads = {k: jax.grad(lambda ss, t, b: loss(ss, {"teacher": t}, b)[0])(ss, *teachers[k])
                 for k in ("live", "float32")}
    return out, grads

  return run(ss, teacher, heads, bf16)


@pytest.mark.parametrize("name", STRATEGIES)
def test_fp32_cache_equals_the_live_teacher(steps, name):
  (live_loss, live_sums), (loss, sums) = steps[0][name]["live"], steps[0][name]["float32"]
  np.testing.assert_allclose(float(loss), float(live_loss), rtol=1e-5)
  assert set(sums) == set(live_sums)  # teacher_ce, top-1 and cosine come from the head too
  for key in live_sums:
    np.testing.assert_allclose(float(sums[key]), float(live_sums[key]), rtol=1e-5, atol=1e-6,
                               err_msg=key)
  if name == GRAD_CHECKED:
    grads = steps[1]
    for a, b in zip(jax.tree.leaves(grads["float32"]), jax.tree.leaves(grads["live"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                 atol=1e-5 * float(np.max(np.abs(b))))


def test_bf16_cache_is_close_to_the_live_teacher(steps):
  moved = []
  for name in STRATEGIES:
    live, loss = (float(steps[0][name][k][0]) for k in ("live", "bfloat16"))
    np.testing.assert_allclose(loss, live, rtol=BF16_RTOL, err_msg=name)
    moved.append(abs(loss - live) / abs(live))
  assert max(moved) > 1e-6  # the rounding is there (and bounded above)


def test_cache_contents_head_and_fingerprint(caches):
  _, teacher, batches, root, infos = caches
  info = infos["float32"]
  assert (info.kind, info.top_k, info.rows, info.hidden_dtype) == ("hidden", 0, 4, "float32")
  assert read_cache_info(str(root / "float32")) == info
  rows32 = list(read_teacher_cache(str(root / "float32"), batch_size=2))
  rows16 = list(read_teacher_cache(str(root / "bfloat16"), batch_size=2))
  for original, r32, r16 in zip(batches, rows32, rows16):
    for key, value in original.items():
      np.testing.assert_array_equal(r16[key], value)
    # fp32 states are the live teacher's (the loss test above); bf16 ones are their rounding
    assert r16[TEACHER_HIDDEN].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(r16[TEACHER_HIDDEN],
                                  r32[TEACHER_HIDDEN].astype(jax.numpy.bfloat16))
  assert info.head_fingerprint == fingerprint(head_of(teacher))
  assert infos["bfloat16"].head_fingerprint == info.head_fingerprint
  other = random_model(h.TEACHER_CONFIG, 108, NORMS_NEAR_ONE)
  assert fingerprint(head_of(other)) != info.head_fingerprint
  with pytest.raises(UserError, match="altered"):
    load_head(str(root / "float32"), fingerprint(head_of(other)))
  assert os.path.exists(root / "float32" / HEAD_FILE)


CONFIG = os.path.join(ROOT, "distillax/configs/distill_cached.py") + ":tiny"


@pytest.fixture(scope="module")
def two_process_cache(tmp_path_factory):
  """A float32 hidden-state cache of distill_cached.py:tiny written through the CLI by two real
  processes (4 devices each), 2 batches of 8 rows, and the tiny recipe's teacher."""
  from distillax.configs import distill_cached
  from distillax.launch_local import launch
  from distillax.trainers import recipe_for
  root = tmp_path_factory.mktemp("two_processes")
  cache = root / "cache"
  # The children keep this process's XLA flags (launch sets their device count): the same
  # compiler options draw the same teacher weights bit for bit.
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  status = launch([sys.executable, "-m", "distillax", "cache-teacher", "--config", CONFIG,
                   "--workdir", str(cache), "--kind", "hidden", "--config.cache.num_batches=2",
                   "--config.cache.dtype=float32"],
                  num_processes=2, devices_per_process=4, timeout_s=600, env=env,
                  log_dir=str(root / "logs"))
  logs = "".join(p.read_text()[-2000:] for p in sorted((root / "logs").iterdir()))
  assert status == 0, logs
  config = distill_cached.get_config("tiny")
  return cache, config, recipe_for(config).load_teacher()


def test_a_cache_written_by_two_processes_reads_in_one(two_process_cache):
  """Each process wrote the rows of its own data shard; this one process reads them back in
  the global batches' order: the rows of the two processes' train pipelines, the hidden states
  of the teacher run here."""
  from distillax.data import make_train_iterator
  cache, config, teacher = two_process_cache
  info = read_cache_info(str(cache))
  assert info.shards == ((4, 8), (4, 8)) and len(info.files) == 2 and info.rows == 16
  assert fingerprint(head_of(teacher)) == info.head_fingerprint
  shards = [make_train_iterator(config.data, global_batch_size=8, seq_len=32, seed=0,
                                process_index=p, process_count=2) for p in (0, 1)]
  for cached in read_teacher_cache(str(cache), batch_size=8):
    parts = [next(shard) for shard in shards]  # global batch b: process 0's rows, then 1's
    want = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
    for key, value in want.items():
      np.testing.assert_array_equal(cached[key], value, err_msg=key)
  # A record holds its row's tokens and states together: the last batch's states suffice.
  hidden = teacher(want["inputs_BxL"], positions_BxL=want["positions_BxL"],
                   segment_ids_BxL=want["segment_ids_BxL"], return_logits=False)
  np.testing.assert_allclose(cached[TEACHER_HIDDEN], np.asarray(hidden.final_hidden_BxLxD),
                             rtol=1e-5, atol=1e-5)


def _train_error(tmp_path, capsys, *overrides):
  from distillax import main as cli
  rc = cli.main(["distillax", "train", "--config", CONFIG, "--workdir", str(tmp_path / "w"),
                 *overrides])
  errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("distillax train")]
  assert rc == 2 and len(errors) == 1, errors
  assert not (tmp_path / "w").exists()  # nothing written before the config validated
  return errors[0]


def test_a_mismatched_cache_is_one_clear_error(two_process_cache, tmp_path, capsys):
  import shutil
  from distillax.models.hf import checkpoint as hf
  cache, _, teacher = two_process_cache
  at = f"--config.teacher.cache_dir={cache}"
  missing = _train_error(tmp_path, capsys, f"--config.teacher.cache_dir={tmp_path / 'nope'}")
  assert "does not exist" in missing and "teacher.cache_dir" in missing
  assert "attention" in _train_error(tmp_path, capsys, at, "--config.distill.attention.weight=1")
  topk = tmp_path / "topk"  # the same files, declared a top-k cache
  shutil.copytree(cache, topk)
  info = json.loads((topk / "cache_info.json").read_text())
  (topk / "cache_info.json").write_text(json.dumps({**info, "kind": "topk"}))
  assert "holds a topk cache" in _train_error(tmp_path, capsys, f"--config.teacher.cache_dir="
                                              f"{topk}", "--config.cache.kind=hidden")
  from distillax import main as cli
  assert cli.main(["distillax", "cache-teacher", "--config", CONFIG, "--workdir",
                   str(tmp_path / "w"), "--kind", "logits"]) == 2
  errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("distillax")]
  assert len(errors) == 1 and "cache.kind='logits'" in errors[0], errors
  assert not (tmp_path / "w").exists()
  # A teacher named beside the cache must be the one that wrote it: its own weights pass,
  # another model of the same shape is refused.
  hf.save(teacher, tmp_path / "same")
  hf.save(random_model(teacher.config, 3), tmp_path / "other")
  from distillax.configs import distill_cached
  from distillax.trainers import recipe_for
  config = distill_cached.get_config("tiny")
  config.teacher.cache_dir, config.teacher.hf_path = str(cache), str(tmp_path / "same")
  assert recipe_for(config).hidden
  message = _train_error(tmp_path, capsys, at, f"--config.teacher.hf_path={tmp_path / 'other'}")
  assert "fingerprints differ" in message and "teacher.hf_path" in message


MULTI = os.path.join(ROOT, "distillax/configs/distill_multi_teacher.py") + ":tiny"


def _multi_error(tmp_path, capsys, *overrides, config=MULTI):
  """The one `distillax train` error line of a several-teacher job (exit 2, nothing written)."""
  from distillax import main as cli
  rc = cli.main(["distillax", "train", "--config", config, "--workdir", str(tmp_path / "w"),
                 *overrides])
  errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("distillax train")]
  assert rc == 2 and len(errors) == 1, errors
  assert not (tmp_path / "w").exists()
  return errors[0]


def test_a_cache_stands_in_for_one_of_several_teachers(two_process_cache, tmp_path, capsys):
  """teachers[0] from the cache beside live teacher b: its head is its frozen extra, its rows
  the train batches (mixture: all of them; routing: its route's, the other route's rows get
  zero states); the teacher, the cache or the route that is wrong is one line each."""
  from distillax.configs import distill_multi_teacher
  from distillax.distill.multi_teacher import TEACHER_INDEX
  from distillax.models.hf import checkpoint as hf
  from distillax.trainers import recipe_for
  cache, _, teacher = two_process_cache
  rows = read_teacher_cache(str(cache))
  cached = {k: np.stack([rows[i][k] for i in range(8)]) for k in (TEACHER_HIDDEN, "inputs_BxL")}
  config = distill_multi_teacher.get_config("tiny")
  config.teachers[0].cache_dir = str(cache)
  recipe = recipe_for(config)
  assert recipe.batch_shapes()[TEACHER_HIDDEN].shape == cached[TEACHER_HIDDEN].shape
  batch = next(recipe.train_iterator())
  for key, value in cached.items():
    np.testing.assert_array_equal(batch[key], value, err_msg=key)
  assert recipe.teacher_sources["teacher:a"].fingerprint()["head"] == fingerprint(head_of(teacher))
  config.distill.teachers_mode, config.distill.routes = "routing", (("stdlib", "b"),
                                                                    ("stdlib", "a"))
  batch = next(recipe_for(config).train_iterator())
  np.testing.assert_array_equal(batch[TEACHER_INDEX][:, 0], [1] * 4 + [0] * 4)
  assert not batch[TEACHER_HIDDEN][:4].any()
  np.testing.assert_array_equal(batch[TEACHER_HIDDEN][4:], cached[TEACHER_HIDDEN][:4])

  at = f"--config.teachers[0].cache_dir={cache}"
  hf.save(random_model(teacher.config, 3), tmp_path / "other")
  for overrides, want in [
      ((f"--config.teachers[0].cache_dir={tmp_path / 'gone'}",),
       "teachers[0].cache_dir=" + str(tmp_path / "gone") + " does not exist"),
      ((at, f"--config.teachers[0].hf_path={tmp_path / 'other'}"), "fingerprints differ"),
      ((f"--config.teachers[1].hf_path={tmp_path / 'gone'}",), "teachers[1].hf_path"),
      (("--config.distill.teachers_mode=routing", "--config.distill.routes=(('stdlib', 'c'),)"),
       "names teacher 'c', which is not one of `teachers` (a, b)"),
      ((at, f"--config.teachers[1].cache_dir={cache}"), "at most one cache")]:
    assert want in _multi_error(tmp_path, capsys, *overrides), overrides
  assert "no cache holds" in _multi_error(tmp_path, capsys, at, config=MULTI + ",on_policy")
