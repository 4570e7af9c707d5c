"""``kvfabric bench rag``'s printed output and plot, from a small offline result (no servers)."""

from __future__ import annotations

import io

import pytest

from kvfabric.bench import rag
from kvfabric.bench.replay_report import print_report


def _point(frac: float, with_chunks: bool) -> dict:
    sim = {"lru": {"block_hit_rate": 0.30, "token_hit_rate": 0.32},
           "tail-lru": {"block_hit_rate": 0.30, "token_hit_rate": 0.32},
           "s3fifo": {"block_hit_rate": 0.20, "token_hit_rate": 0.25}}
    if with_chunks:
        for v in sim.values():
            v["chunk_token_hit_rate"] = 0.1
    levels = {k: {"block_hit_rate": 0.31, "token_hit_rate": 0.322} for k in ("exists", "loaded", "useful")}
    row = {"capacity_fraction": frac, "belady": 0.436, "infinite": 0.436, "belady_tokens": 0.453,
           "infinite_tokens": 0.453, "sim": sim, "real": {}}
    if frac == 0.1:
        row["real"]["lru"] = {"levels": levels}
        if with_chunks:
            row["real"]["lru"]["chunk_levels"] = {k: {"token_hit_rate": 0.104} for k in levels}
    if with_chunks:
        row["chunk_mode"] = {n: {"prefix_token_hit_rate": 0.3, "chunk_token_hit_rate": 0.15}
                             for n in ("belady", "infinite")}
    return row


def _result(with_chunks: bool) -> dict:
    return {"trace": "t", "shards": 2, "points": [_point(f, with_chunks) for f in (0.05, 0.1, 0.5)]}


def test_prefix_only_omits_the_chunk_columns_and_says_how_to_get_them():
    out = io.StringIO()
    rag.print_side_by_side({"prefix": _result(False)}, out)
    text = out.getvalue()
    assert rag.CHUNK_HOWTO in text and "--key-mode both" in text, text
    assert "chunk pool" not in text, text
    rows = [ln for ln in text.splitlines() if ln.strip().startswith(("5%", "10%", "50%"))]
    assert rows and all(ln.split()[-1] not in ("-",) for ln in rows), text
    assert "32.2%R" in text and "45.3%" in text, text


def test_both_modes_show_chunk_levels_beside_the_prefix():
    out = io.StringIO()
    rag.print_side_by_side({"prefix": _result(False), "chunk": _result(True)}, out)
    text = out.getvalue()
    assert rag.CHUNK_HOWTO not in text, text
    assert "prefix+chunk pool: prefix" in text and "10.4%R" in text and "15.0%" in text, text
    assert " - " not in text.replace("-only", ""), text


def test_headline_is_lru_measured_token_weighted_with_bounds():
    line = rag.headline({"prefix": _result(False)}, 0.1)
    assert line is not None
    assert "lru at 10% capacity" in line and "prefix hit 32.2%" in line, line
    assert "Belady 45.3%, infinite 45.3% (all token-weighted)" in line, line
    assert rag.headline({"prefix": _result(False)}, 0.25) is None  # no measured run at 25%


def test_real_rag_reference_is_computed_from_the_bundled_musique_trace():
    lines = rag.real_rag_reference()
    text = "\n".join(lines)
    assert "MuSiQue, 150 questions" in text and "0% follow-up turns" in text, text
    assert "prefix reuse at infinite capacity 1.3%" in text and "computed now" in text, text
    assert rag.REAL_RAG_COMMAND in text and "quoted" in text, text


def _report() -> dict:
    lat = {"p50_ms": 0.3, "p99_ms": 1.0}

    def run(pol: str, blk: float, tok: float) -> dict:
        lv = {k: {"block_hit_rate": blk, "token_hit_rate": tok} for k in ("exists", "loaded", "useful")}
        return {"policy": pol, "levels": lv, "latency": {"lookup": lat, "get": lat, "put": lat},
                "requests_per_s": 400.0, "bytes": {"get_bytes": 1, "put_bytes": 1}, "gap_closed": None}

    return {"trace": "t", "requests": 3, "total_blocks": 10, "unique_blocks": 8, "block_tokens": 256,
            "capacity_blocks": 1, "capacity_fraction": 0.1, "block_bytes": 4096,
            "belady": {"block_hit_rate": 0.436, "token_hit_rate": 0.453},
            "infinite": {"block_hit_rate": 0.436, "token_hit_rate": 0.453},
            "runs": [run("lru", 0.31, 0.322), run("s3fifo", 0.283, 0.295)]}


def test_token_weighting_is_one_weighting_in_header_and_table():
    out = io.StringIO()
    print_report(_report(), out, weighting="token")
    text = out.getvalue()
    assert "belady 45.3%, infinite 45.3% (prefix hits, token-weighted)" in text, text
    assert "43.6%" not in text and "31.0%" not in text and "blk / tok" not in text, text
    assert "32.2%" in text and "29.5%" in text, text
    # the gap over token rates: (29.5 - 32.2) / (45.3 - 32.2)
    assert "-21%" in text, text
    both = io.StringIO()
    print_report(_report(), both)
    assert "belady 43.6%, infinite 43.6% (block-level prefix hits)" in both.getvalue(), both.getvalue()
    with pytest.raises(ValueError):
        print_report(_report(), io.StringIO(), weighting="blocks")


def test_same_curves_names_the_policy_drawn_on_top():
    assert rag.same_curves({"lru": [1.0, 2.0], "tail-lru": [1.01, 2.0], "s3fifo": [1.0, 3.0]}) == {"tail-lru": "lru"}


def test_plot_fits_its_text_and_labels_every_policy(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    seen: dict = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *a, **kw):
        real_savefig(fig, *a, **kw)
        fig.canvas.draw()  # at the figure's own dpi, so every text has its final place in fig.bbox's pixels
        r = fig.canvas.get_renderer()
        box = fig.bbox
        texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text() and t.get_visible()]
        seen["outside"] = [t.get_text() for t in texts
                           if not (box.x0 - 1 <= t.get_window_extent(r).x0 and t.get_window_extent(r).x1 <= box.x1 + 1
                                   and box.y0 - 1 <= t.get_window_extent(r).y0
                                   and t.get_window_extent(r).y1 <= box.y1 + 1)]
        seen["labels"] = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    long_title = "kvfabric bench rag, 2 shard(s): " + "a long workload description " * 6
    for results in ({"prefix": _result(False)}, {"prefix": _result(False), "chunk": _result(True)}):
        png = tmp_path / "rag.png"
        rag.plot_modes(results, png, long_title)
        assert png.stat().st_size > 0
        assert seen["outside"] == [], seen["outside"]
        assert {"lru", "tail-lru (= lru within 0.05 points)", "s3fifo", "lru measured"} <= set(seen["labels"]), seen
