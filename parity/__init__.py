"""Parity: fixtures, references, gates and reports."""
