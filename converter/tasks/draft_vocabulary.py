"""The draft-vocabulary step of a decoder conversion (recipe ``vocabulary:``).

After the rewrite and before the references: rank the ids on the ranking corpora, judge the
trimmed head by acceptance with the untrimmed checkpoint as target (`converter.vocabulary.
acceptance`), then trim the BC1L module's head and the reference model's alike, so every
later gate compares the program with the checkpoint's logits restricted to the kept ids.
The acceptance gate joins the torch parity report (`DecoderRun.vocabulary`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from converter.errors import InputError
from converter.pipeline.manifest import FileEntry
from converter.pipeline.manifest_fields import write_npy
from converter.pipeline.steps import Advance
from converter.recipe.vocabulary_section import DraftVocabulary
from converter.tasks.decoder_contract import check_top_k
from converter.tasks.shared import need
from converter.vocabulary.corpora import Corpus, corpus_sha256, load_corpus
from converter.vocabulary.ranking import (
    KeptIds,
    always_kept,
    choose_ids,
    corpus_counts,
    tokenizer_rank,
)
from converter.vocabulary.streamed_bytes import body_weights, streamed_section
from converter.vocabulary.trimmed_acceptance import (
    AcceptanceReport,
    judge,
    judging_prompts,
    judging_shape,
)
from parity.gate_registry import GateResult, gate
from parity.model_copies import cast_copy
from parity.reference import restrict_head

HEAD_IDS_FILE = "head_ids.npy"


@dataclass
class TrimmedVocabulary:
    """What the step chose and measured."""

    kept: KeptIds
    vocab_size: int
    hidden_size: int
    ranking: list[dict[str, Any]]  # per corpus: name, source, licence, sha256, tokens
    judging: dict[str, Any]
    streamed: dict[str, Any]  # bytes per decoded token before / after, predicted floors
    acceptance: AcceptanceReport
    gate: GateResult

    def section(self, head_ids: FileEntry) -> dict[str, Any]:
        """The manifest's ``draft_vocabulary`` section."""
        k = self.kept
        return {
            "size": len(k.ids),
            "vocab_size": self.vocab_size,
            "head_ids": head_ids.model_dump(mode="json"),
            "rule": "row j of the LM head (its chunks concatenated) scores token head_ids[j]: "
            "the host maps every logits index and every argmax / top-k index through "
            "head_ids; inputs (token ids, embedding rows) range over the whole vocabulary",
            "ranking": {
                "corpora": self.ranking,
                "always_kept": k.always,
                "kept_by_count": k.ranked_seen,
                "kept_by_tokenizer_order": k.ranked_unseen,
                "corpus_tokens": k.corpus_tokens,
                "corpus_distinct_ids": k.corpus_distinct,
                "order": "special, added and fixture tokens always; then by count on the "
                "corpora; ids the corpora never produced by the tokenizer's merge rank",
            },
            "judging": self.judging,
            "streamed_per_decoded_token": self.streamed,
            "acceptance": {
                "evidence": "measured",
                "what": "greedy speculative acceptance on the judging prompts, target the "
                "untrimmed checkpoint in fp32, drafts the BC1L module in fp16 with the whole "
                "head and with the kept rows",
                **self.acceptance.as_dict(),
                "gate": self.gate.text(),
            },
        }


def _described(corpus: Corpus, tokens: int | None = None) -> dict[str, Any]:
    described = {
        "name": corpus.name,
        "source": corpus.source,
        "licence": corpus.licence,
        "texts": len(corpus.texts),
        "sha256": corpus_sha256(corpus),
    }
    return described if tokens is None else {**described, "tokens": tokens}


def corpus_ranking(
    tokenizer: Any, refs: list[str], where: Any, vocab: int
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The ids' counts summed over the ranking corpora, and each corpus described."""
    counts = np.zeros(vocab, dtype=np.int64)
    described = []
    for ref in refs:
        corpus = load_corpus(ref, where, "vocabulary.ranking_corpora")
        seen = corpus_counts(tokenizer, corpus, vocab)
        counts += seen
        described.append(_described(corpus, int(seen.sum())))
    return counts, described


def judged_prompts(v: DraftVocabulary, length: int) -> int:
    """How many judging prompts the step runs (its progress total)."""
    return judging_shape(length, v.judging_positions).prompts


def check_published(path: Path | None, kept: KeptIds, ranking: list[dict[str, Any]]) -> None:
    """InputError when the ids ranked now are not a published artifact's ``head_ids.npy``
    (another corpus version, another Python's corpora): its program scores those rows."""
    if path is None:
        return
    published = np.load(path)
    if not np.array_equal(published.astype(np.int64), kept.ids):
        corpora = ", ".join(f"{c['name']} sha256 {c['sha256'][:12]}" for c in ranking)
        raise InputError(
            f"{path}: the ranking corpora here ({corpora}) keep other ids than the published "
            "head; compare their sha256 with the manifest's draft_vocabulary.ranking"
        )


def trim_vocabulary(run: Any, advance: Advance) -> None:
    """Rank, judge and trim (see the module docstring); a `DecoderRun` step."""
    v: DraftVocabulary = need(run.recipe.vocabulary, "the vocabulary section")
    ckpt, rw = need(run.ckpt, "the checkpoint"), need(run.rewrite, "the rewrite")
    tokenizer = need(ckpt.tokenizer, "the checkpoint's tokenizer (a draft vocabulary ranks ids)")
    vocab, where = rw.spec.vocab_size, run.recipe.recipe_dir
    counts, ranking = corpus_ranking(tokenizer, v.ranking_corpora, where, vocab)
    always = always_kept(tokenizer, [f.token_ids for f in rw.fixtures], vocab)
    kept = choose_ids(counts, tokenizer_rank(tokenizer, vocab), always, v.size)
    check_published(run.job.expected_head_ids, kept, ranking)
    judging = load_corpus(v.judging_text, where, "vocabulary.judging_text")
    shape = judging_shape(rw.module.io.length, v.judging_positions)
    draft16 = cast_copy(rw.module, torch.float16)
    (report,) = judge(
        ckpt.model, draft16, rw.embed_table, judging_prompts(tokenizer, judging, shape), shape,
        [kept.ids], advance,
    )  # fmt: skip
    del draft16
    ids = torch.from_numpy(kept.ids)
    rw.module.keep_head_rows(ids)
    check_top_k(rw.module.io, rw.module.chunk_sizes)
    restrict_head(ckpt.model, ids)
    result = gate("acceptance", "acceptance_loss").check(
        report.loss,
        v.acceptance_loss,
        where=f"K = 4, {shape.positions} judged positions, {len(kept.ids)} of {vocab} ids",
    )
    d = rw.spec.hidden_size
    width = 2.0 if run.recipe.precision == "float16" else 4.0
    streamed = streamed_section(body_weights(rw.module), d, vocab, len(kept.ids), width)
    run.vocabulary = TrimmedVocabulary(
        kept, vocab, d, ranking, _described(judging), streamed, report, result
    )


def write_head_ids(directory: Path, trimmed: TrimmedVocabulary) -> FileEntry:
    """``head_ids.npy``: the kept ids as int32, row j of the head scoring ``head_ids[j]``."""
    return write_npy(
        directory / HEAD_IDS_FILE,
        trimmed.kept.ids.astype(np.int32),
        "token id of each LM-head row (ascending): row j scores token head_ids[j]",
    )
