"""Cross-tokenizer on-policy distillation: with one tokenizer on both sides (alpha = 1, T = 1)
its loss on the student's samples is ordinary on-policy's forward KL (GeneralizedJSD, beta = 0),
drawn from the same key; the samples the host sees are those the in-step sampler draws."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.configs import distill_cross_tokenizer
from distillax.data.cross_tokenizer import rows
from distillax.data.cross_tokenizer.samples import readable_text
from distillax.distill.cross_tokenizer.on_policy import (
    COMPLETION_LENGTHS, COMPLETION_TOKENS, make_cross_tokenizer_on_policy_objective,
    sample_completions, sampling_keys)
from distillax.data import make_tokenizer
from distillax.data.corpus_bpe import corpus_bpe
from distillax.data.cross_tokenizer.samples import SampleAligner
from distillax.data.cross_tokenizer.alignment import EXACT, SKIP, SPAN
from distillax.data.cross_tokenizer.token_bytes import shared_vocab
from distillax.distill.on_policy.objective import PROMPT_KEYS, make_on_policy_objective, row_keys
from distillax.distill.on_policy.losses import GeneralizedJSD
from distillax.partitioning import create_mesh
from distillax.trainers import recipe_for


@pytest.fixture(scope="module")
def same_tokenizer_recipe():
  c = distill_cross_tokenizer.get_config("tiny,on_policy")
  c.teacher.tokenizer = c.data.tokenizer  # the student's 512-id BPE on both sides
  c.distill.cross_tokenizer.temperature, c.distill.cross_tokenizer.alpha = 1.0, 1.0
  c.train.batch_size, c.on_policy.num_samples = 2, 2
  c.on_policy.max_new_tokens = 8
  return recipe_for(c, mesh=create_mesh(c.mesh, devices=jax.devices()[:1]))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_one_tokenizer_equals_same_tokenizer_on_policy(same_tokenizer_recipe):
  recipe = same_tokenizer_recipe
  settings = recipe.settings
  student, extras = recipe.build(abstract=False)
  prompts = {k: v for k, v in next(recipe.train_iterator()).items() if k in PROMPT_KEYS}
  step_rng = jax.random.key(7)
  ordinary = make_on_policy_objective(GeneralizedJSD(beta=0.0, temperature=1.0), settings,
                                      chunk_size=None)
  cross = make_cross_tokenizer_on_policy_objective(recipe.objective(), settings)

  # The host's samples; the in-step sampler of `ordinary` draws its own with the same key, so
  # equal token counts and losses below also say that the two drew the same completions.
  ours = nnx.jit(lambda s, b: sample_completions(s.model, b, step_rng, settings))(student,
                                                                                   prompts)
  B, S = prompts["prompt_tokens_BxP"].shape[0], settings.num_samples
  tokens = np.asarray(ours.tokens_BxT).reshape(B, S, -1)
  lengths = np.asarray(ours.lengths_B).reshape(B, S)
  batch = {**prompts, COMPLETION_TOKENS: tokens, COMPLETION_LENGTHS: lengths,
           **recipe.aligner(prompts["prompt_tokens_BxP"], prompts["prompt_lengths_B"], tokens,
                            lengths)}

  def loss(objective):
    def per_token(student, extras, batch):
      out = objective(student, extras, batch, step_rng)
      return out.loss_sum / out.tokens, out
    return nnx.jit(per_token)

  want, want_out = loss(ordinary)(student, extras, prompts)
  got, got_out = loss(cross)(student, extras, batch)
  assert float(got_out.tokens) == float(want_out.tokens) > 4 * 4
  assert abs(float(got) - float(want)) < 1e-6, (float(got), float(want))
  assert float(want) > 0.5  # random student and teacher disagree


def test_sampling_keys_are_those_of_the_same_tokenizer_step():
  """Issue 53: the same-tokenizer step samples its whole batch at once with fold_in(step key,
  1), then per row and sample, whatever micro-batches it learns in; so does this one."""
  step, row_ids_B, S = jax.random.key(3), jnp.arange(10, 16), 2
  want = row_keys(jax.random.fold_in(step, 1), row_ids_B, S)
  np.testing.assert_array_equal(
      jax.random.key_data(jax.jit(sampling_keys, static_argnums=2)(step, row_ids_B, S)),
      jax.random.key_data(want))


def test_readable_text_marks_invalid_bytes():
  text, where, bad = readable_text(b"a\xe6\x97b\xff")  # a cut-off character, a stray byte
  assert text == "a\ufffdb\ufffd"
  assert where.tolist() == [0, 1, 4, 4, 5, 8]
  assert bad.tolist() == [False, True, True, False, True]


def test_samples_aligned_with_a_byte_teacher():
  """A 512-id BPE student, a byte-level teacher: the prompt's groups are not scored, a
  multi-byte completion token is a span, BOS and EOS pair off, a token the text cannot hold
  (a stray 0xff byte) is not trained and the teacher reads U+FFFD there."""
  student, teacher = make_tokenizer(f"hf:{corpus_bpe(512)}"), make_tokenizer("byte")
  shared = shared_vocab(student, teacher)
  aligner = SampleAligner(student, teacher, shared.teacher_to_student_Vt, prompt_width=4,
                          new_tokens=6, teacher_len=24, same_tokenizer=False)
  prompt = [student.bos_id, *student.encode(" import")]          # BOS, ' import'
  completion = [*student.encode(" os"), 190, student.encode("a")[0], student.eos_id]
  assert len(completion) == 4 and 190 not in student.encode(" os")
  out = aligner(np.array([prompt + [0, 0]]), np.array([len(prompt)]),
                np.array([[completion + [0]]]), np.array([[len(completion)]]))
  t_in = out[rows.TEACHER_INPUTS][0, 0]
  want_text = " import os\ufffda".encode()
  n = 1 + len(want_text)  # BOS + bytes (+ EOS as the last target)
  assert t_in[0] == teacher.bos_id
  assert bytes(int(i) - teacher.NUM_SPECIALS for i in t_in[1:n]) == want_text
  assert out[rows.TEACHER_TARGETS][0, 0, n - 1] == teacher.eos_id
  kinds = out[rows.GROUP_KIND][0, 0]
  groups = out[rows.STUDENT_GROUP][0, 0]
  # Scoring slots: prompt right-aligned in 4 (one pad slot), completion from slot 4; slot p
  # predicts the token at p + 1. ' import' (slot 2 predicts it) is a prompt token: not scored.
  assert groups[:3].tolist() == [-1, -1, -1]
  scored = {p: int(kinds[groups[p]]) for p in range(3, 8) if groups[p] >= 0}
  # ' os' (3 bytes vs 3 byte tokens): a span; 0xff: not trained; 'a': exact; EOS: exact.
  assert scored == {3: SPAN, 5: EXACT, 6: EXACT}, (groups, kinds)
  assert int((kinds == SKIP).sum()) == len(kinds) - 3
