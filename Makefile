# dsec — the two commands a newcomer needs (as root):
#   make demo   set up everything missing, run a sandboxed workload, show what it did
#   make test   set up everything missing, run the whole test suite
.PHONY: setup test demo bench gc

setup:
	@bash scripts/setup.sh

test: setup
	.venv/bin/python -m pytest -q tests

demo: setup
	@bash scripts/demo.sh

bench: setup
	.venv/bin/python bench/launch.py
	.venv/bin/python bench/audit.py

gc: setup
	.venv/bin/dsec gc
