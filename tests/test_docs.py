"""The documentation: the site builds with `mkdocs build --strict` (every page in the nav, no broken
link, the configuration reference generated from the schema), and the README stays a front page
(at most 200 lines, every relative link pointing at a file of the repository)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    reference = (site / "configuration.html").read_text(encoding="utf-8")
    # generated from the schema: a field and its description as configs/schema.py states them
    from configs.schema import ExperimentConfig
    from configs.sweep import SweepSpec

    learners = ExperimentConfig.model_fields["diloco"].annotation.model_fields["learners"]
    assert "diloco.learners" in reference and learners.description in reference
    assert SweepSpec.model_fields["concurrency"].description.split(",")[0] in reference
    for record in (ROOT / "benchmarks" / "results").glob("*.md"):
        assert (site / "records" / record.with_suffix(".html").name).is_file(), record.name


def test_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines (at most 200)"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]
    assert relative, "the README links into docs/"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
