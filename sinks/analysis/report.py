"""`nodeshare report`: pictures of the ledger for analysts, in PNG files and one HTML page.

* prices.png: each job's price relative to its standard price, per program, under SOP (1.0 by
  definition), nodeshare's charge, and the oracle (Eq. 4 with the true degradation) when a
  ground-truth file is given (in the spirit of Seed 002, Fig. 12);
* pairs.png: mean measured degradation of a program next to each co-runner program (in the
  spirit of Fig. 11). A job's estimate covers all its co-runners, so it is attributed to each
  co-runner program in proportion to the shutters that had a job of that program paused beside it;
* dividend.png: the co-location dividend per account and day;
* confidence.png: filtered against unfiltered estimates, coloured by the share of blocks kept.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import duckdb
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
import pyarrow.parquet as pq

from nodeshare.schemas import Charge
from nodeshare.sinks.audit import current_revisions
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.core.pricing import fair_charge


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    pngs: tuple[Path, ...]


def co_runner_counts(archive_root: Path) -> dict[tuple[str, str], int]:
    """(job, co-runner job) -> how many shutter windows saw the first run alone while the second
    was paused, from the archived node.shutter events."""
    files = list((archive_root / "topic=node.shutter").glob("date=*/p*.parquet"))
    if not files:
        return {}
    glob = str(archive_root / "topic=node.shutter" / "date=*" / "p*.parquet").replace("'", "''")
    rows = duckdb.connect().execute(f"""
        SELECT lone, other, count(*) FROM (
            SELECT lone, unnest(from_json(paused, '["VARCHAR"]')) AS other
            FROM (SELECT json_extract_string(decode(value), '$.lone_job') AS lone,
                         json_extract(decode(value), '$.paused_jobs') AS paused
                  FROM read_parquet('{glob}')
                  QUALIFY row_number() OVER (PARTITION BY "partition", "offset") = 1)
            WHERE lone IS NOT NULL)
        GROUP BY lone, other
    """).fetchall()
    return {(lone, other): int(n) for lone, other, n in rows}


def pair_degradation(charges: list[Charge], counts: dict[tuple[str, str], int]) -> tuple[list[str], np.ndarray]:
    """Programs and the matrix M[a, b]: mean degradation of program a's jobs while they shared a
    node, weighted by how many of their shutters had a job of program b paused beside them (NaN
    where never co-located). The shared-time D is ``degradation_shared`` (schema 4); a charge before
    it has 0 there, and its D applied was that estimate: the larger of the two is the one (the
    point estimate where the charge has one: D applied may carry the short-sample margin)."""
    program = {c.job_id: c.program for c in charges}
    d = {c.job_id: max(c.degradation if c.degradation_point is None else c.degradation_point, c.degradation_shared)
         for c in charges if c.estimate_status.value == "ok"}
    programs = sorted(set(program.values()))
    index = {p: i for i, p in enumerate(programs)}
    weight = np.zeros((len(programs), len(programs)))
    total = np.zeros_like(weight)
    for (job, other), n in counts.items():
        if job in d and other in program:
            a, b = index[program[job]], index[program[other]]
            weight[a, b] += n
            total[a, b] += n * d[job]
    with np.errstate(invalid="ignore", divide="ignore"):
        return programs, np.where(weight > 0, total / weight, np.nan)


def build_report(ledger_path: Path, archive_root: Path | None, out_dir: Path,
                 truth_path: Path | None = None) -> ReportFiles:
    with Ledger(ledger_path, read_only=True) as ledger:
        charges = current_revisions(ledger.charges())
        counts = ledger.co_runner_counts()  # kept by the ledger sink from node.shutter
    if not charges:
        raise ValueError(f"the ledger {ledger_path} holds no charges")
    out_dir.mkdir(parents=True, exist_ok=True)
    truth = _truth(truth_path) if truth_path else {}
    pngs = [
        _prices(charges, truth, out_dir / "prices.png"),
        # a ledger written by another path than the sink (or before it counted): from the archive
        _pairs(charges, counts or (co_runner_counts(archive_root) if archive_root else {}), out_dir / "pairs.png"),
        _dividend(charges, out_dir / "dividend.png"),
        _confidence(charges, out_dir / "confidence.png"),
    ]
    page = out_dir / "index.html"
    page.write_text(_html(charges, truth, pngs))
    return ReportFiles(page, tuple(pngs))


def _truth(path: Path) -> dict[str, float]:
    table = pq.read_table(path, columns=["job_id", "true_degradation"]).to_pylist()
    return {r["job_id"]: r["true_degradation"] for r in table}


def oracle_price(c: Charge, true_degradation: float) -> float:
    """What the rate function would have charged had the estimate been the truth."""
    d = min(1.0, max(0.0, true_degradation))
    return fair_charge(c.rate_per_core_hour, c.units, c.run_time_s, d, c.rate_function, c.pause_credit_s).price


def _prices(charges: list[Charge], truth: dict[str, float], path: Path) -> Path:
    programs = sorted({c.program for c in charges})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(programs)), 4.5))
    series = [("charged (nodeshare)", "tab:blue", lambda c: c.price / c.standard_price)]
    if truth:
        series.append(("oracle (true D)", "tab:green", lambda c: oracle_price(c, truth[c.job_id]) / c.standard_price))
    width = 0.8 / len(series)
    for k, (label, color, ratio) in enumerate(series):
        data = [[ratio(c) for c in charges if c.program == p and c.standard_price > 0 and
                 (c.job_id in truth or not truth)] for p in programs]
        pos = np.arange(len(programs)) + (k - (len(series) - 1) / 2) * width
        parts = ax.boxplot(data, positions=pos, widths=width * 0.9, patch_artist=True, showfliers=True)
        for box in parts["boxes"]:
            box.set_facecolor(color)
            box.set_alpha(0.6)
        ax.plot([], [], color=color, linewidth=8, alpha=0.6, label=label)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="standard price (SOP)")
    ax.set_xticks(np.arange(len(programs)), programs)
    ax.set_ylabel("price / standard price")
    ax.set_title("Price relative to the standard price, per program")
    ax.legend(loc="lower left", fontsize=8)
    return _save(fig, path)


def _pairs(charges: list[Charge], counts: dict[tuple[str, str], int], path: Path) -> Path:
    programs, m = pair_degradation(charges, counts)
    fig, ax = plt.subplots(figsize=(1.2 * len(programs) + 3, 1.0 * len(programs) + 2))
    image = ax.imshow(np.ma.masked_invalid(m * 100), cmap="Reds", vmin=0)
    ax.set_xticks(range(len(programs)), programs, rotation=30, ha="right")
    ax.set_yticks(range(len(programs)), programs)
    ax.set_xlabel("co-runner program")
    ax.set_ylabel("program")
    top = np.nanmax(m) if np.isfinite(m).any() else 1.0
    for (i, j), v in np.ndenumerate(m):
        dark = not math.isnan(v) and v > 0.6 * top  # white text on the darkest cells
        ax.text(j, i, "-" if math.isnan(v) else f"{100 * v:.1f}", ha="center", va="center", fontsize=8,
                color="white" if dark else "black")
    fig.colorbar(image, ax=ax, label="mean measured degradation (%)")
    ax.set_title("Degradation by program pair")
    return _save(fig, path)


def _dividend(charges: list[Charge], path: Path) -> Path:
    span = max(c.end_time for c in charges) - min(c.end_time for c in charges)
    hourly = span.total_seconds() < 2 * 86400  # a short ledger: hours, else days
    stamp = "%Y-%m-%d %H:00" if hourly else "%Y-%m-%d"
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for c in charges:
        per[c.account][c.end_time.strftime(stamp)] += c.dividend
    days = sorted({d for v in per.values() for d in v})
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(days) + 3), 4))
    bottom = np.zeros(len(days))
    for account in sorted(per):
        values = np.array([per[account].get(d, 0.0) for d in days])
        ax.bar(days, values, bottom=bottom, label=account)
        bottom += values
    ax.set_ylabel("dividend (service units)")
    ax.set_title(f"Co-location dividend per account and {'hour' if hourly else 'day'}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _confidence(charges: list[Charge], path: Path) -> Path:
    measured = [c for c in charges if c.degradation_unfiltered is not None]
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    if measured:
        x = np.array([c.degradation_unfiltered for c in measured]) * 100
        y = np.array([c.degradation_filtered if c.degradation_filtered is not None else np.nan for c in measured]) * 100
        kept = np.array([c.blocks_used / max(1, c.blocks_used + c.blocks_rejected) for c in measured])
        points = ax.scatter(x, y, c=kept, cmap="viridis", vmin=0, vmax=1, edgecolors="black", linewidths=0.3)
        fig.colorbar(points, ax=ax, label="share of blocks kept by the filter")
        lo, hi = min(0.0, np.nanmin([x.min(), np.nanmin(y) if np.isfinite(y).any() else 0])), max(x.max(), 1.0)
        ax.plot([lo, hi], [lo, hi], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("unfiltered estimate (%)")
    ax.set_ylabel("filtered estimate, Alg. 4 (%)")
    ax.set_title("Estimator confidence")
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _html(charges: list[Charge], truth: dict[str, float], pngs: list[Path]) -> str:
    sop = math.fsum(c.standard_price for c in charges)
    price = math.fsum(c.price for c in charges)
    rows = [("jobs", f"{len(charges)}"), ("standard price (SU)", f"{sop:.4f}"), ("charged (SU)", f"{price:.4f}"),
            ("dividend (SU)", f"{math.fsum(c.dividend for c in charges):.4f}"),
            ("credited by operators' adjustments (SU)", f"{math.fsum(c.adjustment_credit for c in charges):.4f}"),
            ("mean discount", f"{100 * (1 - price / sop):.2f}%")]
    sure = [c for c in charges if c.degradation_point is not None]  # schema 6: an interval
    if sure:
        at_point = math.fsum(fair_charge(c.rate_per_core_hour, c.units, c.run_time_s, c.degradation_point,
                                         c.rate_function, c.pause_credit_s).price for c in sure)
        bound = [c for c in sure if c.priced_at == "upper_bound"]
        rows += [("priced at the interval's upper end", f"{len(bound)} of {len(sure)} jobs with an interval "
                  f"(confidence {', '.join(sorted({f'{c.confidence:.0%}' for c in sure}))})"),
                 ("charged at the point estimates (SU)", f"{at_point:.4f}"),
                 ("jobs priced with the short-sample margin (schema 10)",
                  f"{sum(c.short_margin_applied > 0 for c in sure)}"),
                 # the computed prices, operators' adjustments aside: the bound's and the short-sample margin's
                 ("given up for the confidence and the short-sample margin (SU)",
                  f"{at_point - math.fsum(c.price + c.adjustment_credit for c in sure):.4f}"),
                 ("jobs priced by the prior (too few blocks)", f"{sum(c.interval_method == 'prior' for c in sure)}")]
    # priced without a lost node's marker (``NodeDown``): the operator's list (``nodeshare charges --incomplete``)
    lost = sorted(c.job_id for c in charges if c.estimate_status.value == "node_lost")
    rows.append(("jobs charged with a node lost (node_lost)",
                 f"{len(lost)}" + (f": {', '.join(lost[:20])}{' ...' if len(lost) > 20 else ''}" if lost else "")))
    if truth:
        inside = [c for c in sure if c.job_id in truth]
        if inside:
            held = sum(c.degradation_low <= truth[c.job_id] <= c.degradation_high for c in inside)
            rows.append(("true degradation inside the interval", f"{held} of {len(inside)} jobs"))
        oracle = math.fsum(oracle_price(c, truth[c.job_id]) for c in charges if c.job_id in truth)
        rows.append(("oracle charge (SU)", f"{oracle:.4f}"))
        over = sum(c.price > oracle_price(c, truth[c.job_id]) + 1e-12 for c in charges if c.job_id in truth)
        rows.append(("jobs charged above the oracle", f"{over}"))
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    images = "".join(f'<figure><img src="{p.name}" alt="{p.stem}"><figcaption>{p.stem}</figcaption></figure>'
                     for p in pngs)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>nodeshare report</title>"
            "<style>body{font-family:sans-serif;margin:2em}th{text-align:left;padding-right:1em}"
            "img{max-width:100%}figure{margin:1.5em 0}</style></head><body>"
            f"<h1>nodeshare report</h1><table>{table}</table>{images}</body></html>\n")
