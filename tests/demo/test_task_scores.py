"""The demo's held-out completion pairs (demo/task_scores.py): each prompt is a validation
document's text up to a line break, each reference what that document says next, cut to the
tokens a model writes; the same seed gives the same pairs."""

from distillax.configs import demo
from distillax.data import make_tokenizer
from distillax.demo.task_scores import heldout_pairs


def test_heldout_pairs_are_document_text_cut_at_a_line_break(tmp_path):
  lines = [f"value_{i} = compute({i}, {i * 7})  # line {i}\n" for i in range(40)]
  for d in range(12):
    (tmp_path / f"doc{d}.py").write_text("".join(f"{d}:{line}" for line in lines))
  c = demo.get_config("tiny")
  c.data.source, c.data.validation_fraction = str(tmp_path), 0.5
  c.text_eval.prompts, c.text_eval.prompt_chars, c.text_eval.new_tokens = 3, 80, 12
  tokenizer = make_tokenizer("byte")
  prompts, references = heldout_pairs(c, tokenizer)
  assert len(prompts) == len(references) == 3
  texts = [p.read_text() for p in tmp_path.iterdir()]
  for prompt, reference in zip(prompts, references):
    assert prompt.endswith("\n") and 40 <= len(prompt) <= 80
    assert len(tokenizer.encode(reference)) == 12  # the byte tokenizer: 12 characters
    assert any(prompt + reference in text for text in texts)
  assert len({p for p in prompts}) == 3
  assert heldout_pairs(c, tokenizer) == (prompts, references)
