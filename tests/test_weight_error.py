"""Per-weight decode errors: a per-tensor palette that swallows an outlier weight shows it."""

from __future__ import annotations

import numpy as np
import pytest

from converter.compression.search import palette
from converter.compression.weight_error import errors_text, weight_errors


def _with_outliers() -> np.ndarray:
    # Like SmolLM2's layer-11 down_proj: heavy-tailed ordinary weights (many beyond 2) and
    # two near 6 in one row (measured there: a 4-bit per-tensor palette kept 0.82 of 6.07).
    # Heavy tails matter: with Gaussian weights k-means gives the two outliers a cluster.
    rng = np.random.default_rng(0)
    w = (rng.standard_t(3, (576, 1536)) * 0.05).clip(-3, 3).astype(np.float16)
    w[507, [1229, 1487]] = [5.875, 6.066]
    return w


def test_a_4_bit_palette_loses_the_outlier_and_8_bits_keep_it() -> None:
    w = _with_outliers()
    errors = weight_errors({"lut4": palette(w, 4), "lut8": palette(w, 8)}, {"lut4": w, "lut8": w})
    by_name = {e.weight: e for e in errors}
    assert by_name["lut4"].peak == pytest.approx(6.066, abs=1e-3)
    assert by_name["lut4"].peak_kept < 0.5
    assert by_name["lut8"].peak_kept == pytest.approx(1.0, abs=0.02)
    assert [e.weight for e in errors] == ["lut4", "lut8"]  # worst relative error first
    assert "lut4" in errors_text(errors).splitlines()[2]


def test_exact_weights_have_no_error_and_a_shape_mismatch_is_named() -> None:
    w = _with_outliers()
    (row,) = weight_errors({"w": w}, {"w": w})
    assert row.rel_error == 0.0 and row.peak_kept == 1.0
    with pytest.raises(ValueError, match="w: decodes to 10 values"):
        weight_errors({"w": np.zeros(10, np.float16)}, {"w": w})
