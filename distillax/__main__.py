from distillax.main import run

run()
