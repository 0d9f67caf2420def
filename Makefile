# Two entry points for a fresh machine: `make demo` and `make test` (both create .venv first).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test lint bench clean

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

test: install
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -n 2 tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

bench: install
	$(PY) bench/bench_convert.py

clean:
	rm -rf build .pytest_cache
