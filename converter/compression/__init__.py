"""Compressed variants of a converted model (SPEC section 3: a different contract).

Each variant - palettized weights (k-means look-up tables), INT8 weights, W8A8, or a mixed-bit
plan found under a parity budget - is built from the fp16 ML Program with
``coremltools.optimize.coreml`` and published as its own artifact ``OUT/<name>-<suffix>/``
with its own manifest (how every weight was compressed), size report and parity report.

The recipe's ``compression:`` section is ``converter.recipe.compression_section``. Modules, one job
each: ``methods/`` (one module per method: its field rules, target features, weight selection,
program changes and manifest entries; ``methods/base`` the interface), ``sites`` (which program
constants are weights, under which torch names), ``schemes`` (applying per-weight schemes with
coremltools), ``records`` (what the compressed program holds, per weight, and the decoded
weights), ``size`` (bytes and ratios), ``weight_error`` (decode error per weight), ``search``
(sensitivity and the mixed-bit search), ``activations`` (W8A8 ranges), ``decoder`` /
``encoder`` (what a decoder's or an encoder's variants are compared on: the `Subject` handed to
``emit``), ``emit`` (one artifact per variant).
"""
