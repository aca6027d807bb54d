# Entry points; the README's two commands call into these.
PYTHON ?= python
SGLANG_VENV ?= .venv-sglang

.PHONY: install sglang test lint main

install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[dev]"

sglang:
	bash scripts/install_sglang.sh $(SGLANG_VENV)

lint:
	ruff check .

test: install sglang lint
	$(PYTHON) -m pytest -q

