"""Figures in the Prefect UI (reports/live.py): the report's PNGs inlined as data URIs, and the live
loss chart; tests/test_ui_browser.py checks that Chromium draws them inside the Prefect UI."""

import base64

from reports.live import inline_figures, live_chart
from run.layout import RunLayout
from run.metrics import JsonlWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png(path, n: int = 64) -> bytes:
    data = PNG_MAGIC + bytes(n)
    path.write_bytes(data)
    return data


def test_report_figures_are_inlined_and_missing_or_oversized_ones_named_by_path(tmp_path):
    a = _png(tmp_path / "a.png")
    md = "# R\n\n![loss vs tokens](a.png)\n\ntext ![gone](missing.png) and [a link](a.png)\n"
    out = inline_figures(md, tmp_path)
    uri = "data:image/png;base64," + base64.b64encode(a).decode()
    assert f"![loss vs tokens]({uri})" in out
    assert f"*gone*: `{tmp_path}/missing.png`" in out
    assert "[a link](a.png)" in out  # links are not figures
    capped = inline_figures(md, tmp_path, max_bytes=10)  # above the cap: every figure by its path
    assert "data:image" not in capped and f"*loss vs tokens*: `{tmp_path}/a.png`" in capped


def test_the_live_chart_draws_every_method_evaluated_so_far(tmp_path):
    assert live_chart(tmp_path) is None  # nothing evaluated yet
    layout = RunLayout(tmp_path)
    for method, losses in (("dp", [5.0, 4.0]), ("diloco", [5.0, 4.5, 4.2])):
        log = JsonlWriter(layout.metrics("pretrain", method, "eval"))
        for i, loss in enumerate(losses):
            log({"method": method, "tokens": 1000 * i, "val/loss": loss})
        log.close()
    md = live_chart(tmp_path, "tokens")
    encoded = md.split("data:image/png;base64,", 1)[1].split(")", 1)[0]
    assert base64.b64decode(encoded).startswith(PNG_MAGIC)
    # DiLoCo first (the report's order), each at its latest point
    assert md.endswith("Latest held-out loss: diloco: 4.2000 at 2,000 tokens; dp: 4.0000 at 1,000 tokens.\n")


def test_the_html_report_is_one_file_with_its_tables_and_figures(tmp_path):
    from reports.live import report_html

    _png(tmp_path / "loss.png")
    md = "# Run report: x\n\n| figure | DiLoCo |\n|---|---|\n| test loss | 4.2 |\n\n![loss](loss.png)\n"
    page = report_html(md, tmp_path, "Run report: x <tiny>")
    assert page.startswith("<!doctype html>") and "<title>Run report: x &lt;tiny&gt;</title>" in page
    assert "<table>" in page and "<td>4.2</td>" in page
    assert '<img alt="loss" src="data:image/png;base64,' in page and "loss.png" not in page
