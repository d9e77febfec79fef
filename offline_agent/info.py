"""What is in a dataset, before training anything: counts, outcomes, returns, tools and their error rates."""

from __future__ import annotations

from typing import Any

from offline_agent.dataset import TrajectoryDataset


def dataset_summary(ds: TrajectoryDataset, top_tools: int = 10) -> dict[str, Any]:
    """One dict (JSON-ready) computed with DuckDB over the dataset's views."""
    con = ds.duckdb()
    try:
        episodes, with_outcome, successes, mean_steps = con.execute(
            "SELECT count(*), count(success), count(*) FILTER (WHERE success), avg(n_steps) FROM episodes"
        ).fetchone()
        steps, errors = con.execute("SELECT count(*), count(*) FILTER (WHERE is_error) FROM steps").fetchone()
        q = con.execute(
            'SELECT min("return"), quantile_cont("return", [0.1, 0.25, 0.5, 0.75, 0.9]), max("return"), '
            'avg("return") FROM episodes'
        ).fetchone()
        tools = con.execute(
            """SELECT tool_name, count(*) AS calls, avg(is_error::DOUBLE) AS error_rate
               FROM steps WHERE tool_name IS NOT NULL GROUP BY 1 ORDER BY calls DESC, tool_name LIMIT ?""",
            [top_tools],
        ).fetchall()
        kinds = dict(con.execute("SELECT action_kind, count(*) FROM steps GROUP BY 1 ORDER BY 1").fetchall())
        splits = dict(con.execute("SELECT split, count(*) FROM episodes GROUP BY 1 ORDER BY 1").fetchall())
        quarantined = con.execute("SELECT count(*) FROM quarantine").fetchone()[0]
    finally:
        con.close()
    quantiles = q[1] or [None] * 5
    return {
        "dataset": str(ds.path),
        "name": ds.name,
        "fingerprint": ds.meta.get("fingerprint"),
        "episodes": episodes,
        "steps": steps,
        "mean_steps": mean_steps,
        "success_rate": successes / with_outcome if with_outcome else None,
        "episodes_with_outcome": with_outcome,
        "return": {
            "min": q[0],
            "p10": quantiles[0],
            "p25": quantiles[1],
            "median": quantiles[2],
            "p75": quantiles[3],
            "p90": quantiles[4],
            "max": q[2],
            "mean": q[3],
        },
        "error_rate": errors / steps if steps else None,
        "action_kinds": kinds,
        "splits": splits,
        "top_tools": [{"tool": t, "calls": c, "error_rate": e} for t, c, e in tools],
        "quarantined": quarantined,
        "reward": ds.meta.get("reward"),
        "gamma": ds.gamma,
        "sources": [s["path"] for s in ds.meta.get("sources", [])],
    }
