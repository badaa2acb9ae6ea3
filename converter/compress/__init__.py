"""Compressed variants of a converted model (SPEC section 3: a different contract).

Each variant - palettized weights (k-means look-up tables), INT8 weights, W8A8, or a mixed-bit
plan found under a parity budget - is built from the fp16 ML Program with
``coremltools.optimize.coreml`` and published as its own artifact ``OUT/<name>-<suffix>/``
with its own manifest (how every weight was compressed), size report and parity report.

Modules, one job each: ``config`` (the recipe section), ``sites`` (which program constants
are weights, under which torch names), ``plan`` (per-weight schemes and the coremltools
configs that apply them), ``records`` (what the compressed program holds, per weight, and the
decoded weights), ``size`` (bytes and ratios), ``quality`` (torch and MIL-level metrics and
gates), ``search`` (sensitivity and the mixed-bit search), ``activations`` (W8A8 ranges),
``emit`` (one artifact per variant).
"""
