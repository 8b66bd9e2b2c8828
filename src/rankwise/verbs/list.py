"""``rankwise list``: the papers and reference methods with their computed status."""

from __future__ import annotations

from typing import Optional

import typer

from rankwise.verbs import common


def list_cmd(
    ctx: typer.Context,
    markdown: bool = typer.Option(False, "--markdown", help="Print a Markdown table (as in the README)."),
    family: Optional[str] = typer.Option(None, "--family", help="Only this family: adapt, merge, compress, "
                                         "train, federated, infer, science."),
) -> None:
    """The 38 papers (and the reference methods) with their status."""
    from rankwise.core import registry

    if family is not None and family not in registry.FAMILIES:
        raise typer.BadParameter(f"unknown family {family!r}; choose one of {', '.join(registry.FAMILIES)}",
                                 param_hint="--family")
    if markdown:
        from rankwise.readme import papers_table_markdown

        typer.echo(papers_table_markdown(family=family), nl=False)
        return
    from rich.table import Table

    rows = [r for r in registry.table(include_references=True) if family in (None, r["family"])]
    style = {"planned": "dim", "implemented": "blue", "reproduced": "green"}
    console = common.console()
    for title, keep in (("Papers", registry.PAPERS), ("Reference methods", registry.REFERENCES)):
        sel = [r for r in rows if r["id"] in keep]
        if not sel:
            continue
        t = Table(title=f"{title} ({len(sel)})", title_justify="left")
        t.add_column("id", no_wrap=True)
        t.add_column("name")
        t.add_column("venue", no_wrap=True)
        t.add_column("family", no_wrap=True)
        t.add_column("status", no_wrap=True)
        if console.width >= 120:
            t.add_column("what it does")
        for r in sel:
            cells = [r["id"], r["name"], r["venue"], r["family"],
                     f"[{style.get(r['status'], '')}]{r['status']}[/]"]
            if console.width >= 120:
                cells.append(r["summary"])
            t.add_row(*cells)
        console.print(t)


def register(app: typer.Typer) -> None:
    app.command("list")(list_cmd)
