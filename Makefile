# Conveniences; the README's commands are the scripts these call.
SGLANG_VENV ?= .venv-sglang

.PHONY: install sglang test lint main

install:
	bash scripts/install.sh

sglang:
	bash scripts/install_sglang.sh $(SGLANG_VENV)

lint:
	ruff check .

test:
	bash scripts/test.sh
