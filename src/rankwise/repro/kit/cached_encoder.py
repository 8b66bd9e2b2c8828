"""A frozen encoder prefix run once and cached, the adapted top layers trained on its outputs.

Most adapter reproductions (CDKA, PSOFT, E2LoRA, DAF, mtLoRA, LoRA-Mixer, FSLoRA, the merge suite's task
LoRAs) adapt only the top layers of the embedded MiniLM. The layers below never change, so their outputs
are computed once per example (:class:`FrozenPrefix`, :class:`CachedSplit`) and a training step runs only
the adapted layers, mean pooling and a linear head (:class:`TopModel`). The helpers here build batches
over the cached rows, evaluate, and train several models in lock step on the same batches with the shared
loop of :mod:`rankwise.train.finetune`.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.train.finetune import Batch, FinetuneConfig, Trainer, lockstep

__all__ = ["CachedSplit", "FrozenPrefix", "TopModel", "adapter_optimizer", "batch_indices", "cached_batches",
           "evaluate_cached", "median_step_ms", "peft_inject", "pooled_cached", "train_lockstep",
           "trainable_adapter_params", "trim_padding", "sweep_val_accuracy"]


# ------------------------------------------------------------------------------------------------

class FrozenPrefix:
    """The frozen lower part of a BERT encoder (embeddings and the first ``n_frozen`` layers), run once.

    :meth:`encode` returns hidden states ``(N, max_length, hidden)`` (float32) and the attention mask
    ``(N, max_length)`` for a list of texts, in eval mode (no dropout) without gradients.
    """

    def __init__(self, bert: nn.Module, tokenizer: Any, n_frozen: int, max_length: int = 16) -> None:
        self.bert, self.tokenizer, self.n_frozen, self.max_length = bert, tokenizer, n_frozen, max_length

    @torch.no_grad()
    def encode(self, texts: Sequence[str], chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.masking_utils import create_bidirectional_mask

        self.bert.eval()
        hs, ms = [], []
        for start in range(0, len(texts), chunk):
            enc = self.tokenizer(list(texts[start:start + chunk]), padding="longest", truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
            h = self.bert.embeddings(input_ids=enc["input_ids"], token_type_ids=enc.get("token_type_ids"))
            m4 = create_bidirectional_mask(config=self.bert.config, inputs_embeds=h,
                                           attention_mask=enc["attention_mask"])
            for layer in self.bert.encoder.layer[: self.n_frozen]:
                h = layer(h, attention_mask=m4)
                h = h[0] if isinstance(h, tuple) else h
            pad = self.max_length - h.shape[1]  # padded positions are masked everywhere downstream
            hs.append(nn.functional.pad(h.float(), (0, 0, 0, pad)))
            ms.append(nn.functional.pad(enc["attention_mask"], (0, pad)))
        return torch.cat(hs), torch.cat(ms)


class TopModel(nn.Module):
    """The adapted top layers of the encoder, mean pooling over real tokens and a linear head.

    ``forward(hidden (B, L, H), attention_mask (B, L)) -> logits (B, num_labels)``;
    :meth:`pooled` gives the mean-pooled final hidden states ``(B, H)`` (the sentence embedding).
    """

    def __init__(self, bert: nn.Module, n_top: int, num_labels: int, seed: int) -> None:
        super().__init__()
        self.config = bert.config
        self.layers = nn.ModuleList(copy.deepcopy(list(bert.encoder.layer[len(bert.encoder.layer) - n_top:])))
        self.classifier = nn.Linear(bert.config.hidden_size, num_labels)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.classifier.weight.copy_(torch.randn(self.classifier.weight.shape, generator=gen) * 0.02)
            self.classifier.bias.zero_()

    def pooled(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        m4 = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=m4)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        w = attention_mask[..., None].to(hidden.dtype)
        return (hidden * w).sum(1) / w.sum(1).clamp_min(1.0)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooled(hidden, attention_mask))


def trim_padding(h: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the trailing positions that are padding in every row of the batch (``h`` (B, L, H), ``m`` (B, L))."""
    n = int(m.sum(1).max())
    return h[:, :n].contiguous(), m[:, :n].contiguous()


def batch_indices(n: int, steps: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Example indices of ``steps`` batches: epochs over ``range(n)`` in orders drawn from ``Generator(seed)``."""
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n - batch_size + 1, batch_size):
            out.append(order[start:start + batch_size])
            if len(out) == steps:
                break
    return out


def cached_batches(hidden: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                   indices: Sequence[torch.Tensor]) -> list[Batch]:
    """:class:`~rankwise.train.finetune.Batch` es ``{"hidden", "attention_mask"}`` of the cached rows ``indices``."""
    out = []
    for idx in indices:
        h, m = trim_padding(hidden[idx], mask[idx])
        out.append(Batch({"hidden": h, "attention_mask": m}, labels[idx]))
    return out


class CachedSplit:
    """The cached prefix outputs of the examples a run uses: ``hidden``, ``mask``, ``labels`` and batches.

    Only the examples that some batch (or ``keep_all``) needs are encoded; :meth:`batches` maps the
    original example indices onto the cached rows.
    """

    def __init__(self, prefix: FrozenPrefix, data: Sequence[tuple[str, int]],
                 index_lists: Sequence[Sequence[torch.Tensor]] = (), keep_all: bool = False) -> None:
        used = sorted(set(range(len(data)))) if keep_all else sorted({int(i) for lst in index_lists for t in lst
                                                                      for i in t.tolist()})
        self.row = {i: k for k, i in enumerate(used)}
        self.hidden, self.mask = prefix.encode([data[i][0] for i in used])
        self.labels = torch.tensor([data[i][1] for i in used])

    def batches(self, indices: Sequence[torch.Tensor]) -> list[Batch]:
        rows = [torch.tensor([self.row[int(i)] for i in idx.tolist()]) for idx in indices]
        return cached_batches(self.hidden, self.mask, self.labels, rows)


@torch.no_grad()
def evaluate_cached(model: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                    chunk: int = 250) -> tuple[float, torch.Tensor]:
    """Accuracy and logits ``(N, C)`` of ``model`` on a cached set, in eval mode (mode restored)."""
    was = model.training
    model.eval()
    try:
        logits = torch.cat([model(*trim_padding(hidden[i:i + chunk], mask[i:i + chunk]))
                            for i in range(0, len(labels), chunk)])
    finally:
        model.train(was)
    return float((logits.argmax(-1) == labels).double().mean()), logits


def sweep_val_accuracy(grid: Sequence[float], fit: Callable[[float], dict[str, nn.Module]],
                       val: "CachedSplit") -> dict[str, dict[float, float]]:
    """``{row: {lr: validation accuracy}}``: for each rate of ``grid``, ``fit(lr)`` builds and trains the rows
    (same budget each) and every returned model is scored on the cached validation split. The reproductions'
    ``lr_sweep`` functions choose their rates with it, once, before the reported runs."""
    out: dict[str, dict[float, float]] = {}
    for lr in grid:
        for row, model in fit(lr).items():
            out.setdefault(row, {})[lr] = evaluate_cached(model, val.hidden, val.mask, val.labels)[0]
    return out


@torch.no_grad()
def pooled_cached(model: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, chunk: int = 250) -> torch.Tensor:
    """Sentence embeddings (mean-pooled final hidden states) of ``model.pooled`` on a cached set."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    was = inner.training
    inner.eval()
    try:
        return torch.cat([inner.pooled(*trim_padding(hidden[i:i + chunk], mask[i:i + chunk]))
                          for i in range(0, hidden.shape[0], chunk)])
    finally:
        inner.train(was)


def fit_probe_head(model: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, *,
                   steps: int = 300, lr: float = 1e-2) -> dict[str, float]:
    """Fit ``model.classifier`` as a linear probe on the frozen model's pooled features, then freeze it.

    The features (:func:`pooled_cached`, eval mode) are computed once; the head trains full-batch with Adam
    for ``steps`` steps (deterministic: no sampling). Afterwards the head's parameters have
    ``requires_grad=False``, so every copy of ``model`` that is then adapted starts from, and keeps, the same
    head: the accuracy an adapter adds comes from the adapted layers (the probe is the head-only baseline).
    Returns the probe's final training loss and accuracy.
    """
    feats = pooled_cached(model, hidden, mask)
    head = model.classifier
    head.requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        loss = nn.functional.cross_entropy(head(feats), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    head.requires_grad_(False)
    with torch.no_grad():
        acc = float((head(feats).argmax(-1) == labels).double().mean())
    return {"loss": float(loss.detach()), "train_acc": acc}


def adapter_optimizer(head: nn.Module, lr_adapter: float, lr_head: float, weight_decay: float = 0.0
                      ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """AdamW factory with two groups: the head's parameters at ``lr_head``, the rest at ``lr_adapter``."""
    head_ids = {id(p) for p in head.parameters()}

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        groups = [{"params": [p for p in params if id(p) not in head_ids], "lr": lr_adapter},
                  {"params": [p for p in params if id(p) in head_ids], "lr": lr_head}]
        return torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=weight_decay)
    return make


def trainable_adapter_params(model: nn.Module) -> int:
    """Trainable parameters outside the classification head."""
    return sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "classifier" not in n)


def peft_inject(model: nn.Module, config: Any) -> nn.Module:
    """``peft.inject_adapter_in_model`` on a TopModel, the head unfrozen afterwards (PEFT freezes it)."""
    import peft

    with torch.random.fork_rng(devices=[]):  # PEFT draws from the global RNG
        torch.manual_seed(0)
        model = peft.inject_adapter_in_model(config, model)
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    return model


def train_lockstep(models: dict[str, nn.Module], batches: list[Batch], seed: int,
                   lrs: dict[str, tuple[float, float]], weight_decay: float = 0.0,
                   callback: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, Trainer]:
    """Train every model on the same batches with the shared loop, alternating which goes first each step."""
    trainers = {}
    for name, model in models.items():
        lr_a, lr_h = lrs[name]
        cfg = FinetuneConfig(lr=lr_a, steps=len(batches), batch_size=len(batches[0]), seed=seed,
                             weight_decay=weight_decay)
        trainers[name] = Trainer(model, cfg, len(batches), adapter_optimizer(model.classifier, lr_a, lr_h,
                                                                             weight_decay))
    lockstep(trainers, batches, callback)
    return trainers


def median_step_ms(trainer: Trainer) -> float:
    """Median wall time of one training step in milliseconds, the first (warm-up) step left out."""
    t = trainer.step_times[1:] if len(trainer.step_times) > 1 else trainer.step_times
    return 1e3 * statistics.median(t)
