"""Where the ops of a Core ML package run: static prediction, compute plans, cost model.

``anec plan-inspect``, ``anec bench-device`` and ``anec plan-baseline``
(``converter/commands/plan.py``). Every figure carries one evidence label
(``converter.evidence.labels.Evidence``).
"""
