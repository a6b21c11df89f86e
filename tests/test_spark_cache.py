"""The worker's AppCDS archives in the user's cache (worker/spark.py): one per checkout and venv,
~160 MB each, so stale ones are removed when a new one is written."""

from __future__ import annotations

import os

from strata.worker.spark import KEEP_ARCHIVE_DAYS, KEEP_ARCHIVES, prune_archives

DAY = 86400.0


def _archive(d, name, days_ago, now):
    p = d / f"spark-{name}.jsa"
    p.write_bytes(b"x")
    t = now - days_ago * DAY
    os.utime(p, (t, t))
    return p


def test_stale_archives_beyond_the_most_recent_are_removed(tmp_path):
    now = 1_800_000_000.0
    new = _archive(tmp_path, "new", 0, now)
    recent = [_archive(tmp_path, f"r{k}", k + 1, now) for k in range(KEEP_ARCHIVES)]
    week = _archive(tmp_path, "week", KEEP_ARCHIVE_DAYS - 1, now)  # beyond the count, but used this week
    stale = [_archive(tmp_path, f"s{k}", KEEP_ARCHIVE_DAYS + 1 + k, now) for k in range(3)]
    other = tmp_path / "spark-x.lock"
    other.write_text("1")
    gone = prune_archives(tmp_path, keep=new, now=now)
    assert sorted(gone) == sorted(stale)
    assert all(p.exists() for p in [new, week, other, *recent])


def test_the_archive_just_written_is_kept_however_old(tmp_path):
    now = 1_800_000_000.0
    keep = _archive(tmp_path, "k", 100, now)
    olds = [_archive(tmp_path, f"o{k}", 50 + k, now) for k in range(KEEP_ARCHIVES + 2)]
    gone = prune_archives(tmp_path, keep=keep, now=now)
    assert keep.exists() and len(gone) == 2 and all(p in olds for p in gone)
    assert prune_archives(tmp_path / "missing", keep=keep, now=now) == []
