"""A draft vocabulary's parts on tiny models: the replayed acceptance counts what the cycle
loop counts, the kept ids follow their ranking rules, a trimmed head scores exactly the kept
rows of the whole one (module and reference alike), and the recipe section's rules."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import build_tiny, perturbed_copy

from converter.compression.variant_acceptance import AcceptanceSetup, SessionVerifier, session
from converter.drafts.speculation import Acceptance, replay, speculate
from converter.errors import InputError
from converter.recipe import RecipeError, load_recipe
from converter.vocabulary.corpora import load_corpus
from converter.vocabulary.ranking import choose_ids, tokenizer_rank
from converter.vocabulary.trimmed_acceptance import (
    batch_draft_logits,
    batch_greedy,
    draft_logits,
    judging_shape,
)
from parity.reference import greedy_ids, greedy_steps, restrict_head

PROMPTS = [[7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46]]
NEW = 12


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    return build_tiny("llama", batch=1, length=32)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_replay_counts_what_the_cycle_loop_counts(tiny, k: int) -> None:  # type: ignore[no-untyped-def]
    # A draft that agrees sometimes: every count of the cycle loop (`speculate`, the draft's
    # cache rolled back and extended) equals the replay's from one teacher-forced pass.
    draft = perturbed_copy(tiny.module, 0.3)
    setup = AcceptanceSetup([k], PROMPTS, NEW)
    looped, replayed = Acceptance(k), Acceptance(k)
    for prompt in PROMPTS:
        verifier = SessionVerifier(session(tiny.module, setup, tiny.embed_table, k + 1))
        make = lambda: session(draft, setup, tiny.embed_table, k)  # noqa: E731
        speculate(make, verifier, prompt, k, NEW, looped)
        cont = greedy_ids(tiny.model, tuple(prompt), NEW + k - 1)
        logits = draft_logits(draft, tiny.embed_table, prompt + cont[:-1])[len(prompt) - 1 :]
        replay((logits.argmax(-1) == torch.tensor(cont)).tolist(), NEW, k, replayed)
    assert 0 < sum(looped.accepted) < sum(looped.reached)  # neither all nor nothing accepted
    assert (replayed.reached, replayed.accepted) == (looped.reached, looped.accepted)
    assert (replayed.cycles, replayed.tokens) == (looped.cycles, looped.tokens)


def test_the_judging_batches_compute_what_one_prompt_at_a_time_computes(tiny) -> None:  # type: ignore[no-untyped-def]
    prompts = [[7, 8, 9, 10, 11], [40, 41, 42, 43, 44], [3, 1, 4, 1, 5]]
    conts = batch_greedy(tiny.model, prompts, 9)
    assert conts == [greedy_ids(tiny.model, tuple(p), 9) for p in prompts]
    rows = [p + c for p, c in zip(prompts, conts, strict=True)]
    batch = batch_draft_logits(tiny.module, tiny.embed_table, rows)
    for row, logits in zip(rows, batch, strict=True):
        alone = draft_logits(tiny.module, tiny.embed_table, row)
        torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)


def test_replay_needs_the_drafts_past_the_last_token() -> None:
    with pytest.raises(ValueError, match="need 7"):
        replay([True] * 6, 4, 4, Acceptance(4))


def test_kept_ids_rank_by_count_then_tokenizer_order_and_keep_the_fixed_ones() -> None:
    counts = np.array([0, 5, 0, 9, 1, 0, 5, 0])
    rank = np.array([7.0, 1, 0, 2, 3, 4, 0, 5])  # unseen ids: 2 before 5 before 7 before 0
    kept = choose_ids(counts, rank, {0}, 6)
    # 0 fixed; then 3 (9), 6 and 1 (5 each: rank 0 before 1), 4 (1); then unseen id 2
    assert kept.ids.tolist() == [0, 1, 2, 3, 4, 6]
    assert (kept.always, kept.ranked_seen, kept.ranked_unseen) == (1, 4, 1)
    with pytest.raises(InputError, match="below the 3 special and fixture tokens"):
        choose_ids(counts, rank, {0, 1, 2}, 2)
    with pytest.raises(InputError, match="exceeds the checkpoint's 8 tokens"):
        choose_ids(counts, rank, set(), 9)


def test_tokenizer_rank_orders_a_bpe_vocabulary_by_its_merges() -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "c": 2, "bc": 3, "ab": 4, "abc": 5}
    merges = [("a", "b"), ("b", "c"), ("ab", "c")]
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, merges)))
    rank = tokenizer_rank(fast, 7)
    assert rank[:6].tolist() == [0, 0, 0, 2, 1, 3]  # the alphabet first, then merge order
    assert rank[6] > rank[:6].max()  # an id the model does not name comes last


def test_a_trimmed_head_scores_exactly_the_kept_rows(tiny) -> None:  # type: ignore[no-untyped-def]
    ids = torch.tensor([1, 5, 9, 40, 41, 100, 127, 200, 255])
    module = copy.deepcopy(tiny.module)
    before = draft_logits(module, tiny.embed_table, PROMPTS[1])
    module.keep_head_rows(ids)
    assert module.chunk_sizes == [len(ids)]
    after = draft_logits(module, tiny.embed_table, PROMPTS[1])
    # the same dot products; a kernel for fewer rows may only add in another order
    torch.testing.assert_close(after, before[:, ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="ascending"):
        copy.deepcopy(tiny.module).keep_head_rows(torch.tensor([5, 1]))


def test_a_restricted_reference_maps_its_greedy_rows_back_to_token_ids(tiny) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(tiny.model)
    prompt = tuple(PROMPTS[0])
    full = model(input_ids=torch.tensor([prompt])).logits[0]
    ids = torch.tensor(sorted({*range(0, 256, 3), *greedy_ids(model, prompt, 6)}))
    restrict_head(model, ids)
    restricted = model(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(restricted, full[:, ids], rtol=1e-6, atol=1e-6)
    steps = greedy_steps(model, prompt, 6, ids)
    # every kept greedy token of the whole head is kept, so the restricted greedy is the same
    assert [t for t, _ in steps] == greedy_ids(tiny.model, prompt, 6)


def test_judging_fits_the_window_or_says_why() -> None:
    shape = judging_shape(64, 1024)
    assert (shape.prompt_tokens, shape.new_tokens, shape.prompts) == (28, 32, 32)
    assert shape.prompt_tokens + shape.new_tokens + 4 == 64  # drafts past the end fit too
    with pytest.raises(InputError, match="shapes.sequence_length: 8 slots"):
        judging_shape(8, 1024)


def _recipe(tmp_path: Path, vocabulary: str) -> Path:
    file = tmp_path / "r.yaml"
    file.write_text(
        "name: r\ntask: text-generation\nsource: {kind: hf-dir, path: .}\n"
        f"fixtures: {{prompts: [hi]}}\nvocabulary:\n{vocabulary}",
        encoding="utf-8",
    )
    return file


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("  size: 100\n  ranking_corpora: [a.txt]\n  judging_text: a.txt\n",
         "judging_text.*also a ranking corpus"),
        ("  size: 100\n  ranking_corpora: [a.txt]\n  judging_positions: 500\n",
         "judging_positions"),
        ("  size: 1\n  ranking_corpora: [a.txt]\n", "vocabulary.size"),
        ("  size: 100\n  ranking_corpora: []\n", "ranking_corpora"),
        ("  size: 100\n  ranking_corpora: [a.txt]\n  acceptance_loss: 1.5\n",
         "acceptance_loss"),
    ],
)  # fmt: skip
def test_the_recipe_section_is_checked(tmp_path: Path, section: str, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe(_recipe(tmp_path, section))


def test_corpora_are_found_by_name_or_path_or_named_in_the_error(tmp_path: Path) -> None:
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "one.txt").write_text("First paragraph.\n\nSecond one.\n")
    corpus = load_corpus("texts", tmp_path, "vocabulary.ranking_corpora")
    assert corpus.texts == ["First paragraph.", "Second one."]
    assert load_corpus("python-docs-topics", tmp_path, "x").texts  # ships with CPython
    with pytest.raises(InputError, match="vocabulary.judging_text: 'nope' is neither"):
        load_corpus("nope", tmp_path, "vocabulary.judging_text")


def test_anec_parity_refuses_a_ranking_that_no_longer_gives_the_published_head(
    tmp_path: Path,
) -> None:
    from converter.tasks.draft_vocabulary import check_published

    kept = choose_ids(np.array([3, 0, 2, 1]), np.zeros(4), set(), 2)  # ids 0 and 2
    path = tmp_path / "head_ids.npy"
    np.save(path, np.array([0, 2], dtype=np.int32))
    check_published(path, kept, [])  # the same ids: nothing to say
    np.save(path, np.array([0, 3], dtype=np.int32))
    ranking = [{"name": "c", "sha256": "ab" * 32}]
    with pytest.raises(InputError, match="head_ids.npy: the ranking corpora here \\(c sha256"):
        check_published(path, kept, ranking)
