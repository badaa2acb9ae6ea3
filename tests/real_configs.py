"""The vendored Hugging Face ``config.json`` files of real checkpoints (tests/data/configs).

They live inside the repository so the real-shape tests run in any checkout and any CI: a
missing file is a failure, never a silent skip (tests/data/configs/README.md lists them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent / "data" / "configs"


def config_path(name: str) -> Path:
    """``tests/data/configs/<name>.json``; FileNotFoundError naming it when absent."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: vendored config missing (see {CONFIG_DIR}/README.md)")
    return path


def config_dict(name: str) -> dict[str, Any]:
    """The vendored config ``name`` as a dict."""
    data: dict[str, Any] = json.loads(config_path(name).read_text())
    return data
