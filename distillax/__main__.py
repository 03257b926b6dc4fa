from distillax import interrupts

interrupts.install()  # before the imports: a Ctrl-C while they run is one line too (main.py)

from distillax.main import run  # noqa: E402

run()
