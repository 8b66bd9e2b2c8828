"""One registry of the methods rankwise implements.

Two kinds of entries:

* ``PAPERS``: the 38 papers of the 2026 seed lists (ICML, ICLR), fixed here with their spec id (the
  file name of ``shared/methods/<id>.md``), short name, one-line description, venue, seed list and
  family. A paper is ``planned`` until its method module calls :func:`register`; it is
  ``implemented`` from then on, and ``reproduced`` once a reproduction module
  ``rankwise.repro.<id>`` also exists (the test suite runs every reproduction in smoke mode).
* reference methods (``lora``, the SVD baselines, ...), which are not papers of the seed lists but
  which the reproductions use as baselines. They register the same way with ``kind="reference"``.

Registration is explicit: a method module calls ``register(...)`` at import time. Discovery imports
every module of the method families (``adapt``, ``merge``, ``compress``, ``train``, ``federated``,
``infer``, ``science``). Method modules therefore import optional extras (flwr, ...) lazily, inside
functions, so that importing them never fails.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from rankwise.core.errors import UnknownMethodError

Family = Literal["adapt", "merge", "compress", "train", "federated", "infer", "science"]
Status = Literal["planned", "implemented", "reproduced"]

ICML_LIST = "000_c97e98d0d0e76d63.txt"
ICLR_LIST = "003_6679e9e58c0c1349.txt"
FAMILIES: tuple[str, ...] = ("adapt", "merge", "compress", "train", "federated", "infer", "science")


@dataclass(frozen=True)
class Paper:
    id: str
    name: str
    summary: str
    venue: str
    family: str

    @property
    def seed_list(self) -> str:
        return ICML_LIST if self.venue.startswith("ICML") else ICLR_LIST


def _p(id: str, name: str, summary: str, venue: str, family: str) -> Paper:
    return Paper(id, name, summary, venue, family)


_ICML, _ICLR = "ICML 2026", "ICLR 2026"

PAPERS: dict[str, Paper] = {p.id: p for p in [
    _p("agentvocab", "AgentVocab", "structure-aware vocabulary adaptation from tool-calling traces", _ICML, "infer"),
    _p("arpc", "ARPC", "progressive ultra-low-bitrate image coding with multi-scale residual quantization", _ICLR, "science"),
    _p("cdka", "CDKA", "component-designed Kronecker adapters with budget-aware shapes", _ICML, "adapt"),
    _p("condiquant", "CondiQuant", "lower the condition number of weights before low-bit PTQ of super-resolution models", _ICML, "compress"),
    _p("ctm", "Compress-then-Merge", "merge T LoRAs into one rank-r LoRA by fixing shared subspaces first", _ICML, "merge"),
    _p("daf", "DAF", "dynamic sensitivity-aware re-allocation of the PEFT budget during training", _ICML, "adapt"),
    _p("diffbcp", "DiffBCP", "Bayesian CP decomposition with a shrinkage rank prior and a diffusion data prior", _ICML, "science"),
    _p("distill_multiindex", "Distill-MIM", "dataset distillation of two-layer-network training on multi-index models", _ICML, "science"),
    _p("e2lora", "E²LoRA", "LoRA shared across adjacent layers, intervals and ranks set by gradient entropy", _ICLR, "adapt"),
    _p("fslora", "FSLoRA", "federated sketching LoRA: clients train random rank-k sub-blocks of one global LoRA", _ICML, "federated"),
    _p("gfwsvd", "GFWSVD", "Kronecker-factored Fisher-weighted SVD with a closed form", _ICML, "compress"),
    _p("heapr", "HEAPr", "pruning MoE atomic experts with an output-space OBS score", _ICLR, "compress"),
    _p("intrinsic_dynamics", "Intrinsic dynamics", "when a gradient flow on parameters is a closed flow on a lifted variable", _ICLR, "science"),
    _p("lopti", "Lopti / AR", "stop low-probability tokens from dominating GRPO updates", _ICLR, "train"),
    _p("lora_mixer", "LoRA-Mixer", "token-routed LoRA experts inside projections with a routing specialization loss", _ICLR, "adapt"),
    _p("mi_sprm", "MI-SPRM+", "parameter-free smooth predictive regret matching+, O(1/T) to Nash", _ICLR, "science"),
    _p("mtlora", "mtLoRA", "scalable multi-task LoRA: spectral-aware regularisation, block adapters, routing", _ICLR, "adapt"),
    _p("p2d", "P2D", "task-sensitive attention heads select both the data and the trainable parameters", _ICML, "train"),
    _p("pave", "PAVE", "parameter-vector specifications for identifying helpful models (learnwares)", _ICLR, "science"),
    _p("priorguide", "PriorGuide", "test-time prior swap for diffusion-based simulation-based inference", _ICLR, "science"),
    _p("psoft", "PSOFT", "orthogonal fine-tuning confined to the principal subspace of each weight", _ICLR, "adapt"),
    _p("racs_alice", "RACS / Alice", "memory-efficient optimizers from structured Fisher approximation", _ICLR, "train"),
    _p("rank_clustering", "R-model clustering", "k-median / k-means from a noisy quadruplet comparison oracle", _ICLR, "science"),
    _p("ranktuner", "RankTuner", "relative-rank-indicator token reweighting for supervised fine-tuning", _ICML, "train"),
    _p("riemannian_lora", "LoRA-S (AdamS, LRACS)", "LoRA optimizers via horizontal lift with a Sylvester decay matrix", _ICLR, "train"),
    _p("root_purge", "Root Purge / RRR / DWRR", "rank-based denoising of linear time-series forecasters", _ICLR, "science"),
    _p("saes_svd", "SAES-SVD", "SVD compression that suppresses accumulated and local errors", _ICLR, "compress"),
    _p("safety_one_shot", "Safety at One Shot", "realign a harmfully fine-tuned LM with one safety example", _ICLR, "train"),
    _p("sambal", "SAMBAL", "grammatical nonsense: tiny LMs that learn syntax without semantics", _ICML, "science"),
    _p("santa", "SANTA / S²ANTA", "stochastic additive attention: sample value rows from the softmax", _ICML, "infer"),
    _p("star_kv", "STAR-KV", "learned soft thresholds choose per-head ranks for a low-rank KV cache", _ICML, "compress"),
    _p("stiefel_cl", "EBLoRA", "energy-balanced LoRA on a restricted Stiefel manifold for continual learning", _ICML, "adapt"),
    _p("swift_svd", "Swift-SVD", "optimal activation-aware low-rank compression from one eigendecomposition", _ICML, "compress"),
    _p("token_dynamics", "Stochastic token dynamics", "deep transformers with random values as particles on the sphere", _ICML, "science"),
    _p("ub_smoe", "UB-SMoE", "universally balanced sparse MoE for heterogeneous federated fine-tuning", _ICML, "federated"),
    _p("uldnet", "ULD-Net", "ultra-low-degree polynomial networks for homomorphic-encryption inference", _ICLR, "science"),
    _p("vapt", "VAPT", "visual adaptive prompt tuning: prompts generated from the previous layer's tokens", _ICLR, "adapt"),
    _p("winq", "WinQ", "faster QAT via periodic interpolation reset and noise-injected gradients", _ICML, "train"),
]}

REFERENCES: dict[str, Paper] = {p.id: p for p in [
    _p("lora", "LoRA", "the reference low-rank adapter (Hu et al. 2021), PEFT-compatible", "reference", "adapt"),
]}


@dataclass
class MethodEntry:
    """What a method module registers: its config class, its entry point and where it lives."""

    id: str
    family: str
    config: type | None
    entry: Callable[..., Any] | None
    module: str
    kind: str = "paper"
    extras: dict[str, Any] = field(default_factory=dict)


_ENTRIES: dict[str, MethodEntry] = {}
_DISCOVERED = False


def register(
    id: str,
    *,
    config: type | None = None,
    entry: Callable[..., Any] | None = None,
    module: str | None = None,
    **extras: Any,
) -> MethodEntry:
    """Register an implemented method. Called by the method's own module at import time.

    ``id`` must be a spec id of :data:`PAPERS` or a reference id of :data:`REFERENCES`; a module may
    register several ids (e.g. a paper and its reference baselines).
    """
    if id in PAPERS:
        kind, family = "paper", PAPERS[id].family
    elif id in REFERENCES:
        kind, family = "reference", REFERENCES[id].family
    else:
        raise UnknownMethodError(f"cannot register {id!r}: not a known paper or reference id")
    mod = module or (getattr(entry, "__module__", None) if entry is not None else None) or "?"
    e = MethodEntry(id=id, family=family, config=config, entry=entry, module=mod, kind=kind, extras=extras)
    _ENTRIES[id] = e
    return e


def discover() -> None:
    """Import every method module so that each registers itself (idempotent)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    for fam in FAMILIES:
        pkg = importlib.import_module(f"rankwise.{fam}")
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"rankwise.{fam}."):
            importlib.import_module(info.name)
    _DISCOVERED = True


def all_ids() -> list[str]:
    """Every id rankwise knows: the 38 papers, then the references."""
    return list(PAPERS) + list(REFERENCES)


def info(id: str) -> Paper:
    """The paper (or reference) record of ``id``; an unknown id raises with the closest match."""
    if id in PAPERS:
        return PAPERS[id]
    if id in REFERENCES:
        return REFERENCES[id]
    raise UnknownMethodError(unknown_id_message(id))


def unknown_id_message(id: str) -> str:
    close = difflib.get_close_matches(id.replace("-", "_"), all_ids(), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown method id {id!r}{hint} (`rankwise list` shows all ids)"


def normalize_id(id: str) -> str:
    """Accept ``swift-svd`` for ``swift_svd``; raise with a suggestion for an unknown id."""
    key = id.strip().lower().replace("-", "_")
    info(key)
    return key


def get(id: str) -> MethodEntry:
    """The registered entry of an implemented method."""
    key = normalize_id(id)
    discover()
    if key not in _ENTRIES:
        raise UnknownMethodError(f"method {key!r} is planned, not implemented yet")
    return _ENTRIES[key]


def has_reproduction(id: str) -> bool:
    return importlib.util.find_spec(f"rankwise.repro.{id}") is not None


def registered_ids() -> dict[str, str]:
    """Registered id -> registering module, from the static manifest (:mod:`rankwise.core.manifest`).

    Cheap: no method module is imported. The manifest is regenerated by ``python -m rankwise.readme``
    (see :func:`manifest_text`) and checked against :func:`discover` by the test suite.
    """
    from rankwise.core import manifest

    return dict(manifest.REGISTERED)


def discovered_ids() -> dict[str, str]:
    """Registered id -> registering module, by importing every method module (slow: torch and all)."""
    discover()
    return {k: e.module for k, e in sorted(_ENTRIES.items())}


_MANIFEST_DOC = """Which methods are registered, written by ``python -m rankwise.readme`` (do not edit by hand).

``REGISTERED`` maps every registered id to the module that calls :func:`rankwise.core.registry.register`.
The registry answers ``status``/``table`` (``rankwise list``, the README table) from here, so that
listing the papers imports no method module (and no torch); ``tests/test_registry.py`` checks that it
equals what importing every method module registers."""


def manifest_text() -> str:
    """The source of :mod:`rankwise.core.manifest` for the code base as it is now (imports every method)."""
    head = _MANIFEST_DOC
    rows = "".join(f"    {k!r}: {m!r},\n" for k, m in discovered_ids().items())
    return (f'"""{head}\n"""\n\nfrom __future__ import annotations\n\n'
            f"REGISTERED: dict[str, str] = {{\n{rows}}}\n")


def status(id: str) -> Status:
    """``planned``, ``implemented`` or ``reproduced``, computed from what the code base holds (the
    manifest of registered methods and the presence of ``rankwise.repro.<id>``)."""
    key = normalize_id(id)
    if key not in registered_ids() and key not in _ENTRIES:  # _ENTRIES: registered at run time (plugins)
        return "planned"
    return "reproduced" if has_reproduction(key) else "implemented"


def table(include_references: bool = False) -> list[dict[str, str]]:
    """One row per paper (and reference, if asked): id, name, venue, family, status, summary."""
    ids = list(PAPERS) + (list(REFERENCES) if include_references else [])
    rows = []
    for id in ids:
        p = info(id)
        rows.append({"id": id, "name": p.name, "venue": p.venue, "family": p.family,
                     "status": status(id), "summary": p.summary})
    return rows
