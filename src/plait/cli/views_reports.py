"""What `plait eval` and `plait compress` print: the evaluation report (perplexity, lm-eval scores, the
suite's table of assertions) and the before/after table of a compression (rich). The numbers are
plait.lifecycle's; this module only shows them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # not at run time: plait.lifecycle.evaluate imports torch
    from plait.lifecycle.evaluate import Report


def print_report(report: Report, console=None) -> None:
    """`plait eval`'s report: perplexity, each lm-eval task's scores, then the suite's assertions and tally."""
    console = console or Console(width=120)
    if report.perplexity:
        p = report.perplexity
        console.print(f"perplexity {p['perplexity']:.3f} (loss {p['loss']:.4f} nats/token over {p['tokens']:,} tokens)")
    for task, metrics in report.lm_eval.items():
        shown = ", ".join(
            f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k
        )
        console.print(f"lm-eval {task}: {shown}")
    if not report.results:
        return
    table = Table(title=f"suite {report.suite}", title_justify="left")
    for col in ("test", "assertion", "result", "detail"):
        table.add_column(col, overflow="fold")
    for r in report.results:
        table.add_row(r.test, r.assertion, "[green]PASS[/]" if r.passed else "[red]FAIL[/]", r.detail)
    console.print(table)
    colour = "green" if not report.failed else "red"
    console.print(f"[{colour}]{report.passed} passed, {report.failed} failed[/]")


def print_comparison(title: str, rows: dict[str, dict[str, float]], console=None) -> None:
    """`plait compress`'s table: each measure before and after, the change and the ratio
    (rows: plait.lifecycle.compress.compare)."""
    console = console or Console(width=120)
    labels = {
        "size_mb": "weights (MiB)",
        "params_m": "parameters (M)",
        "nonzero_m": "non-zero parameters (M)",
        "tokens_per_s": "forward tokens/s",
        "perplexity": "perplexity (val)",
    }
    table = Table(title=title, title_justify="left")
    for col in ("metric", "before", "after", "delta", "after / before"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for key, r in rows.items():
        table.add_row(
            labels.get(key, key),
            f"{r['before']:,.3f}",
            f"{r['after']:,.3f}",
            f"{r['delta']:+,.3f}",
            f"{r['ratio']:.3f}",
        )
    console.print(table)
