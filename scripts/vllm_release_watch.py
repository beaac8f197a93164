"""Report vLLM releases on PyPI newer than what pyproject.toml's ``gpu`` extra admits.

    python scripts/vllm_release_watch.py          # report; exit 0 (CI runs it so)
    python scripts/vllm_release_watch.py --strict # exit 1 when a newer release exists

Without network it says so and exits 0 (2 with --strict): it never fails a build offline.
A newer release is checked with ``scripts/check_vllm_release.sh VERSION`` before the pin
is widened.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import urllib.request

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPI = "https://pypi.org/pypi/vllm/json"


def gpu_pin(pyproject: str) -> SpecifierSet:
    """The specifier of ``vllm`` in the ``gpu`` extra of pyproject.toml's text."""
    found = re.search(r'^gpu\s*=\s*\[\s*"vllm([^"]*)"', pyproject, re.MULTILINE)
    if found is None:
        raise ValueError("pyproject.toml has no gpu extra pinning vllm")
    return SpecifierSet(found.group(1))


def newer_than_pin(pin: SpecifierSet, releases: list[str]) -> list[str]:
    """Final releases above every version the pin admits, oldest first."""
    versions = []
    for text in releases:
        try:
            v = Version(text)
        except InvalidVersion:
            continue
        if not (v.is_prerelease or v.is_devrelease):
            versions.append(v)
    admitted = [v for v in versions if v in pin]
    if not admitted:
        return sorted(str(v) for v in versions if v not in pin)
    top = max(admitted)
    return [str(v) for v in sorted(versions) if v > top and v not in pin]


def main(argv: list[str]) -> int:
    strict = "--strict" in argv
    url = next((a.split("=", 1)[1] for a in argv if a.startswith("--url=")), PYPI)
    pin = gpu_pin((ROOT / "pyproject.toml").read_text())
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            releases = list(json.load(response)["releases"])
    except (OSError, ValueError, KeyError) as exc:
        print(f"vllm release watch: PyPI not reachable ({exc}); pin vllm{pin} not checked")
        return 2 if strict else 0
    newer = newer_than_pin(pin, releases)
    if not newer:
        print(f"vllm release watch: no release newer than the pin vllm{pin}")
        return 0
    print(
        f"vllm release watch: PyPI has vLLM {', '.join(newer)}, newer than the pin "
        f"vllm{pin}; check with scripts/check_vllm_release.sh {newer[-1]}"
    )
    return 1 if strict else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
