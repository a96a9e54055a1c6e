"""Rendering of live per-rank views: pure functions over RowView snapshots (no processes)."""

from __future__ import annotations

from dataclasses import replace

from monarch_jupyter.widgets.dashboard import render_folded, render_header, render_table
from monarch_jupyter.widgets.model import RowView, slowest_rank, stragglers, summarize
from monarch_jupyter.widgets.text import fmt_bytes, fmt_progress, fmt_seconds, header_text, stable_text

BASE = RowView(rank=0, state="running", host="node-a", device="cpu", elapsed=1.5, n=None, total=None, desc="",
               postfix="", last_line="", rss=300 * 2**20, cuda_allocated=0, cuda_reserved=0, error="")


def rows_with(*specs: tuple) -> list[RowView]:
    return [replace(BASE, rank=i, state=s, n=n, total=t) for i, (s, n, t) in enumerate(specs)]


def test_formats():
    assert fmt_seconds(0.42) == "0.4 s" and fmt_seconds(185) == "3 m 05 s" and fmt_seconds(7260) == "2 h 01 m"
    assert fmt_bytes(0) == "" and fmt_bytes(300 * 2**20) == "300 MiB" and fmt_bytes(3 * 2**30 // 2) == "1.5 GiB"
    row = replace(BASE, n=3.0, total=10.0, desc="train", postfix="loss=0.25")
    assert fmt_progress(row) == "3/10 · train · loss=0.25"
    assert fmt_progress(replace(BASE, n=2.5)) == "2.5"


def test_slowest_is_least_progress_then_longest_finished():
    assert slowest_rank(rows_with(("running", 5, 10), ("running", 2, 10), ("running", 7, 10))) == 1
    assert slowest_rank(rows_with(("running", None, None), ("running", None, None))) is None
    assert slowest_rank(rows_with(("running", 5, 10), ("running", 5, 10))) is None  # in step: nobody lags
    assert slowest_rank(rows_with(("done", None, None), ("running", None, None))) == 1
    rows = rows_with(("done", 1, 1), ("done", 1, 1))
    finished = [replace(r, elapsed=e) for r, e in zip(rows, (2.0, 3.5), strict=True)]
    assert slowest_rank(finished) == 1
    finished[1] = replace(finished[1], elapsed=2.05)  # a few percent apart is noise, not a straggler
    assert slowest_rank(finished) is None


def test_stragglers_are_behind_the_median_or_still_running_after_others_finished():
    rows = rows_with(*[("running", 50, 100)] * 6, ("running", 10, 100), ("running", 49.5, 100))
    assert [r.rank for r in stragglers(rows)] == [6]
    rows = rows_with(("done", 10, 10), ("running", 9, 10), ("running", 3, 10))
    assert [r.rank for r in stragglers(rows)] == [2, 1]
    assert stragglers(rows_with(*[("running", 5, 10)] * 4)) == []


def test_stable_text_groups_ranks_and_has_no_times():
    rows = rows_with(*[("done", 1, 1)] * 30, ("error", None, None), ("done", 1, 1))
    rows[30] = replace(rows[30], error="ValueError: bad")
    text = stable_text(rows, summarize(rows, 32, True), title="mesh cell")
    assert text == ("mesh cell: ranks 0-31: error on rank 30 · done on ranks 0-29,31\n"
                    "  ranks 0-29,31: done (cpu)\n"
                    "  rank 30: error (ValueError: bad) (cpu)")


def test_header_counts_states():
    rows = rows_with(("running", 1, 4), ("done", 4, 4), ("error", None, None))
    summary = summarize(rows, 3, True)
    assert header_text(summary) == ("ranks 0-2: running on rank 0 · error on rank 2 · done on rank 1 · "
                                    "slowest rank 0 · 1.5 s")
    html = render_header(summary, "mesh cell")
    assert "slowest: rank 0" in html and "1.5 s" in html


def test_rank_output_is_escaped_in_html():
    row = replace(BASE, last_line='<img src=x onerror="alert(1)">', desc="<b>", n=1.0, total=2.0)
    html = render_table([row])
    assert "<img" not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html
    assert "<b>" not in html.split("<tbody>")[1]


def test_folded_view_lists_only_ranks_that_need_a_look():
    rows = rows_with(*[("running", 50, 100)] * 20, ("running", 5, 100), ("dead", None, None))
    rows[21] = replace(rows[21], error="signal SIGKILL")
    html = render_folded(rows, summarize(rows, 22, True))
    assert html.count('class="mj-row"') == 2
    assert 'data-rank="20"' in html and 'data-rank="21" data-state="dead"' in html and "signal SIGKILL" in html
