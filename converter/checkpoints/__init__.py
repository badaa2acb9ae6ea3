"""Checkpoints: loading them safely, reading their weight files and GGUF metadata."""
