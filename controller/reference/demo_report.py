"""The demo's report: console tables (rich), PNG plots and a markdown summary in the run folder.

Conventions: **acceptance rate** = accepted drafts / drafted tokens over rows that speculated (k > 0); **mean
acceptance length** = emitted tokens per speculating row, bonus token included (as vLLM reports it); tokens/s is
emitted tokens over the phase's wall time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from telemetry.records import REQUEST_TYPES
from telemetry.wire import parse_bucket

if TYPE_CHECKING:
    from rich.console import Console

    from controller.reference.demo_log import RunLog
    from controller.reference.workload import Phase
    from controller.service.sidecar import Sidecar

BIN_S = 1.0  # plot resolution in seconds (the workload's own time)
MAX_EVENTS_SHOWN = 12
PLOT_SIZE = (9, 3.6)  # inches: wide enough for a run's phases to be read apart
PLOT_DPI = 110  # a readable PNG in summary.md without a large file


def throughput_rows(phases: Sequence[Phase], logs: Sequence[RunLog]) -> list[list[str]]:
    rows = []
    for i, p in enumerate(phases):
        rows.append([p.name, f"{p.load}", *(f"{log.tokens(i) / p.seconds:.0f}" for log in logs)])
    total = sum(p.seconds for p in phases)
    rows.append(["overall", "", *(f"{log.tokens() / total:.0f}" for log in logs)])
    return rows


def acceptance_rows(log: RunLog, update_version: str) -> list[list[str]]:
    """Per request type, before and after the model update (speculating rows of the learned run)."""
    out = []
    for rt in REQUEST_TYPES:
        cells = []
        for after in (False, True):
            sel = [r for r in log.rows
                   if r.request_type == rt and r.k > 0 and (r.target_version == update_version) == after]
            drafted = sum(r.k for r in sel)
            cells += [f"{sum(r.accepted for r in sel) / drafted:.2f}" if drafted else "-",
                      f"{sum(r.emitted for r in sel) / len(sel):.2f}" if sel else "-"]
        out.append([rt, *cells])
    return out


def speculation_events(log: RunLog, phases: Sequence[Phase]) -> list[str]:
    """When the learned table turned speculation off (k -> 0) or back on, per bucket (request types that
    switched together are listed together)."""
    ends, acc = [], 0.0
    for p in phases:
        acc += p.seconds
        ends.append(acc)
    state: dict[str, int] = {}
    events = []
    for pv in log.history:
        t = pv.at - log.started_at
        phase = next((phases[i].name for i, e in enumerate(ends) if t <= e), "after the run: last windows")
        grouped: dict[tuple[str, int, str, int, int], list[str]] = {}
        for key, k in sorted(pv.table.entries.items()):
            if "*" in key:
                continue
            old = state.get(key)
            state[key] = k
            if old is None or (old == 0) == (k == 0):
                continue
            b = parse_bucket(key)
            grouped.setdefault((b.target_version, b.batch_bucket, b.context_bucket, old, k), []).append(b.request_type)
        for (tv, bb, cb, old, k), types in grouped.items():
            what = "OFF" if k == 0 else f"ON (k={k})"
            events.append(f"t={t:5.1f}s ({phase}) v{pv.table.version}: speculation {what} for {tv} "
                          f"{'/'.join(types)}, batch<={bb}, context {cb} (was k={old})")
    return events


def alert_rows(sidecar: Sidecar, started_at: float) -> list[list[str]]:
    """The alerts the learned run's sidecar raised: time into the workload (detection), kind, bucket, versions."""
    rows = []
    for a in sidecar.recent_alerts:
        versions = f"{a.target_version} / {a.draft_version}"
        if a.previous_target_version is not None:
            versions = f"{a.previous_target_version} / {a.previous_draft_version} -> {versions}"
        rows.append([f"{a.detected_at - started_at:.1f}s", a.kind, a.bucket + ("" if a.k is None else f" k={a.k}"),
                     versions])
    return rows


ALERT_COLOURS = {"model_update": "crimson", "acceptance_drift": "darkorange", "cost_drift": "purple"}


def alert_marks(sidecar: Sidecar, started_at: float) -> list[tuple[float, str, str]]:
    """(seconds into the workload, kind, short label) of each alert, for the throughput timeline."""
    out = []
    for a in sidecar.recent_alerts:
        if a.kind == "model_update":
            label = f"model_update -> {a.target_version}"
        else:
            parts = a.bucket.split("|")
            where = parts[2] if a.kind == "acceptance_drift" else "batch<=" + parts[3]
            label = f"{a.kind}: {where} {'any k' if a.k is None else f'k={a.k}'}"
        out.append((a.detected_at - started_at, a.kind, label))
    return out


def k_table(sidecar: Sidecar) -> tuple[list[str], list[list[str]]]:
    """The final learned table as (version, type, context) rows x batch-bucket columns."""
    cur = sidecar.current
    if cur is None:
        return [], []
    cells: dict[tuple[str, str, str], dict[int, int]] = {}
    batches: set[int] = set()
    for key, k in cur.entries.items():
        if "*" in key:
            continue
        b = parse_bucket(key)
        cells.setdefault((b.target_version, b.request_type, b.context_bucket), {})[b.batch_bucket] = k
        batches.add(b.batch_bucket)
    cols = sorted(batches)
    header = ["target", "request type", "context", *(f"b<={c}" for c in cols)]
    rows = [[t, rt, cb, *(str(ks.get(c, "")) for c in cols)] for (t, rt, cb), ks in sorted(cells.items())]
    return header, rows


def _plots(run_dir: Path, phases: Sequence[Phase], logs: Sequence[RunLog], update_at: float | None,
           static_k: int, alerts: Sequence[tuple[float, str, str]] = ()) -> list[str]:
    """The three PNGs; ``alerts`` (seconds into the workload, kind, label) are marked on the throughput timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    total = sum(p.seconds for p in phases)
    step = max(0.25, min(BIN_S, total / 40))
    edges = np.arange(0.0, total + step, step)
    mids = (edges[:-1] + edges[1:]) / 2

    def shade(ax: Any) -> None:
        t = 0.0
        for i, p in enumerate(phases):
            if i % 2:
                ax.axvspan(t, t + p.seconds, color="0.93", zorder=0)
            ax.text(t + 0.01 * total, 0.98, p.name, transform=ax.get_xaxis_transform(), fontsize=7, va="top")
            t += p.seconds
        ax.set_xlim(0, total)
        if update_at is not None:
            ax.axvline(update_at, color="crimson", ls="--", lw=1)

    def binned(ts: list[float], vals: list[float], weights: list[float] | None = None) -> np.ndarray:
        ts_a = np.asarray(ts)
        keep = ts_a < edges[-1]  # a round that overran the workload's end is not squeezed into the last bin
        idx = np.digitize(ts_a[keep], edges) - 1
        num = np.bincount(idx, weights=np.asarray(vals, float)[keep], minlength=len(mids))[: len(mids)]
        if weights is None:
            return num
        den = np.bincount(idx, weights=np.asarray(weights, float)[keep], minlength=len(mids))[: len(mids)]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.maximum(den, 1e-12), np.nan)

    files: list[str] = []

    def save(fig: Any, ax: Any, name: str, **labels: Any) -> None:
        """Shade the phases, label the axes, and write the figure into ``run_dir`` as ``name``."""
        shade(ax)
        ax.set(xlabel="seconds into the workload", **labels)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=PLOT_DPI)
        plt.close(fig)
        files.append(name)

    fig, ax = plt.subplots(figsize=PLOT_SIZE)
    for log in logs:
        if log.rounds:
            ax.plot(mids, binned([r.t for r in log.rounds], [r.emitted for r in log.rounds]) / step,
                    label=log.name)
    for i, (t, kind, label) in enumerate(alerts):  # the learned run's alerts, where its sidecar raised them
        if 0 <= t <= total:
            colour = ALERT_COLOURS.get(kind, "0.3")
            ax.axvline(t, color=colour, ls=":", lw=1.2)
            ax.text(t, 0.90 - 0.08 * (i % 4), " " + label, transform=ax.get_xaxis_transform(), fontsize=7,
                    color=colour, va="top")
    save(fig, ax, "throughput.png", ylabel="tokens / s", title="Throughput, same workload per run")

    learned = logs[0]
    fig, ax = plt.subplots(figsize=PLOT_SIZE)
    for rt in REQUEST_TYPES:
        sel = [r for r in learned.rows if r.request_type == rt and r.k > 0]
        if sel:
            ax.plot(mids, binned([r.t for r in sel], [r.accepted for r in sel], [r.k for r in sel]), ".-", ms=4,
                    label=rt)
    save(fig, ax, "acceptance.png", ylabel="accepted / drafted", ylim=(0, 1),
         title="Acceptance rate per request type (learned run; dashed line: model update)")

    fig, ax = plt.subplots(figsize=PLOT_SIZE)
    for rt in REQUEST_TYPES:
        sel = [r for r in learned.rows if r.request_type == rt]
        if sel:
            ax.plot(mids, binned([r.t for r in sel], [r.k for r in sel], [1.0] * len(sel)), ".-", ms=4, label=rt)
    ax.axhline(static_k, color="0.5", ls=":", label=f"static k={static_k}")
    save(fig, ax, "chosen_k.png", ylabel="mean k per row (0 = off)", title="k chosen by the learned policy")
    return files


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_report(run_dir: Path, static_k: int, phases: Sequence[Phase], logs: Sequence[RunLog],
                 sidecar: Sidecar, best: dict[tuple[str, int, str], tuple[int, float]], console: Console,
                 update_version: str, ratios: dict[str, float] | None = None) -> None:
    """Print the summary tables and write ``summary.md`` and the PNG plots into ``run_dir``.

    ``logs[0]`` is the learned run; the others are baselines, shown side by side. ``ratios`` (name -> learned
    over that baseline) head the summary.
    """
    from rich.table import Table

    update_i = next((i for i, p in enumerate(phases) if p.update), None)
    update_at = sum(p.seconds for p in phases[:update_i]) if update_i is not None else None
    drift_i = next((i for i, p in enumerate(phases) if p.structured_schema != 1 and not p.update), None)
    drift_at = sum(p.seconds for p in phases[:drift_i]) if drift_i is not None else None
    v2 = update_version

    thr_header = ["phase", "load", *(log.name for log in logs)]
    thr = throughput_rows(phases, logs)
    acc_header = ["request type", "acc. rate before", "mean acc. len before", "acc. rate after", "mean acc. len after"]
    acc = acceptance_rows(logs[0], v2)
    k_header, k_rows = k_table(sidecar)
    events = speculation_events(logs[0], phases)
    best_rows = [[t, str(b), c, str(k), f"{g:.0f}"] for (t, b, c), (k, g) in sorted(best.items())]
    alerts = alert_rows(sidecar, logs[0].started_at)
    h = sidecar.health()

    for title, header, rows in (
        ("Tokens per second by phase (higher is better)", thr_header, thr),
        (f"Acceptance per request type, before/after the model update ({v2})", acc_header, acc),
        (f"k chosen per bucket (final learned table v{sidecar.version})", k_header, k_rows),
    ):
        t = Table(title=title)
        for c in header:
            t.add_column(c)
        for r in rows:
            t.add_row(*r)
        console.print(t)
    if events:
        console.print("[bold]Speculation turned off / on by the learned policy[/]")
        for e in events[:MAX_EVENTS_SHOWN]:
            console.print("  " + e, markup=False, overflow="ignore", crop=False)
        if len(events) > MAX_EVENTS_SHOWN:
            console.print(f"  ... {len(events) - MAX_EVENTS_SHOWN} more in summary.md")
    else:
        console.print("The learned policy never switched speculation off for a bucket in this run.")
    console.print(f"Alerts raised in the learned run: {len(alerts)}"
                  + "".join(f"\n  t={t} {kind} {bucket} ({v})" for t, kind, bucket, v in alerts[:MAX_EVENTS_SHOWN]),
                  markup=False, overflow="ignore", crop=False)
    console.print(f"Sidecar: {h['windows_ingested']} window batches, {sidecar.version} policy versions, "
                  f"{sum(h['rejected'].values())} rejected records.")

    files = _plots(run_dir, phases, logs, update_at, static_k, alert_marks(sidecar, logs[0].started_at))
    md = [
        "# spectune demo",
        "",
        "The reference engine decoded the same mixed workload with k learned live by the sidecar (goodput "
        f"policy, starting from nothing), with a static k={static_k} (played just before and just after the learned "
        "run; its figure is the mean of the two, so a drift of the machine's speed across the runs cancels) and "
        "other static ks (the best of them is the "
        "best static k in hindsight), and with the best k per (model version, batch bucket, context bucket) "
        "measured in those runs (hindsight). Load rose to a large batch and fell, long-context requests arrived, "
        "and the target model was updated "
        f"{'at t=' + format(update_at, '.0f') + 's' if update_at is not None else 'never'}"
        + (f"; at t={drift_at:.0f}s structured prompts switched to a second JSON schema with no version change "
           "(a silent drift, for the sidecar to notice from acceptance alone)" if drift_at is not None else "")
        + ". Alerts are marked on the throughput timeline (dotted lines).",
        "",
        *(f"- {name}: **{r:.3f}**" for name, r in (ratios or {}).items()),
        "",
        f"Phases: {', '.join(f'{p.name} ({p.seconds:.0f}s, load {p.load})' for p in phases)}.",
        "",
        "## Tokens per second", "", _md_table(thr_header, thr), "", "![throughput](throughput.png)", "",
        "## Acceptance per request type, before and after the model update", "",
        "Acceptance rate = accepted / drafted; mean acceptance length = emitted tokens per speculating row "
        "(bonus token included, as vLLM reports it).", "", _md_table(acc_header, acc), "",
        "![acceptance](acceptance.png)", "",
        "## k chosen per bucket", "", _md_table(k_header, k_rows) if k_rows else "(no table published)", "",
        "![chosen k](chosen_k.png)", "",
        "## Speculation turned off / on", "", *(f"- {e}" for e in events), "" if events else "- never", "",
        "## Alerts", "",
        "Raised by the learned run's sidecar (time of detection, seconds into the workload).", "",
        _md_table(["t", "kind", "bucket", "versions"], alerts) if alerts else "(none)", "",
        "## Best k per cell found in the runs before it (the hindsight table)", "",
        _md_table(["target", "batch bucket", "context", "k", "tok/s"], best_rows), "",
        "## Policy versions", "",
        *(f"- v{pv.table.version} at t={pv.at - logs[0].started_at:.1f}s: {pv.table.reason}" for pv in logs[0].history),
        "",
        f"Sidecar: {h['windows_ingested']} window batches ingested, {h['windows_observed']} windows observed, "
        f"rejected {h['rejected'] or 'none'}.",
    ]
    (run_dir / "summary.md").write_text("\n".join(md) + "\n")
    console.print(f"plots: {', '.join(files)}")
