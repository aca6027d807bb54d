"""The vLLM backend: its `ServerAPI`, protocol, command line and worker extension."""
