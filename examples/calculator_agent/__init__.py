"""A calculator agent: a program that calls a sandboxed Python tool through the gateway."""
