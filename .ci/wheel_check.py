#!/usr/bin/env python3
"""CI step: build anec's wheel, install it non-editable into a fresh venv, import every module.

An editable install (``pip install -e``, what the README and the rest of CI use) imports the
source tree directly, so it hides a package the wheel leaves out; a wheel user gets an
ImportError instead. This step installs the wheel the way a user does and then imports every
module of the source tree from the installed copy (each must resolve inside the fresh venv,
never from the checkout) and runs ``anec --help``.

Kept fast: the wheel is built without build isolation where the CI venv has setuptools, and
the fresh venv reuses the running venv's site-packages for torch, coremltools and the rest through
a ``.pth`` line written after the wheel is installed, so nothing is downloaded.

Usage: ``python .ci/wheel_check.py`` from the CI venv. ``tests/test_packaging.py`` imports
``build_wheel`` and ``shipped_modules`` from here.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Directories holding Python files that are deliberately not part of the installed package.
NOT_SHIPPED = {"tests", "bench", "build", "dist", "artifacts"}


def _ignore(directory: str, names: list[str]) -> set[str]:
    """What the wheel is not built from: caches, hidden directories, and at the top level
    the directories outside the package (an old ``build/`` or a large ``artifacts/``)."""
    top = Path(directory) == REPO
    return {
        n
        for n in names
        if n == "__pycache__"
        or n.endswith(".egg-info")
        or n.startswith(".")
        or (top and n in NOT_SHIPPED)
    }


def shipped_modules(repo: Path = REPO) -> list[str]:
    """Dotted names of every module the wheel must carry: each ``.py`` file under the
    repository outside ``NOT_SHIPPED`` and hidden directories (``pkg/__init__.py`` -> ``pkg``).
    """
    names = []
    for path in sorted(repo.rglob("*.py")):
        parts = path.relative_to(repo).parts
        if len(parts) < 2 or parts[0] in NOT_SHIPPED or any(p.startswith(".") for p in parts):
            continue  # top-level scripts, tests, benchmarks, venvs, caches
        if any(p.endswith(".egg-info") or p == "__pycache__" for p in parts):
            continue
        module = list(parts[:-1]) + ([] if path.name == "__init__.py" else [path.stem])
        names.append(".".join(module))
    return names


def build_wheel(out_dir: Path, repo: Path = REPO) -> Path:
    """Build the wheel from a clean copy of the tree (a stale ``build/`` cannot leak in)."""
    source = out_dir / "src"
    shutil.copytree(repo, source, ignore=_ignore)
    # Without build isolation when this venv has setuptools (Python 3.11 venvs do): nothing
    # to download. Python 3.12+ venvs lack it, and pip then fetches it as usual.
    no_isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *no_isolation]
        + ["-w", str(out_dir / "dist"), str(source)],
        check=True,
    )
    (wheel,) = (out_dir / "dist").glob("anec-*.whl")
    return wheel


def wheel_files(wheel: Path) -> set[str]:
    """Paths inside the wheel."""
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


_IMPORT_ALL = """
import importlib, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
for name in sys.argv[2:]:
    module = importlib.import_module(name)
    where = Path(module.__file__).resolve()
    if site not in where.parents:
        sys.exit(f"{name} imported from {where}, not from the installed wheel in {site}")
print(f"imported {len(sys.argv) - 2} modules from {site}")
"""


def check_installed(wheel: Path, work: Path) -> None:
    """Install ``wheel`` into a fresh venv under ``work``, import every module, run anec."""
    env_dir = work / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / ("Scripts" if sys.platform == "win32" else "bin")
    python = bin_dir / "python"
    # The fresh venv sees only its own packages while pip installs: a clean, non-editable install.
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # Dependencies from the running (CI) venv, appended after the venv's own site-packages.
    # A .pth line only adds a path: the CI venv's editable-install hook is not run.
    (site / "zz_ci_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Run outside the checkout, so the current directory cannot supply the modules.
    modules = shipped_modules()
    subprocess.run([str(python), "-c", _IMPORT_ALL, str(site), *modules], cwd=work, check=True)
    subprocess.run(
        [str(bin_dir / "anec"), "--help"], cwd=work, check=True, stdout=subprocess.DEVNULL
    )
    print(f"anec --help ran from {bin_dir / 'anec'}")


def main() -> None:
    """Build, install and check the wheel in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="anec-wheel-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work)
        print(f"built {wheel.name}")
        check_installed(wheel, work)


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as e:  # the failing step already printed why
        sys.exit(f"wheel check failed: {' '.join(map(str, e.cmd[:3]))} ... exited {e.returncode}")
