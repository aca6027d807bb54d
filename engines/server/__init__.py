"""What every inference server speaks, whatever its backend: the `ServerAPI` interface,
HTTP helpers, reply types and errors."""
