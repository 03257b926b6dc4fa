"""On-policy recipes: the single-teacher recipe, several teachers, another tokenizer (sampled on
the host between two programs), and the pieces they add around the loop."""
