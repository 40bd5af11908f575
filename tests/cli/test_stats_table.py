"""The ``stats`` table shows a scrape's labels and the scrape's path as they are: square brackets
in them were read as rich markup (``[/x]``: a MarkupError traceback; ``[old]``: text dropped)."""

from __future__ import annotations

from tests.cli.conftest import cli


def test_regression_brackets_in_a_scrapes_labels_or_path_were_a_traceback_or_dropped(tmp_path):
    scrape = tmp_path / "[/o]" / "[k]s.prom"
    scrape.parent.mkdir(parents=True)
    scrape.write_text('tiered_kv_hits_total{tier="[/b]x"} 5\n'
                      'tiered_kv_misses_total{tier="x",reason="[/r]"} 2\n')
    result = cli("stats", scrape)
    assert result.code == 0 and "Traceback" not in result.err, result.err
    assert "│ [/b]x " in result.out and "│ [/r]:2 " in result.out, result.out
    assert f"tiered-kv metrics: {scrape}" in result.out, result.out


def test_regression_brackets_in_an_event_label_were_a_traceback(tmp_path):
    scrape = tmp_path / "s.prom"
    scrape.write_text('tiered_kv_hits_total{tier="x"} 5\ntiered_kv_events_total{event="[/y]z"} 3\n')
    result = cli("stats", scrape)
    assert result.code == 0 and "Traceback" not in result.err, result.err
    assert "[/y]z: 3" in result.out, result.out
