"""The check gate, run by the test command so CI keeps it: ruff on everything, mypy --strict on pdgate/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- test-command -->", 1)[1].split("<!-- /test-command -->", 1)[0]
    cmd = [ln for ln in block.strip().splitlines() if not ln.startswith("```")]
    assert len(cmd) == 1 and "pip install" in cmd[0] and "pytest" in cmd[0]
    real = readme.split("<!-- real-engines -->", 1)[1].split("<!-- /real-engines -->", 1)[0]
    install = [ln for ln in real.strip().splitlines() if not ln.startswith("```")]
    assert len(install) == 1 and f"&& {install[0]} &&" in cmd[0], "the test command installs the real engines"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "test-command" in ci  # .ci/run extracts and runs exactly that block
    out = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == cmd[0]


def test_the_readme_is_a_first_screen_and_every_link_resolves() -> None:
    """README.md is read in five minutes (<= 250 lines); what moved to docs/ is linked, and every relative link of
    the README and docs/ points at a file that exists."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in ("api", "access-control", "operations", "admission", "routing", "configuration", "scale-out",
                 "engines", "http", "testing", "architecture", "messages", "responses"):
        assert f"(docs/{page}.md)" in readme, page
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")):
                assert (doc.parent / target).exists(), f"{doc.name}: {target}"
