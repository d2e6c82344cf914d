"""Name the releases on the package index newer than what an environment installed (``make test-latest``).

``pip install --upgrade`` falls back to an older release without a word where the newest one's own
requirements do not resolve (transformers 5.25.0 asked for ``kernels>=0.19.1`` before PyPI had it):
the run then tests the older release under the name "latest". This prints, for each package named,
the newest version the index lists beside the one installed, and why pip would not take it.

    python scripts/unresolved_releases.py transformers accelerate

Exit status 0 either way: a release that cannot be installed yet is news, not a failure.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version


def newest_on_index(package: str) -> str | None:
    """The newest version ``pip index versions`` lists (None where the index cannot be read)."""
    run = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", package],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(rf"^{re.escape(package)} \(([^)]+)\)", run.stdout, re.MULTILINE)
    return found.group(1) if found else None


def why_not(package: str, release: str) -> str:
    """pip's first error line on installing ``package==release`` (a dry run: nothing changes)."""
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "-q", f"{package}=={release}"],
        capture_output=True,
        text=True,
        check=False,
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("ERROR")]
    if not errors:
        return "pip resolves it: rerun make test-latest"
    return re.sub(r" \(from versions: [^)]*\)", "", errors[0])


def main(packages: list[str]) -> int:
    for package in packages:
        try:
            installed = version(package)
        except PackageNotFoundError:
            print(f"{package}: not installed")
            continue
        newest = newest_on_index(package)
        if newest is None:
            print(f"{package} {installed}: the index did not answer")
        elif newest != installed:
            print(f"NOTE: {package} {newest} is on the index; {installed} is what installed and was tested.")
            print(f"      {why_not(package, newest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
