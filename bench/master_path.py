"""The master's data path in one process, MLS vs vanilla: where the MLS work is, without noise.

End to end, MLS and vanilla differ only on the master (the shepherd's level filter and the
chunker's per-window level sets; the engine's SQL differs only in the CASE that names an
output row's level), and that difference is far below the run-to-run noise of a cluster on
a shared VM.  This measures it directly: the same batches go through
``QueryPipeline.ingest`` (shepherd, chunker), ``advance`` (cutting chunks with their legacy)
and the wire step (``prune_chunk`` + ``encode_chunk``), alternating MLS and vanilla, with
process CPU time per tuple as the figure.
"""

from __future__ import annotations

import statistics
import time

from strata.chunking.codec import encode_chunk
from strata.chunking.prune import prune_chunk
from strata.config import parse_config
from strata.master.pipeline import QueryPipeline

from bench import workloads as W
from bench.e2e import _instant_slices

STEPS = ("ingest", "advance", "wire")


def run_once(cfg, level: str, queries: list[str], data: dict, chunk_instants: int) -> dict:
    """CPU seconds of each step over all of ``data``, one ``ingest`` per stream and instant."""
    p = QueryPipeline(cfg, level, chunk_instants=chunk_instants)
    for q in queries:
        p.add_query(q)
    all_ts, bounds = _instant_slices(data)
    spent = dict.fromkeys(STEPS, 0.0)
    nbytes = 0
    for i in range(len(all_ts)):
        t0 = time.process_time()
        for s, t in data.items():
            a, b = int(bounds[s][i]), int(bounds[s][i + 1])
            if b > a:
                p.ingest(s, t.slice(a, b - a))
        t1 = time.process_time()
        chunks = p.advance(int(all_ts[i]))
        t2 = time.process_time()
        for c in chunks:
            nbytes += len(encode_chunk(prune_chunk(c, p.queries)))
        t3 = time.process_time()
        spent["ingest"] += t1 - t0
        spent["advance"] += t2 - t1
        spent["wire"] += t3 - t2
    spent["total"] = sum(spent[k] for k in STEPS)
    spent["bytes"] = nbytes
    return spent


def compare(w: W.Workload, reps: int = 7, discard: int = 1, chunk_instants: int = 4) -> dict:
    """Alternate MLS and vanilla ``reps`` times; medians (after ``discard``) in ns per tuple."""
    cm, cv = parse_config(w.config), parse_config(w.vanilla_config)
    qm = [w.query] if isinstance(w.query, str) else list(w.query)
    qv = [w.vanilla_query] if isinstance(w.vanilla_query, str) else list(w.vanilla_query)
    got: dict[str, list[dict]] = {"mls": [], "van": []}
    for rep in range(reps):
        for kind in ("mls", "van") if rep % 2 == 0 else ("van", "mls"):
            if kind == "mls":
                r = run_once(cm, w.level, qm, w.data, chunk_instants)
            else:
                r = run_once(cv, w.vanilla_level, qv, w.vanilla_data, chunk_instants)
            if rep >= discard:
                got[kind].append(r)
    n = w.tuples
    out = {"workload": w.name, "tuples": n, "reps": reps - discard, "chunk_instants": chunk_instants}
    for k in (*STEPS, "total"):
        m = statistics.median(r[k] for r in got["mls"]) / n * 1e9
        v = statistics.median(r[k] for r in got["van"]) / n * 1e9
        out[k] = {"mls_ns": round(m, 1), "van_ns": round(v, 1)}
    out["bytes"] = {"mls": got["mls"][0]["bytes"], "van": got["van"][0]["bytes"]}
    return out
