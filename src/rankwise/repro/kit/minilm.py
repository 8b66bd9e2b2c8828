"""A reproduction base for the experiments on the embedded MiniLM (cdka, psoft, e2lora, daf, ctm).

They share two things the skeleton leaves to each module: the encoder is loaded once per run and
shared by every seed, and each seed's record carries its own rows as a ``"table"`` that the run's
table concatenates in seed order. Subclasses set ``columns`` / ``column_notes`` and call
:meth:`minilm` from ``measure``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rankwise.repro.result import Table
from rankwise.repro.skeleton import Records, Reproduction


class MiniLMReproduction(Reproduction[Any, dict]):
    """:class:`Reproduction` with a shared MiniLM and a table joined from the seeds' own tables."""

    columns: Sequence[str] = ()
    column_notes: Mapping[str, str] = {}

    def minilm(self) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of :func:`rankwise.zoo.minilm`, loaded on the first call of the run."""
        if not hasattr(self, "_bert"):
            from rankwise import zoo

            self._bert, self._tok = zoo.minilm()
        return self._bert, self._tok

    def table(self, settings: Any, records: Records[dict]) -> Table:
        table = Table(columns=list(self.columns), notes=dict(self.column_notes))
        for r in records:
            table.extend(r["table"])
        self._table = table
        return table
