"""The ``vocabulary:`` section of a text-generation recipe: a draft's LM head trimmed to the
tokens text uses most (`converter.vocabulary`).

The body is kept whole; only the head's rows go, so the draft streams fewer weight bytes per
decoded token. The price is acceptance: a target token outside the kept rows is a rejected
draft. The conversion measures it (greedy, K = 1..4, on the judging text) and gates the
relative drop of mean accepted drafts per cycle at K = 4 against the untrimmed draft.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from converter.recipe.yaml_errors import StrictModel, raise_rules

# The floor for a judged acceptance: at least about a thousand held-out positions.
MIN_JUDGING_POSITIONS = 1000


class DraftVocabulary(StrictModel):
    """How many head rows to keep, ranked on which corpus, judged on which text."""

    # Rows of the LM head, special and fixture tokens included.
    size: int = Field(ge=2, strict=True)
    # Corpora anec knows (converter.vocabulary.corpora.CORPORA) or paths to a UTF-8 text
    # file or a folder of *.txt files (relative to the recipe file); their counts add up.
    ranking_corpora: list[str] = Field(
        min_length=1,
        json_schema_extra={"expected": "known corpus names or paths to text files"},
    )
    # Human-written text of another source than the ranking corpus: prompts whose target
    # continuations the acceptance is measured on.
    judging_text: str = Field(
        default="python-docs-topics",
        json_schema_extra={"expected": "a known corpus name or a path to text files"},
    )
    judging_positions: int = Field(default=1024, ge=MIN_JUDGING_POSITIONS, strict=True)
    # Gate: the relative drop of mean accepted drafts per cycle at K = 4, trimmed against
    # untrimmed (both fp16 drafts of the fp32 checkpoint as target).
    acceptance_loss: float = Field(default=0.05, ge=0, lt=1, strict=True)

    @model_validator(mode="after")
    def _different_sources(self) -> DraftVocabulary:
        if self.judging_text.strip() in {c.strip() for c in self.ranking_corpora}:
            problem = (
                f"{self.judging_text!r} is also a ranking corpus; judge on text of another "
                "source (acceptance on the ranking text itself would flatter the trimmed head)"
            )
            raise_rules("DraftVocabulary", [(("judging_text",), problem)])
        return self
