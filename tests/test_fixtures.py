"""Parity fixtures: left padding, full-window variants, input errors, batching with filler rows."""

from __future__ import annotations

import pytest
import torch

from converter.errors import InputError
from parity.fixtures import build_fixtures, make_batches

L = 8
VOCAB = 50


def test_left_padding_puts_the_last_real_token_in_the_last_slot() -> None:
    fixtures = build_fixtures([], [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]], None, L, VOCAB, False)
    assert [f.slice for f in fixtures] == ["padded", "full-window"]
    (batch,) = make_batches(fixtures, 2, L, pad_id=0)
    assert batch.input_ids.dtype == torch.int64
    assert batch.input_ids.tolist() == [[0, 0, 0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
    assert batch.attention_mask.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [1] * 8]
    assert batch.input_ids[0, L - 1] == 7
    assert batch.fixtures == tuple(fixtures)


def test_pad_id_fills_only_the_padding() -> None:
    fixtures = build_fixtures([], [[0, 1]], None, L, VOCAB, False)
    (batch,) = make_batches(fixtures, 1, L, pad_id=9)
    assert batch.input_ids.tolist() == [[9, 9, 9, 9, 9, 9, 0, 1]]
    assert batch.attention_mask.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1]]


def test_padded_variants_add_a_full_window_variant() -> None:
    fixtures = build_fixtures([], [[1, 2, 3], list(range(L))], None, L, VOCAB, True)
    names = [f.name for f in fixtures]
    # A sequence that already fills the window gets no variant.
    assert names == ["token_ids[0]", "token_ids[0]/full-window", "token_ids[1]"]
    variant = fixtures[1]
    assert variant.slice == "full-window"
    assert variant.token_ids == (1, 2, 3, 1, 2, 3, 1, 2)
    assert len(variant.token_ids) == L
    (batch,) = make_batches([variant], 1, L, pad_id=0)
    assert batch.attention_mask.all()


def test_without_padded_variants_there_are_none() -> None:
    fixtures = build_fixtures([], [[1, 2, 3]], None, L, VOCAB, False)
    assert [(f.name, f.slice) for f in fixtures] == [("token_ids[0]", "padded")]


def test_too_long_fixture_is_refused_by_name() -> None:
    with pytest.raises(InputError, match=r"fixtures\.token_ids\[1\]: 9 tokens .* = 8"):
        build_fixtures([], [[1, 2], list(range(L + 1))], None, L, VOCAB, False)


@pytest.mark.parametrize("bad", [VOCAB, -1, 10_000])
def test_out_of_vocabulary_id_is_refused_by_name(bad: int) -> None:
    with pytest.raises(InputError, match=rf"fixtures\.token_ids\[2\]: token ids \[{bad}\]"):
        build_fixtures([], [[1], [2], [3, bad]], None, L, VOCAB, False)


def test_highest_vocabulary_id_is_accepted() -> None:
    (f,) = build_fixtures([], [[0, VOCAB - 1]], None, L, VOCAB, False)
    assert f.token_ids == (0, VOCAB - 1)


def test_empty_fixture_is_refused_by_name() -> None:
    with pytest.raises(InputError, match=r"fixtures\.token_ids\[0\]"):
        build_fixtures([], [[]], None, L, VOCAB, False)


def test_prompts_without_a_tokenizer_are_refused() -> None:
    with pytest.raises(InputError, match=r"fixtures\.prompts.*no tokenizer"):
        build_fixtures(["hello"], [], None, L, VOCAB, False)


def test_prompts_are_tokenized_and_named() -> None:
    def tokenizer(text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    fixtures = build_fixtures(["hi"], [[4]], tokenizer, L, VOCAB, False)
    assert [f.name for f in fixtures] == ["prompt[0]", "token_ids[0]"]
    assert fixtures[0].token_ids == (ord("h") % VOCAB, ord("i") % VOCAB)
    with pytest.raises(InputError, match=r"fixtures\.prompt\[1\]: 22 tokens"):
        build_fixtures(["hi", "a much too long prompt"], [], tokenizer, L, VOCAB, False)


def test_make_batches_fills_the_last_batch_with_filler_rows() -> None:
    fixtures = build_fixtures([], [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10]], None, L, VOCAB, False)
    batches = make_batches(fixtures, 3, L, pad_id=0)
    assert len(batches) == 2
    first, second = batches
    assert first.fixtures == tuple(fixtures[:3])
    assert second.fixtures == (fixtures[3],)  # only the real rows are listed
    for b in batches:
        assert b.input_ids.shape == (3, L)
        assert b.attention_mask.shape == (3, L)
    # Filler rows repeat the batch's first fixture.
    assert torch.equal(second.input_ids[1], second.input_ids[0])
    assert torch.equal(second.input_ids[2], second.input_ids[0])
    assert second.input_ids[0, -4:].tolist() == [7, 8, 9, 10]
    assert torch.equal(second.attention_mask[2], second.attention_mask[0])


def test_make_batches_exact_multiple_has_no_filler() -> None:
    fixtures = build_fixtures([], [[1], [2], [3]], None, L, VOCAB, False)
    (batch,) = make_batches(fixtures, 3, L, pad_id=0)
    assert batch.input_ids[:, -1].tolist() == [1, 2, 3]


def _pair_tokenizer(first: str, second: str | None = None) -> dict[str, list[int]]:
    """A two-segment tokenizer in BERT's layout: CLS a SEP [b SEP], segment 0 then 1."""
    a = [2, *(ord(c) % VOCAB for c in first), 3]
    b = [] if second is None else [*(ord(c) % VOCAB for c in second), 3]
    return {"input_ids": a + b, "token_type_ids": [0] * len(a) + [1] * len(b)}


def test_pairs_keep_their_segment_ids_in_the_batches() -> None:
    fixtures = build_fixtures(["ab"], [], _pair_tokenizer, L, VOCAB, True, [("q", "pp")], 2)
    names = [f.name for f in fixtures]
    assert names == ["prompt[0]", "prompt[0]/full-window", "pair[0]", "pair[0]/full-window"]
    pair, window = fixtures[2:]
    assert pair.token_types == (0, 0, 0, 1, 1, 1)
    assert window.token_types == (0, 0, 0, 1, 1, 1, 0, 0)  # repeated with its tokens
    assert fixtures[0].token_types == ()  # one text: segment 0 throughout
    (right,) = make_batches(fixtures, 2, L, pad_id=0, right=True)[1:]
    assert right.segments[0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]  # padding: segment 0
    (left,) = make_batches(fixtures[2:3], 1, L, pad_id=0)
    assert left.segments[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    (single,) = make_batches(fixtures[:1], 2, L, pad_id=0)
    assert single.token_type_ids is None and not single.segments.any()


def test_pairs_on_a_model_without_token_types_carry_none() -> None:
    (pair,) = build_fixtures([], [], _pair_tokenizer, L, VOCAB, False, [("q", "p")], 0)
    assert pair.token_types == ()
    assert pair.token_ids == (2, ord("q") % VOCAB, 3, ord("p") % VOCAB, 3)


def test_a_segment_id_outside_the_type_table_is_refused_by_name() -> None:
    with pytest.raises(InputError, match=r"fixtures\.pair\[0\]: segment ids \[1\].*\(0\.\.0\)"):
        build_fixtures([], [], _pair_tokenizer, L, VOCAB, False, [("q", "p")], 1)


def test_pairs_without_a_tokenizer_are_refused() -> None:
    with pytest.raises(InputError, match=r"fixtures\.pairs.*no tokenizer"):
        build_fixtures([], [], None, L, VOCAB, False, [("q", "p")], 2)
