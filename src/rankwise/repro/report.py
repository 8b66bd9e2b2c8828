"""The reproduction report: one static HTML page (plus ``summary.json``) over every paper.

:func:`run_report` runs every reproduction that exists (papers, then references) through the
cached harness, catching the failure of any one of them, and calls :func:`build_report`, which
writes ``out_dir/index.html`` with one row per paper of :data:`~rankwise.core.registry.PAPERS` and
per reference, a section per reproduction (claim, claim checks, verdict, table over seeds,
figures, wall time, notes, configuration, environment), and ``out_dir/summary.json``. Figures and
``result.json`` files are copied to ``out_dir/<id>/``. The page is self-contained: inline CSS, no
script, no external resource; every text is escaped.
"""

from __future__ import annotations

import html
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rankwise import __version__
from rankwise.core import registry
from rankwise.repro import harness
from rankwise.repro.result import BUDGET_S, ReproResult, _clean, atomic_write_text

log = logging.getLogger(__name__)

OUTCOMES = ("holds", "does not hold", "inconclusive", "wiring only", "error", "not run", "no reproduction")


@dataclass
class ReportRun:
    """What :func:`run_report` produced: the page, the summary and the per-id results."""

    index: Path
    summary: dict[str, Any]
    results: dict[str, ReproResult | BaseException | None] = field(default_factory=dict)

    @property
    def errors(self) -> dict[str, BaseException]:
        return {k: v for k, v in self.results.items() if isinstance(v, BaseException)}


# --------------------------------------------------------------------------------------------------
# Running


def run_report(
    mode: str = "quick",
    only: Sequence[str] | None = None,
    out_dir: Path | str = "report",
    seeds: Sequence[int] | None = None,
    use_cache: bool = True,
    progress: bool = False,
    on_done: Callable[[str, ReproResult | BaseException, float], None] | None = None,
    jobs: int = 1,
) -> ReportRun:
    """Run the reproductions (all that exist, or ``only`` these ids) and build the report.

    Ids in ``only`` are validated before anything runs (unknown id or no reproduction: error), and
    so is ``out_dir``. A reproduction that raises becomes an "error" row; the others still run.
    Each reproduction writes into ``out_dir/<id>/``. ``on_done(id, result_or_error, seconds)`` is
    called as each one finishes (seconds of wall time in this run, near 0 for a cached result).

    ``jobs > 1`` runs that many reproductions at once, each in its own process with
    ``max(1, cpus // jobs)`` torch threads (see :func:`_worker_init`); the results and the page are the
    same as one at a time. Models that a reproduction builds on first use are best built before
    (``rankwise zoo build``): two processes needing the same missing artefact would both build it. The
    workers are spawned, so a script calling this with ``jobs > 1`` needs the ``if __name__ == "__main__":``
    guard.
    """
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    mode = harness.validate_mode(mode)
    seed_list = harness.resolve_seeds(mode, seeds) if seeds is not None else None
    if only:
        ids = list(dict.fromkeys(registry.normalize_id(i) for i in only))
        missing = [i for i in ids if not registry.has_reproduction(i)]
        if missing:
            have = ", ".join(harness.available()) or "none yet"
            raise harness.ReproductionUnavailable(
                f"no reproduction yet for {', '.join(map(repr, missing))}; available: {have}")
    else:
        ids = harness.available()
    out = harness.ensure_writable(out_dir)

    results: dict[str, ReproResult | BaseException | None] = {}
    bar = task = None
    if progress and ids:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        bar.start()
        task = bar.add_task("report", total=len(ids))
    def finished(id: str, value: ReproResult | BaseException, seconds: float) -> None:
        results[id] = value
        if on_done is not None:
            on_done(id, value, seconds)
        if bar is not None:
            bar.advance(task)

    try:
        if jobs == 1 or len(ids) < 2:
            for id in ids:
                if bar is not None:
                    bar.update(task, description=f"{id} ({mode})")
                t0 = time.perf_counter()
                finished(id, _reproduce_one(id, mode, seed_list, out / id, use_cache), time.perf_counter() - t0)
        else:
            _run_parallel(ids, jobs, mode, seed_list, out, use_cache, finished,
                          (lambda text: bar.update(task, description=text)) if bar is not None else None)
    finally:
        if bar is not None:
            bar.stop()
    results = {id: results[id] for id in ids if id in results}  # the page's order, not the finishing order
    index = build_report(results, out, mode=mode)
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    return ReportRun(index=index, summary=summary, results=results)


def _reproduce_one(id: str, mode: str, seeds: Sequence[int] | None, out: Path,
                   use_cache: bool) -> ReproResult | BaseException:
    try:
        return harness.reproduce(id, mode=mode, seeds=seeds, out_dir=out, use_cache=use_cache)
    except Exception as e:  # one broken reproduction must not sink the report
        log.warning("reproduction %s failed: %s: %s", id, type(e).__name__, e)
        return e


def _worker_init(threads: int) -> None:
    """Each worker process of ``jobs > 1`` gets its share of the cores (torch's pool would take them all)."""
    import torch

    torch.set_num_threads(threads)


def _portable(value: ReproResult | BaseException) -> ReproResult | BaseException:
    """What a worker sends back: the result, or its exception if that pickles, else a RuntimeError with its text."""
    import pickle

    if isinstance(value, BaseException):
        try:
            pickle.dumps(value)
        except Exception:
            return RuntimeError(f"{type(value).__name__}: {value}")
    return value


def _worker_run(id: str, mode: str, seeds: Sequence[int] | None, out: Path, use_cache: bool
                ) -> tuple[ReproResult | BaseException, float]:
    t0 = time.perf_counter()
    value = _reproduce_one(id, mode, seeds, out, use_cache)
    return _portable(value), time.perf_counter() - t0


def _run_parallel(ids: Sequence[str], jobs: int, mode: str, seeds: Sequence[int] | None, out: Path, use_cache: bool,
                  finished: Callable[[str, ReproResult | BaseException, float], None],
                  describe: Callable[[str], None] | None) -> None:
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    workers = min(jobs, len(ids))
    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn: a fresh interpreter per worker (forking a process that holds torch's thread pool is unsafe)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_init, initargs=(threads,)) as pool:
        futures = {pool.submit(_worker_run, id, mode, seeds, out / id, use_cache): id for id in ids}
        if describe is not None:
            describe(f"{len(ids)} reproductions ({mode}), {workers} at a time")
        for fut in as_completed(futures):
            id = futures[fut]
            try:
                value, seconds = fut.result()
            except Exception as e:  # the worker itself died (killed, out of memory)
                log.warning("reproduction %s: its worker failed: %s: %s", id, type(e).__name__, e)
                value, seconds = RuntimeError(f"worker failed: {type(e).__name__}: {e}"), 0.0
            if isinstance(value, ReproResult):
                value.source_dir = out / id
            finished(id, value, seconds)


# --------------------------------------------------------------------------------------------------
# Building


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}g}"


def _signed(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:+.3g}"


def _status(id: str) -> str:
    try:
        return registry.status(id)
    except Exception as e:  # a broken method module elsewhere: say so rather than crash the report
        log.warning("cannot compute the status of %s: %s", id, e)
        return "unknown"


def _outcome(id: str, value: object) -> str:
    if isinstance(value, ReproResult):
        return value.verdict
    if isinstance(value, BaseException):
        return "error"
    return "not run" if registry.has_reproduction(id) else "no reproduction"


def _error_text(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _check_summary(c: Any) -> dict[str, Any]:
    """What summary.json says of one check: statement, kind, status, measured, threshold, interval."""
    d = c.to_json()
    keys = ("statement", "kind", "status", "measured", "op", "threshold", "margin", "ci", "ci_level", "to_decide")
    return {k: d[k] for k in keys if k in d}


def _copy_artifacts(id: str, result: ReproResult, out: Path) -> list[str]:
    """Copy figures and result.json to ``out/<id>/``; return the figures that could not be found."""
    dest = out / id
    dest.mkdir(parents=True, exist_ok=True)
    missing = []
    for name in result.figures:
        src = result.source_dir / name if result.source_dir is not None else None
        if src is None or not src.is_file():
            if not (dest / name).is_file():
                missing.append(name)
            continue
        harness._copy_atomic(src, dest / name)
    atomic_write_text(dest / "result.json", json.dumps(result.to_json(), indent=2, allow_nan=False))
    return missing


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;
 padding:0 1rem;color:#1d1d1f;line-height:1.45}
h1{margin-bottom:.2rem} h2{margin-top:2.5rem;border-bottom:1px solid #ddd;padding-bottom:.3rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.92rem}
th,td{border:1px solid #ddd;padding:.3rem .55rem;text-align:left;vertical-align:top}
th{background:#f5f5f7} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.badge{display:inline-block;padding:.08rem .5rem;border-radius:.8rem;font-size:.8rem;font-weight:600;
 white-space:nowrap}
.holds{background:#d4f5dc;color:#0a5c22} .does-not-hold{background:#fde2d6;color:#8a2c06}
.inconclusive{background:#fff3c4;color:#6b5200} .wiring-only{background:#e0f0ff;color:#1a3f7a}
.error{background:#f8d0d0;color:#8a0000} .not-run,.no-reproduction,.unknown{background:#eee;color:#555}
.planned{background:#eee;color:#555} .implemented{background:#e3ecfb;color:#1a3f7a}
.reproduced{background:#dff3f3;color:#0c5656} .warn{color:#8a2c06}
.muted{color:#666;font-size:.9rem} pre{background:#f7f7f9;padding:.6rem;overflow-x:auto;font-size:.82rem;
 white-space:pre-wrap} .notes{white-space:pre-wrap}
figure{display:inline-block;margin:.5rem 1rem .5rem 0} figure img{max-width:560px;border:1px solid #eee}
section.paper{margin-bottom:2rem}
"""


def _badge(text: str) -> str:
    cls = text.replace(" ", "-")
    return f'<span class="badge {_esc(cls)}">{_esc(text)}</span>'


def _kv_table(d: Mapping[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _result_section(id: str, result: ReproResult, missing: list[str]) -> str:
    parts = [f"<p><b>Claim.</b> {_esc(result.claim)}</p>"]
    verdict = _badge(result.verdict).replace(f">{_esc(result.verdict)}<", f">{_esc(result.verdict_text)}<")
    parts.append(f"<p><b>Verdict:</b> {verdict} "
                 f"<span class='muted'>smallest margin {_esc(_signed(result.margin))}</span></p>")
    if result.reason and result.verdict != "holds":
        parts.append(f"<p><b>Why:</b> {_esc(result.reason)}</p>")
    if result.overrides:
        parts.append(f"<p><b>Settings changed:</b> "
                     f"{_esc(', '.join(f'{k}={v}' for k, v in result.overrides.items()))}</p>")
    if result.preconditions:
        rows = [f"<tr><td>{_esc(p.statement)}</td><td class='num'>{_esc(_num(p.measured))}"
                f"{_esc(' ' + p.unit if p.unit else '')}</td><td class='num'>{_esc(p.op)} {_esc(_num(p.threshold))}"
                f"</td><td>{_badge('holds' if p.holds else 'inconclusive').replace('>inconclusive<', '>failed<')}"
                f"</td></tr>" for p in result.preconditions]
        parts.append("<table><tr><th>Precondition</th><th>Measured</th><th>Needs</th><th>Met</th></tr>"
                     + "".join(rows) + "</table>")
    rows = []
    for c in result.checks:
        u = f" {c.unit}" if c.unit else ""
        ci = (f"[{_num(c.ci[0])}, {_num(c.ci[1])}]" if c.ci is not None else "–")
        need = c.to_decide
        if need is not None:
            ci += f" (about {need[0]} {need[1]} would decide it)" if need[0] is not None else " (on the threshold)"
        rows.append(
            f"<tr><td>{_esc(c.statement)}</td><td>{_esc(c.kind)}</td>"
            f"<td class='num'>{_esc(_num(c.measured))}{_esc(u)}</td>"
            f"<td class='num'>{_esc(c.op)} {_esc(_num(c.threshold))}{_esc(u)}</td>"
            f"<td class='num'>{_esc(_signed(c.margin))}</td><td class='num'>{_esc(ci)}</td>"
            f"<td>{_badge(c.status)}</td><td>{_esc(c.note)}</td></tr>")
    parts.append("<table><tr><th>Check</th><th>Kind</th><th>Measured</th><th>Threshold</th><th>Margin</th>"
                 "<th>95% interval</th><th>Status</th><th>Note</th></tr>" + "".join(rows) + "</table>")

    t = result.table
    head = "".join(
        f"<th>{_esc(c)}" + (f"<br><span class='muted'>{_esc(t.notes[c])}</span>" if c in t.notes else "")
        + "</th>" for c in t.columns)
    body = "".join(
        f"<tr><th>{_esc(r)}</th>" + "".join(f"<td class='num'>{_esc(t.cell(r, c))}</td>" for c in t.columns)
        + "</tr>" for r in t.rows)
    n = len(result.seeds)
    parts.append(f"<p class='muted'>Mean ± standard deviation over {n} seed{'s' if n != 1 else ''} "
                 f"({_esc(', '.join(map(str, result.seeds)))}).</p>")
    parts.append(f"<table><tr><th></th>{head}</tr>{body}</table>")

    for name in result.figures:
        if name in missing:
            parts.append(f"<p class='warn'>figure {_esc(name)} is missing</p>")
        else:
            src = f"{id}/{name}"
            parts.append(f"<figure><img src='{_esc(src)}' alt='{_esc(id)}: {_esc(name)}'>"
                         f"<figcaption class='muted'>{_esc(name)}</figcaption></figure>")

    budget = BUDGET_S.get(result.mode)
    over = (f" <span class='warn'>(over the {budget:g} s budget of {_esc(result.mode)} mode)</span>"
            if budget is not None and result.wall_time_s > budget else "")
    cached = " <span class='muted'>(from the cache)</span>" if result.cache_hit else ""
    env = result.environment or {}
    load = env.get("loadavg_start")
    machine = (f" · CPU time {result.cpu_time_s:.1f} s" if result.cpu_time_s else "") + (
        f" · {env['threads']} torch thread(s)" if "threads" in env else "") + (
        f" on {env['cpus']} CPUs at load average {load[0]:.2f}" if load and "cpus" in env else "")
    parts.append(f"<p><b>Wall time:</b> {result.wall_time_s:.1f} s{over}{cached}{_esc(machine)} · <b>mode:</b> "
                 f"{_esc(result.mode)} · <a href='{_esc(id)}/result.json'>result.json</a></p>")
    if result.notes:
        parts.append(f"<p><b>Notes.</b></p><div class='notes'>{_esc(result.notes)}</div>")
    if result.config:
        cfg = json.dumps(result.config, indent=2, sort_keys=True, default=str)
        parts.append(f"<details><summary>Configuration</summary><pre>{_esc(cfg)}</pre></details>")
    if result.environment:
        parts.append(f"<details><summary>Environment</summary>{_kv_table(result.environment)}</details>")
    return "\n".join(parts)


#: what summary.json keeps of a result's environment: enough to tell whether its times came from an idle machine
_RUN_FACTS = ("threads", "cpus", "loadavg_start", "loadavg", "time", "torch", "transformers")


def build_report(
    results: Mapping[str, ReproResult | BaseException | None],
    out_dir: Path | str,
    *,
    mode: str | None = None,
) -> Path:
    """Write ``out_dir/index.html`` and ``out_dir/summary.json``; return the path of the page.

    ``results`` maps ids to a :class:`ReproResult` (its figures are copied from
    ``result.source_dir`` into ``out_dir/<id>/``), an exception (shown as an "error" row with its
    message) or ``None``; ids absent from it are shown as "not run" (a reproduction exists) or
    "no reproduction". Every paper and reference gets a row.
    """
    out = harness.ensure_writable(out_dir)
    unknown = [k for k in results if k not in registry.PAPERS and k not in registry.REFERENCES]
    if unknown:
        raise ValueError(f"results for unknown ids: {unknown}")

    ids = list(registry.PAPERS) + list(registry.REFERENCES)
    records: list[dict[str, Any]] = []
    sections: list[str] = []
    summary_rows: list[str] = []
    for id in ids:
        paper = registry.info(id)
        value = results.get(id)
        status, outcome = _status(id), _outcome(id, value)
        rec: dict[str, Any] = {"id": id, "kind": "paper" if id in registry.PAPERS else "reference",
                               "name": paper.name, "venue": paper.venue, "family": paper.family,
                               "status": status, "outcome": outcome}
        margin = wall = ""
        if isinstance(value, ReproResult):
            missing = _copy_artifacts(id, value, out)
            rec.update(verdict=value.verdict, verdict_text=value.verdict_text, reason=value.reason,
                       margin=_clean(value.margin),  # strict JSON: NaN -> None, inf -> "inf"
                       checks=[_check_summary(c) for c in value.checks],
                       preconditions=[p.to_json() for p in value.preconditions], overrides=value.overrides,
                       mode=value.mode, seeds=list(value.seeds), wall_time_s=value.wall_time_s,
                       cpu_time_s=value.cpu_time_s,
                       environment={k: value.environment[k] for k in _RUN_FACTS if k in value.environment},
                       cache_hit=value.cache_hit, result_json=f"{id}/result.json",
                       figures=[f"{id}/{f}" for f in value.figures], missing_figures=missing)
            margin, wall = _signed(value.margin), f"{value.wall_time_s:.1f} s"
            body = _result_section(id, value, missing)
        elif isinstance(value, BaseException):
            rec["error"] = _error_text(value)
            body = (f"<p>{_badge('error')} the reproduction raised:</p>"
                    f"<pre>{_esc(_error_text(value))}</pre>")
        else:
            body = None
        records.append(rec)
        anchor = f"<a href='#{_esc(id)}'>{_esc(paper.name)}</a>" if body else _esc(paper.name)
        summary_rows.append(
            f"<tr id='row-{_esc(id)}'><td>{anchor}<br><code>{_esc(id)}</code></td><td>{_esc(paper.venue)}</td>"
            f"<td>{_esc(paper.family)}</td><td>{_badge(status)}</td><td>{_badge(outcome)}</td>"
            f"<td class='num'>{_esc(margin)}</td><td class='num'>{_esc(wall)}</td>"
            f"<td>{_esc(paper.summary)}</td></tr>")
        if body:
            sections.append(
                f"<section class='paper' id='{_esc(id)}'><h2>{_esc(paper.name)} <code>{_esc(id)}</code> "
                f"{_badge(outcome)}</h2><p class='muted'>{_esc(paper.venue)} · {_esc(paper.family)} · "
                f"status {_esc(status)} · {_esc(paper.summary)}</p>\n{body}</section>")

    counts = {o: sum(r["outcome"] == o for r in records) for o in OUTCOMES}
    by_status: dict[str, int] = {}
    for r in records:
        if r["kind"] == "paper":
            by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    modes = sorted({r["mode"] for r in records if "mode" in r})
    shown_mode = mode or (", ".join(modes) if modes else "–")
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    summary = {"generated": generated, "rankwise": __version__, "mode": mode or (modes[0] if len(modes) == 1 else None),
               "counts": counts, "paper_status": by_status, "papers": records}

    count_text = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    status_text = ", ".join(f"{v} {k}" for k, v in sorted(by_status.items()))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rankwise reproductions</title><style>{_CSS}</style></head>
<body>
<h1>rankwise reproductions</h1>
<p class="muted">rankwise {_esc(__version__)} · mode {_esc(shown_mode)} · generated {_esc(generated)}</p>
<p>{_esc(len(registry.PAPERS))} papers ({_esc(status_text)}) and {_esc(len(registry.REFERENCES))} reference
method(s). Reproductions: {_esc(count_text or 'none')}. A verdict is computed from the measured numbers,
never set by hand: it rests on the <i>claim</i> checks (the <i>wiring</i> checks are identities only a bug
can break; a failed one makes the verdict "does not hold"). It is <i>inconclusive</i> when a precondition
stated in the reproduction fails, or when a claim check's 95% paired bootstrap interval contains its
threshold; a mode without claim checks says "checks wiring only".</p>
<table><tr><th>Paper</th><th>Venue</th><th>Family</th><th>Status</th><th>Outcome</th><th>Margin</th>
<th>Wall time</th><th>What it does</th></tr>
{chr(10).join(summary_rows)}
</table>
{chr(10).join(sections)}
</body></html>
"""
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, allow_nan=False))
    index = out / "index.html"
    atomic_write_text(index, page)
    return index
