"""Exception types of rankwise.

Every error a user can cause derives from :class:`RankwiseError` (or is a plain ``ValueError`` /
``TypeError`` raised by a config's validation). The CLI prints these as one line and exits 2.
"""

from __future__ import annotations


class RankwiseError(Exception):
    """Base class of the errors rankwise raises on bad input or state."""


class UnknownMethodError(RankwiseError, KeyError):
    """A method id that the registry does not know."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SelectionError(RankwiseError, ValueError):
    """A target selector matched no module (or matched modules of an unsupported type)."""


class ArtifactError(RankwiseError, ValueError):
    """A saved artefact (adapter, compressed model, statistics) is corrupt, truncated or does not fit."""


class NumericalError(RankwiseError, FloatingPointError):
    """A computation produced non-finite values; the message names the layer."""
