"""Core ML: tracing and converting to an ML Program, anec's MIL passes, targets, the runtime
adapter.
"""
