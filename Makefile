# Conveniences; the README's commands are the scripts these call.
SGLANG_VENV ?= .venv-sglang
VLLM_VENV ?= .venv-vllm

.PHONY: install sglang vllm test lint main

install:
	bash scripts/install.sh

sglang:
	bash scripts/install_sglang.sh $(SGLANG_VENV)

vllm:
	bash scripts/install_vllm.sh $(VLLM_VENV)

lint:
	ruff check .

test:
	bash scripts/test.sh
