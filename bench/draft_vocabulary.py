"""Draft vocabulary sizes side by side: streamed bytes per decoded token, the predicted floor,
and the measured acceptance of each trimmed head against the untrimmed draft.

    python bench/draft_vocabulary.py RECIPE [--sizes 8192,16384,32768] [--json FILE]

Issue 25, items 1-2. RECIPE is a text-generation recipe (a shipped name or a file); its
``vocabulary:`` section gives the ranking corpora, the judging text and positions (without
one, the shipped recipes' corpora and 1,024 positions). The checkpoint is rewritten as the
conversion does (the recipe's window), the ids are ranked once, and one judging pass (the
target's fp32 greedy continuations, one fp16 draft pass per prompt) judges every size: the
trimmed heads' logits are the whole head's at their rows. Prints per size the head rows, the
streamed bytes ratio, the share of judged target tokens outside the kept ids, mean accepted
drafts per cycle at K = 1..4 and the loss at K = 4; then time and peak memory.

Acceptance figures are measured here (greedy, CPU, torch); floors are the cost model's
predictions (SPEC section 6), for the weights of one decode step.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from converter.checkpoints.loading import load_checkpoint
from converter.recipe import DecoderRecipe, load_recipe, locate_recipe
from converter.recipe.vocabulary_section import DraftVocabulary
from converter.tasks.draft_vocabulary import corpus_ranking
from converter.tasks.text_generation import rewrite_decoder
from converter.vocabulary.corpora import load_corpus
from converter.vocabulary.ranking import always_kept, choose_ids, tokenizer_rank
from converter.vocabulary.streamed_bytes import body_weights, streamed_section
from converter.vocabulary.trimmed_acceptance import judge, judging_prompts, judging_shape
from parity.model_copies import cast_copy
from parity.torch_settings import parity_torch

DEFAULT = DraftVocabulary(
    size=16384,
    ranking_corpora=["wordnet-3.0-glosses", "shakespeare-gutenberg", "python-stdlib-source"],
)


def main() -> None:
    """Parse the arguments, measure every size, print the table (and write --json)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--sizes", default="8192,16384,24576,32768,49152")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = Path(args.recipe) if Path(args.recipe).is_file() else locate_recipe(args.recipe)
    recipe = load_recipe(path)
    assert isinstance(recipe, DecoderRecipe), "a text-generation recipe"
    v = recipe.vocabulary or DEFAULT
    started = time.perf_counter()
    with parity_torch():
        ckpt = load_checkpoint(recipe.resolve_source(), recipe.task)
        rw = rewrite_decoder(recipe, ckpt)
        tok, vocab = ckpt.tokenizer, rw.spec.vocab_size
        counts, ranking = corpus_ranking(tok, v.ranking_corpora, recipe.recipe_dir, vocab)
        rank = tokenizer_rank(tok, vocab)
        always = always_kept(tok, [f.token_ids for f in rw.fixtures], vocab)
        sizes = [min(int(s), vocab) for s in args.sizes.split(",")]
        kept = [choose_ids(counts, rank, always, n) for n in sizes]
        judging = load_corpus(v.judging_text, recipe.recipe_dir, "vocabulary.judging_text")
        shape = judging_shape(rw.module.io.length, v.judging_positions)
        prompts = judging_prompts(tok, judging, shape)
        draft16 = cast_copy(rw.module, torch.float16)
        reports = judge(ckpt.model, draft16, rw.embed_table, prompts, shape, [k.ids for k in kept])
    body, d = body_weights(rw.module), rw.spec.hidden_size
    rows = []
    print(f"{recipe.name}: {vocab} ids, {shape.positions} judged positions "
          f"({shape.prompts} prompts of {shape.prompt_tokens} + {shape.new_tokens} tokens), "
          f"judging text {v.judging_text}")  # fmt: skip
    print(f"{'rows':>7} {'bytes':>6} {'outside':>8} " + " ".join(f"K={k}:full/trim" for k in
          range(1, 5)) + "  loss@4  M4 floor ms before/after")  # fmt: skip
    for n, report in zip(sizes, reports, strict=True):
        streamed = streamed_section(body, d, vocab, n)
        m4 = streamed["floors"]["per_chip"].get("M4", {})
        pairs = " ".join(
            f"{a.mean_accepted:5.3f}/{b.mean_accepted:5.3f}"
            for a, b in zip(report.full, report.trimmed, strict=True)
        )
        print(f"{n:>7} {streamed['ratio']:>6.3f} {report.outside_share:>8.4f} {pairs}  "
              f"{report.loss:6.4f}  {m4.get('before_ms')}/{m4.get('after_ms')}")  # fmt: skip
        rows.append({"rows": n, "streamed": streamed, "acceptance": report.as_dict()})
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"time {seconds:.0f} s, peak RSS {peak:.2f} GiB")
    if args.json:
        doc = {"recipe": recipe.name, "ranking": ranking, "sizes": rows, "seconds": seconds}
        args.json.write_text(json.dumps(doc, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
