"""The held-out slice (issue 12): human-written text installed with Python, cut into disjoint
held-out and calibration parts; the logit PSNR beside top-1 and KL; the recipe rules."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from converter.compression import corpus
from converter.errors import InputError
from converter.recipe import RecipeError, load_recipe
from converter.recipe.compression_section import Corpus
from parity.variant import psnr_db, summarize_psnr

DECODER = """\
name: tiny
task: text-generation
source: {{kind: hf-dir, path: .}}
fixtures:
  prompts: [{prompt}]
compression:
  held_out: {held_out}
{calibration}  variants:
    - {{suffix: l, {method}, gates: {{min_top1_agreement: 0.9, max_mean_kl: 0.1}}}}
"""


W8A8 = "method: w8a8, granularity: per-channel"  # a variant that reads calibration text


class WordTokenizer:
    """One token per word: enough to count positions."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [len(w) for w in text.split()]}


def _load(tmp_path: Path, **fields: str) -> object:
    lut = "method: lut, bits: 8"
    values = {"prompt": '"hello there"', "calibration": "", "method": lut} | fields
    path = tmp_path / "r.yaml"
    path.write_text(DECODER.format(**values), encoding="utf-8")
    return load_recipe(path)


def test_the_corpus_is_prose_and_its_parts_never_share_a_text() -> None:
    held, calib = corpus.part_paragraphs("held_out"), corpus.part_paragraphs("calibration")
    assert len(held) >= 300 and len(calib) >= 300
    assert not set(held) & set(calib)
    assert not set(corpus.part_sentences("held_out")) & set(corpus.part_sentences("calibration"))
    # prose: no indented code, no heading underlines, sentences of words
    assert all("\n" not in p and "::=" not in p and len(p.split()) >= 12 for p in held)
    assert len(corpus.part_sentences("held_out")) >= 300
    with pytest.raises(ValueError, match="expected one of held_out, calibration"):
        corpus.part_paragraphs("fixtures")


def test_decoder_texts_cover_the_positions_asked_in_whole_windows() -> None:
    c = Corpus(corpus="pydoc_data", positions=1000)
    texts = corpus.decoder_texts(c, "held_out", WordTokenizer(), 64)
    lengths = [len(t) for t in texts]
    assert sum(lengths) >= 1000 and sum(lengths[:-1]) < 1000 and max(lengths) <= 64
    too_many = Corpus(corpus="pydoc_data", positions=10**7)
    with pytest.raises(InputError, match=r"compression.held_out.positions: 10000000 positions"):
        corpus.decoder_texts(too_many, "held_out", WordTokenizer(), 64)
    with pytest.raises(InputError, match="needs the checkpoint's tokenizer"):
        corpus.decoder_texts(c, "held_out", None, 64)


def test_encoder_texts_are_sentences_that_fit_the_window() -> None:
    c = Corpus(corpus="pydoc_data", sentences=300)
    texts = corpus.encoder_texts(c, "held_out", WordTokenizer(), 20)
    assert len(texts) == 300 and len(set(texts)) == 300
    assert all(len(t.split()) <= 20 for t in texts)
    texts_calibration = corpus.encoder_texts(c, "calibration", WordTokenizer(), 64)
    assert not set(texts) & set(texts_calibration)


def test_psnr_is_the_peak_over_the_rms_error_per_vector() -> None:
    ref = torch.tensor([[4.0, -2.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    err = torch.tensor([[0.1, -0.1, 0.1, -0.1], [0.0, 0.0, 0.0, 0.0]])
    got = psnr_db(ref + err, ref)
    assert got[0] == pytest.approx(20 * math.log10(4.0 / 0.1))  # 32.04 dB
    assert got[1] == math.inf  # identical
    assert psnr_db(torch.tensor([math.nan, 1.0]), torch.tensor([1.0, 1.0])) == [-math.inf]
    s = summarize_psnr([30.0, 40.0, math.inf])
    assert (s.count, s.min_db, s.median_db, s.mean_db) == (3, 30.0, 40.0, 35.0)
    assert summarize_psnr([-math.inf, 40.0]).mean_db == -math.inf


def test_a_corpus_held_out_validates_and_names_its_rules(tmp_path: Path) -> None:
    recipe = _load(tmp_path, held_out="{corpus: pydoc_data, positions: 1000}")
    assert recipe.compression.held_out == Corpus(corpus="pydoc_data", positions=1000)  # type: ignore[attr-defined]
    with pytest.raises(RecipeError, match="compression.held_out.sentences: does not apply"):
        _load(tmp_path, held_out="{corpus: pydoc_data, sentences: 300}")
    with pytest.raises(RecipeError, match="expected one of positions"):
        _load(tmp_path, held_out="{corpus: pydoc_data}")
    paragraph = corpus.part_paragraphs("held_out")[0]
    with pytest.raises(RecipeError, match="compression.held_out: shares 1 text"):
        _load(tmp_path, held_out="{corpus: pydoc_data, positions: 10}", prompt=repr(paragraph))
    # a calibration list taken from the held-out part is refused; the other part is fine
    calib = f"  calibration: [{corpus.part_paragraphs('held_out')[3]!r}]\n"
    with pytest.raises(RecipeError, match="shares 1 text"):
        _load(tmp_path, held_out="{corpus: pydoc_data, positions: 10}", calibration=calib,
              method=W8A8)  # fmt: skip
    # a calibration corpus without a held-out corpus: the parts are disjoint only together
    calib = "  calibration: {corpus: pydoc_data, positions: 500}\n"
    with pytest.raises(RecipeError, match="a calibration corpus needs a held-out corpus"):
        _load(tmp_path, held_out='["x y"]', calibration=calib, method=W8A8)
