"""The wheel carries every package of the tree: a non-editable install must not miss one.

``pip install -e`` imports the source tree and hides a package left out of the wheel (it
happened: ``converter.compression``). CI installs the wheel into a fresh venv and imports every
module (``.ci/wheel_check.py``); this fast test checks the wheel's file list.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _wheel_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wheel_check", REPO / ".ci" / "wheel_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheel_holds_every_module_and_the_shipped_recipes(tmp_path: Path) -> None:
    check = _wheel_check()
    files = check.wheel_files(check.build_wheel(tmp_path))
    modules = check.shipped_modules()
    assert {"converter.compression", "converter.placement", "parity.mil.kernels"} <= set(modules)
    missing = []
    for name in modules:
        as_module, as_package = (
            name.replace(".", "/") + ".py",
            name.replace(".", "/") + "/__init__.py",
        )
        if as_module not in files and as_package not in files:
            missing.append(name)
    assert not missing, f"modules the wheel leaves out: {missing}"
    recipes = {p.name for p in (REPO / "recipes").glob("*.yaml")}
    assert recipes and {f"recipes/{r}" for r in recipes} <= files


def test_shipped_modules_finds_a_package_added_to_the_tree(tmp_path: Path) -> None:
    check = _wheel_check()
    (tmp_path / "converter" / "newpkg").mkdir(parents=True)
    (tmp_path / "converter" / "__init__.py").write_text("")
    (tmp_path / "converter" / "newpkg" / "__init__.py").write_text("")
    (tmp_path / "converter" / "newpkg" / "step.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    assert check.shipped_modules(tmp_path) == [
        "converter",
        "converter.newpkg",
        "converter.newpkg.step",
    ]
