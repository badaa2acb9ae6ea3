"""The manifest's schema version: what anec reads, what it refuses, and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from converter.errors import InputError
from converter.pipeline.manifest import IO_CONTRACT_CHANGES, SCHEMA_VERSION, check_schema_version

PATH = Path("art/manifest.json")


def test_the_current_version_is_read() -> None:
    check_schema_version({"schema_version": SCHEMA_VERSION, "task": "text-generation"}, PATH)


def test_an_old_decoder_manifest_is_refused_with_what_changed() -> None:
    with pytest.raises(InputError) as e:
        check_schema_version({"schema_version": 2, "task": "text-generation"}, PATH)
    message = str(e.value)
    assert str(PATH) in message and "schema_version 2" in message
    assert "(B, n, 1, V_k)" in message and "convert the recipe again" in message


def test_a_schema_3_decoder_manifest_is_read_one_package_means_what_it_meant() -> None:
    (chunks,) = [c for c in IO_CONTRACT_CHANGES if c["schema_version"] == 4]
    assert "kv_cache.chunks" in chunks["what"] and chunks["older_readable"]
    check_schema_version({"schema_version": 3, "task": "text-generation"}, PATH)


def test_an_old_encoder_manifest_is_read_its_contract_did_not_change() -> None:
    assert all("feature-extraction" not in c["tasks"] for c in IO_CONTRACT_CHANGES)
    check_schema_version({"schema_version": 2, "task": "feature-extraction"}, PATH)


@pytest.mark.parametrize(
    "doc", [{"schema_version": SCHEMA_VERSION + 1}, {}, {"schema_version": "3"}]
)
def test_a_newer_or_missing_version_is_refused(doc: dict) -> None:
    with pytest.raises(InputError, match="this anec reads"):
        check_schema_version(doc, PATH)
