"""The PEFT LoRA directory format, read and written as an :class:`~rankwise.core.lora.AdapterState`.

A LoRA adapter directory (what ``rankwise.adapt.lora.save_adapter`` and PEFT's ``save_pretrained`` write):

``adapter_config.json``
    a PEFT ``LoraConfig`` (``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``target_modules``,
    ``rank_pattern``/``alpha_pattern`` for modules whose rank/alpha differ from the most common
    one, ``use_rslora``, ``lora_dropout``, ``bias: "none"``, ...);
``adapter_model.safetensors``
    keys ``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r), as
    PEFT names them; the safetensors header additionally holds rankwise metadata (adapter name,
    config, exact per-module scaling, base-model fingerprint, per-tensor SHA-256, see
    :mod:`rankwise.core.io`), which PEFT ignores.

:func:`write_adapter_dir` writes a state in this layout (so ``peft.PeftModel.from_pretrained(base, dir)``
loads it) and :func:`import_peft` reads one, from rankwise or from PEFT (standard LoRA on ``nn.Linear``
only: DoRA, bias training, ``modules_to_save``, embedding/conv targets, base-modifying initialisations
and the other PEFT variants are rejected with a clear error). :data:`LORA` is the LoRA family's
:class:`~rankwise.core.adapters.AdapterMethod`, whose artefact is this directory. This lives in ``core``
because merging methods and federated training exchange LoRA directories too; ``rankwise.adapt.lora``
re-exports all of it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from rankwise.core import io
from rankwise.core.adapters import AdapterMethod
from rankwise.core.errors import ArtifactError, RankwiseError
from rankwise.core.lora import (
    AdapterState,
    LoraLinear,
    base_module_names,
    check_state_fits,
    get_state,
    lora_scaling,
    set_state,
)

__all__ = ["CONFIG_FILE", "LORA", "WEIGHTS_FILE", "LoRAMethod", "import_peft", "peft_config_dict",
           "write_adapter_dir"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_KIND = "rankwise.lora"
# Files a previous save may have left; a directory holding only these is replaced without asking.
_OWN_FILES = (CONFIG_FILE, WEIGHTS_FILE, "README.md")


# ------------------------------------------------------------------------------------------------
# PEFT semantics (peft 0.14-0.21): how target_modules / rank_pattern / alpha_pattern are matched
# ------------------------------------------------------------------------------------------------

def _peft_targets(target_modules: Any, key: str) -> bool:
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, key) is not None
    return any(key == t or key.endswith("." + t) for t in target_modules)


def _peft_pattern(pattern: Mapping[str, Any], key: str, default: Any) -> Any:
    for k, v in pattern.items():  # peft.utils.other.get_pattern_key: first key matching as a suffix regex
        if re.match(rf"(.*\.)?({k})$", key):
            return v
    return default


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def _alpha_of(state: AdapterState, module: str, use_rslora: bool) -> float:
    """The alpha that gives the module's scaling: the config's alpha when exact, else s * r (s * sqrt r)."""
    r, s = state.rank(module), state.scaling[module]
    a = state.config.get("alpha")
    if isinstance(a, (int, float)) and not isinstance(a, bool) and lora_scaling(float(a), r, use_rslora) == s:
        return float(a)
    return s * math.sqrt(r) if use_rslora else s * r


def peft_config_dict(state: AdapterState, module_names: list[str] | None = None,
                     base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """A PEFT ``adapter_config.json`` (as a dict) that reproduces ``state`` exactly.

    ``module_names``: every module name of the base model; used to check that a plain list of
    ``target_modules`` selects exactly the adapted modules (else a regex is written).
    """
    use_rslora = bool(state.config.get("use_rslora", False))
    mods = state.modules()
    ranks = state.ranks()
    alphas = {m: _alpha_of(state, m, use_rslora) for m in mods}
    r0 = Counter(ranks[m] for m in mods).most_common(1)[0][0]
    a0 = Counter(alphas[m] for m in mods).most_common(1)[0][0]
    universe = list(dict.fromkeys((module_names or []) + mods))

    target: Any = sorted(mods)
    if module_names is None or {k for k in universe if _peft_targets(target, k)} != set(mods):
        target = "(?:" + "|".join(re.escape(m) for m in mods) + ")"

    def pattern(values: dict[str, Any], default: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for m in mods:
            if values[m] == default:
                continue
            # a key matches any module name ending in ".<key>": anchor it when that is ambiguous
            clash = any(k != m and re.match(rf"(.*\.)?({m})$", k) for k in mods)
            out["^" + re.escape(m) if clash else m] = values[m]
        return out

    rank_pattern = pattern(ranks, r0)
    alpha_pattern = {k: _number(v) for k, v in pattern(alphas, a0).items()}
    for m in mods:  # the config must resolve to the state's ranks and scalings under PEFT's rules
        r = _peft_pattern(rank_pattern, m, r0)
        a = float(_peft_pattern(alpha_pattern, m, a0))
        s = lora_scaling(a, r, use_rslora)
        if r != ranks[m] or not math.isclose(s, state.scaling[m], rel_tol=1e-12, abs_tol=0.0):
            raise RankwiseError(f"internal: cannot express module {m!r} (rank {ranks[m]}, scaling "
                                f"{state.scaling[m]}) as a PEFT LoraConfig")
    dropout = float(state.config.get("dropout", 0.0) or 0.0)
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r0,
        "lora_alpha": _number(a0),
        "target_modules": target,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "lora_dropout": dropout,
        "use_rslora": use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
    }


# ------------------------------------------------------------------------------------------------
# write / read
# ------------------------------------------------------------------------------------------------

def write_adapter_dir(state: AdapterState, directory: str | Path, *, name: str = "default",
                      module_names: list[str] | None = None, base_model_name_or_path: str | None = None,
                      overwrite: bool | None = None) -> Path:
    """Write ``state`` as a PEFT-compatible LoRA directory (atomically; see the module docstring).

    ``overwrite``: None replaces an existing directory only if it holds nothing but files this
    function writes; True replaces any existing directory; False refuses a non-empty one.
    """
    directory = Path(directory)
    state.validate()
    cfg = peft_config_dict(state, module_names, base_model_name_or_path)
    tensors: dict[str, torch.Tensor] = {}
    for m in state.modules():
        tensors[f"{_PEFT_PREFIX}{m}.lora_A.weight"] = state.factors[m]["lora_A"]
        tensors[f"{_PEFT_PREFIX}{m}.lora_B.weight"] = state.factors[m]["lora_B"]
    meta = {"kind": _KIND, "name": name, "config": state.config, "modules": state.modules(),
            "scaling": {m: float(s) for m, s in state.scaling.items()}, "fingerprint": state.fingerprint}

    def files(tmp: Path) -> None:
        io.write_json(tmp / CONFIG_FILE, cfg)
        io.save_tensors(tmp / WEIGHTS_FILE, tensors, meta)
    return io.write_dir(directory, files, overwrite=overwrite, own_files=_OWN_FILES)


_UNSUPPORTED_FLAGS: tuple[tuple[str, str], ...] = (
    ("use_dora", "DoRA (use_dora=true)"),
    ("fan_in_fan_out", "fan_in_fan_out=true (transposed Conv1D targets, not nn.Linear)"),
    ("lora_bias", "lora_bias=true (a trained bias on lora_B)"),
    ("modules_to_save", "modules_to_save (fully fine-tuned extra modules)"),
    ("layer_replication", "layer_replication"),
    ("use_qalora", "QA-LoRA (use_qalora=true)"),
    ("target_parameters", "target_parameters (LoRA on raw nn.Parameters)"),
    ("trainable_token_indices", "trainable_token_indices (trainable embedding rows)"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
    ("arrow_config", "Arrow routing (arrow_config)"),
    ("kasa_config", "KaSA (kasa_config)"),
    ("monteclora_config", "MonteCLoRA (monteclora_config)"),
    ("velora_config", "VeLoRA (velora_config)"),
    ("megatron_config", "Megatron parallel layers (megatron_config)"),
)
_OK_INITS = (True, False, "gaussian", "orthogonal", "eva")


def _unsupported(cfg: Mapping[str, Any]) -> list[str]:
    out = []
    for key, what in _UNSUPPORTED_FLAGS:
        v = cfg.get(key)
        if v not in (None, False, 0, "", [], {}):
            out.append(what)
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        out.append(f"bias={bias!r} (trained base-layer biases)")
    init = cfg.get("init_lora_weights", True)
    if init not in _OK_INITS:
        out.append(f"init_lora_weights={init!r} (changes the base weights or uses a LoRA variant)")
    return out


_KEY_RE = re.compile(r"^(?P<mod>.+)\.(?P<fac>lora_A|lora_B)(?:\.(?P<ad>[A-Za-z0-9_\-]+))?\.weight$")


def _classify_unknown(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA magnitude vectors"
    if "lora_embedding_" in key:
        return "LoRA on nn.Embedding (not nn.Linear)"
    if re.search(r"\.lora_[AB](\.[^.]+)?\.bias$", key):
        return "LoRA biases (lora_bias)"
    if "modules_to_save" in key or "original_module" in key:
        return "modules_to_save"
    if "trainable_tokens" in key:
        return "trainable tokens"
    return "unrecognised tensors"


def import_peft(directory: str | Path, model: nn.Module | None = None) -> AdapterState:
    """Read a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``) as an AdapterState.

    Standard LoRA on ``nn.Linear`` only: other PEFT types and features raise ArtifactError saying
    which. Per-module ranks/alphas come from ``rank_pattern``/``alpha_pattern`` and must agree with
    the tensors. A directory written by rankwise also yields its exact scalings and base-model
    fingerprint. With ``model``, every module must exist there as a Linear of matching shape.
    ``adapter_model.bin`` (pickle) is refused: rankwise never unpickles.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such adapter directory")
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.is_file():
        raise ArtifactError(f"{directory}: not a PEFT/rankwise adapter directory (no {CONFIG_FILE})")
    cfg = io.read_json(cfg_path)
    peft_type = str(cfg.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise ArtifactError(f"{cfg_path}: unsupported PEFT type {cfg.get('peft_type')!r}; only standard "
                            "LoRA (peft_type 'LORA') can be imported")
    bad = _unsupported(cfg)
    if bad:
        raise ArtifactError(f"{cfg_path}: unsupported PEFT LoRA feature(s): {', '.join(bad)}. "
                            "rankwise imports standard LoRA on nn.Linear layers only")
    r_default = cfg.get("r", 8)
    a_default = cfg.get("lora_alpha", 8)
    use_rslora = cfg.get("use_rslora", False)
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    dropout = cfg.get("lora_dropout", 0.0) or 0.0
    if not isinstance(r_default, int) or isinstance(r_default, bool) or r_default < 1:
        raise ArtifactError(f"{cfg_path}: r must be an int >= 1, got {r_default!r}")
    if not isinstance(a_default, (int, float)) or isinstance(a_default, bool) or not math.isfinite(a_default):
        raise ArtifactError(f"{cfg_path}: lora_alpha must be a finite number, got {a_default!r}")
    if not isinstance(use_rslora, bool):
        raise ArtifactError(f"{cfg_path}: use_rslora must be a bool, got {use_rslora!r}")
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise ArtifactError(f"{cfg_path}: rank_pattern/alpha_pattern must be objects")
    if not isinstance(dropout, (int, float)) or not 0.0 <= float(dropout) < 1.0:
        raise ArtifactError(f"{cfg_path}: lora_dropout must be in [0, 1), got {dropout!r}")

    w_path = directory / WEIGHTS_FILE
    if not w_path.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise ArtifactError(f"{directory}: holds adapter_model.bin (a pickle), which rankwise never loads; "
                                "re-save it with PEFT's save_pretrained(safe_serialization=True)")
        raise ArtifactError(f"{directory}: no {WEIGHTS_FILE}")
    tensors, header = io.load_tensors(w_path)
    own = header if header.get("kind") == _KIND else None

    factors: dict[str, dict[str, torch.Tensor]] = {}
    adapters_seen: set[str] = set()
    unknown: dict[str, list[str]] = {}
    for key, t in tensors.items():
        k = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        mt = _KEY_RE.match(k)
        if mt is None:
            unknown.setdefault(_classify_unknown(k), []).append(key)
            continue
        if mt["ad"]:
            adapters_seen.add(mt["ad"])
        factors.setdefault(mt["mod"], {})[mt["fac"]] = t
    if unknown:
        desc = "; ".join(f"{what} ({keys[:2]}{' ...' if len(keys) > 2 else ''})" for what, keys in unknown.items())
        raise ArtifactError(f"{w_path}: unsupported PEFT LoRA content: {desc}. rankwise imports standard "
                            "LoRA on nn.Linear layers only")
    if len(adapters_seen) > 1:
        raise ArtifactError(f"{w_path}: holds several adapters {sorted(adapters_seen)}; save them separately")
    if not factors:
        raise ArtifactError(f"{w_path}: holds no LoRA tensors")

    scaling: dict[str, float] = {}
    for m, f in factors.items():
        if set(f) != {"lora_A", "lora_B"}:
            raise ArtifactError(f"{w_path}: module {m!r} lacks {'lora_B' if 'lora_A' in f else 'lora_A'}")
        a, b = f["lora_A"], f["lora_B"]
        if a.ndim != 2 or b.ndim != 2:
            raise ArtifactError(f"{w_path}: module {m!r} has lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}: "
                                "LoRA on a non-Linear layer (e.g. Conv) is not supported")
        if a.shape[0] != b.shape[1]:
            raise ArtifactError(f"{w_path}: module {m!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                "have different ranks")
        r = int(a.shape[0])
        r_cfg = _peft_pattern(rank_pattern, m, r_default)
        if r_cfg != r:
            raise ArtifactError(f"{cfg_path}: module {m!r} has rank {r} in the weights but {r_cfg} in the config")
        alpha = _peft_pattern(alpha_pattern, m, a_default)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise ArtifactError(f"{cfg_path}: alpha for module {m!r} must be a finite number, got {alpha!r}")
        scaling[m] = lora_scaling(float(alpha), r, use_rslora)

    fingerprint = None
    config: dict[str, Any] = {"method": "lora", "rank": r_default, "alpha": float(a_default),
                              "use_rslora": use_rslora, "dropout": float(dropout), "init": None,
                              "targets": list(factors), "source": "peft",
                              "base_model_name_or_path": cfg.get("base_model_name_or_path")}
    if own is not None:
        mods, hdr_scaling = own.get("modules"), own.get("scaling")
        if not isinstance(mods, list) or set(mods) != set(factors) or not isinstance(hdr_scaling, dict):
            raise ArtifactError(f"{w_path}: rankwise metadata does not match the tensors it holds")
        for m in mods:
            s = hdr_scaling.get(m)
            if not isinstance(s, (int, float)) or not math.isclose(s, scaling[m], rel_tol=1e-9):
                raise ArtifactError(f"{directory}: {CONFIG_FILE} and the weights' metadata disagree on the "
                                    f"scaling of {m!r} ({scaling[m]} vs {s}); the directory was edited")
        scaling = {m: float(hdr_scaling[m]) for m in mods}
        factors = {m: factors[m] for m in mods}
        fingerprint = own.get("fingerprint")
        if isinstance(own.get("config"), dict):
            config = dict(own["config"])
    try:
        state = AdapterState(config, factors, scaling, fingerprint)
    except ValueError as e:
        raise ArtifactError(f"{directory}: {e}") from e
    if model is not None:
        check_state_fits(model, state, str(directory))
    return state


# ------------------------------------------------------------------------------------------------
# the LoRA family's AdapterMethod: the layer of rankwise.core.lora, this directory as its artefact
# ------------------------------------------------------------------------------------------------

class LoRAMethod(AdapterMethod):
    """LoRA's model-level API; its artefact is a PEFT LoRA directory, read and written through
    :class:`~rankwise.core.lora.AdapterState` (:func:`write_adapter_dir`, :func:`import_peft`)."""

    factor_pairs = True

    def save_adapter(self, model: nn.Module, directory: str | Path, name: str = "default", *,
                     overwrite: bool | None = None) -> Path:
        """Save adapter ``name`` of ``model`` as a PEFT-compatible LoRA directory (+ rankwise fingerprint),
        atomically. Load it back with :meth:`load_adapter`, or with ``peft.PeftModel.from_pretrained``."""
        return write_adapter_dir(get_state(model, name), directory, name=name,
                                 module_names=base_module_names(model), overwrite=overwrite)

    def load_adapter(self, model: nn.Module, directory: str | Path, name: str = "default", *,
                     check_base: bool = True) -> nn.Module:
        """Load a LoRA directory saved by rankwise or PEFT into ``model`` as adapter ``name`` (active).

        Rejects (ArtifactError, model unchanged): a missing, corrupt or truncated file; an adapter saved
        for another base model (fingerprint; skip with ``check_base=False``); modules that are missing or
        of other shapes; unsupported PEFT features. Factors load bit-exactly.
        """
        state = import_peft(directory, model)
        set_state(model, state, name, check_base=check_base, source=str(directory))
        return model


#: LoRA's model-level adapter API (set_active, merge, save_adapter, load_adapter, ...).
LORA = LoRAMethod(LoraLinear, "rankwise.lora", default_lr=1e-3)
