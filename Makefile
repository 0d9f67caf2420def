# Two entry points for a fresh machine: `make demo` and `make test` (both create .venv first).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test lint bench bench-zoo zoo-venv mutate mutate-sample mutate-install clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	mkdir -p build/demo
	$(PY) -m fixtures.write_fixtures --out build/fixtures --only transformer --formats pt2
	$(VENV)/bin/amplite convert build/fixtures/transformer.pt2 --precision fp16 \
		-o build/demo/transformer.fp16.pt2 --report build/demo/report.json

# The suite starts ~60 interpreters or forked children that import amplite: let them share its bytecode
# (__pycache__ is git-ignored) where the environment says not to write it (PYTHONDONTWRITEBYTECODE=1 here).
test: install
	$(VENV)/bin/lint-imports --no-cache
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

bench: install
	$(PY) bench/bench_convert.py

# The timm/torchvision sweep (bench/bench_zoo.py, issue 47) in its own venv, never in `make test`: torchvision
# needs the torch build it was released with (PyPI's torchvision does not load beside the CPU torch of .venv),
# and that torch is newer than amplite's pin, so amplite goes in with --no-deps and its runtime dependencies
# (the `zoo` extra's timm included) are named here. About 5.5 GB (a CUDA build of torch; it runs on the CPU).
ZOO_VENV ?= .venv-zoo
ZOO_TORCH ?= torch==2.14.1 torchvision==0.29.1
$(ZOO_VENV)/.installed-stamp: pyproject.toml
	python3 -m venv $(ZOO_VENV)
	$(ZOO_VENV)/bin/python -m pip install -q $(ZOO_TORCH)
	$(ZOO_VENV)/bin/python -m pip install -q --no-deps -e .
	$(ZOO_VENV)/bin/python -m pip install -q 'timm>=1.0' onnx onnxruntime onnxscript libcst typer rich numpy \
		safetensors plotly filelock
	touch $@

zoo-venv: $(ZOO_VENV)/.installed-stamp

bench-zoo: zoo-venv
	OMP_NUM_THREADS=1 $(ZOO_VENV)/bin/python bench/bench_zoo.py --write

# Mutation testing of the passes, policy, op tables, verification metrics and ops (config: [tool.mutmut]
# in pyproject.toml; score and survivors: docs/testing.md). Not in CI: 5912 mutants in about 50 minutes with
# two workers on this idle 2-core machine (longer when it is shared, and a loaded stats run fits fewer tests
# into the budget); the seeded 10 % sample (mutate-sample, about 590 mutants) roughly 10 minutes. Each mutant runs its fastest tests up to MUTMUT_TEST_BUDGET seconds of recorded
# test time (tests/mutmut_warmup.py; 0 = all). Results are cached in mutants/ (a rerun only tests what
# changed; `rm -rf mutants` for a fresh run).
MUTMUT_TEST_BUDGET ?= 3
MUTMUT := OMP_NUM_THREADS=1 MUTMUT_TEST_BUDGET=$(MUTMUT_TEST_BUDGET) $(VENV)/bin/mutmut

mutate-install: install
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,mutate]'

mutate: mutate-install
	@start=$$(date +%s); $(MUTMUT) run --max-children 2 || true; \
	  echo "mutmut run: $$(( $$(date +%s) - start )) s wall"
	$(PY) tests/mutmut_sample.py score --all

mutate-sample: mutate-install
	$(MUTMUT) run --max-children 2 'amplite.op_tables.x_op_name*'  # generates all mutants and test statistics
	names=$$($(PY) tests/mutmut_sample.py names --unchecked); [ -z "$$names" ] || $(MUTMUT) run --max-children 2 $$names || true
	$(PY) tests/mutmut_sample.py score

clean:
	rm -rf build .pytest_cache mutants
