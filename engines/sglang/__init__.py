"""The SGLang backend: its `ServerAPI`, protocol, LoRA API, command line and CPU shims."""
