"""``rankwise merge``: PEFT-trained adapters -> rankwise merge -> PEFT loads the result; bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rankwise import cli, zoo
from rankwise.adapt.lora import import_peft
from rankwise.merge import CtMConfig, MergeConfig, ctm_merge, mtc_merge

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
TARGETS = ["q_proj", "v_proj"]


def _train_peft_adapter(out: Path, seed: int, *, hidden: int = 64, targets=TARGETS, steps: int = 3) -> Path:
    """A LoRA trained with PEFT for a few steps on seeded random tokens, saved with save_pretrained."""
    import peft

    base = zoo.tiny_llama(seed=0, hidden_size=hidden)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def peft_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("peft_adapters")
    return [_train_peft_adapter(root / f"task{i}", seed=i) for i in range(3)]


def invoke(*args: str):
    return CliRunner().invoke(cli.app, [str(a) for a in args], env=ENV)


@pytest.mark.parametrize("method", ["ctm", "ties"])
def test_round_trip_peft_to_peft(peft_dirs: list[Path], tmp_path: Path, method: str):
    import peft

    out = tmp_path / "merged"
    res = invoke("merge", "--method", method, "--rank", "4", *peft_dirs, "--out", out)
    assert res.exit_code == 0, res.output
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()

    states = [import_peft(d) for d in peft_dirs]
    ours = ctm_merge(states, CtMConfig(rank=4)) if method == "ctm" else mtc_merge(states, MergeConfig(rank=4, rule="ties"))
    loaded = peft.PeftModel.from_pretrained(zoo.tiny_llama(seed=0), out)
    layers = {n: m for n, m in loaded.base_model.model.named_modules() if hasattr(m, "get_delta_weight")}
    assert set(layers) == set(ours.modules())
    for name, layer in layers.items():
        assert layer.r["default"] == 4
        theirs = layer.get_delta_weight("default")
        mine = ours.delta_weight(name)
        assert float(mine.norm()) > 0
        assert torch.allclose(theirs, mine, rtol=1e-5, atol=1e-7), name
    # the merged adapter changes the model's outputs
    ids = torch.arange(16)[None]
    with torch.no_grad():
        with loaded.disable_adapter():
            base_logits = loaded(input_ids=ids).logits
        merged_logits = loaded(input_ids=ids).logits
    assert not torch.allclose(base_logits, merged_logits)


def test_single_adapter_ta_reproduces_it(peft_dirs: list[Path], tmp_path: Path):
    out = tmp_path / "one"
    res = invoke("merge", "--method", "ctm", "--rule", "ta", "--scale", "1", "--rank", "4", peft_dirs[0], "--out", out)
    assert res.exit_code == 0, res.output
    a, b = import_peft(peft_dirs[0]), import_peft(out)
    for m in a.modules():
        assert torch.allclose(b.delta_weight(m), a.delta_weight(m), rtol=1e-4, atol=1e-6)


def test_bad_inputs_exit_2_and_write_nothing(peft_dirs: list[Path], tmp_path: Path):
    other_base = _train_peft_adapter(tmp_path / "wide", seed=5, hidden=32, steps=1)
    other_mods = _train_peft_adapter(tmp_path / "qk", seed=6, targets=["q_proj", "k_proj"], steps=1)
    cases = [
        (["--rank", "4", peft_dirs[0], other_base], "shape"),
        (["--rank", "4", peft_dirs[0], other_mods], "different modules"),
        (["--rank", "0", *peft_dirs], "rank"),
        (["--rank", "-2", *peft_dirs], "rank"),
        (["--rank", "13", *peft_dirs], "R = "),
        (["--rank", "4", "--method", "nope", *peft_dirs], "--method"),
        (["--rank", "4", "--method", "ties", "--rule", "ta", *peft_dirs], "fixes the rule"),
        (["--rank", "4", "--beta", "2", *peft_dirs], "beta"),
        (["--rank", "4", peft_dirs[0], tmp_path / "missing"], "no such adapter directory"),
    ]
    for i, (args, msg) in enumerate(cases):
        out = tmp_path / f"out{i}"
        res = invoke("merge", *args, "--out", out)
        assert res.exit_code == 2, (args, res.output)
        assert msg in res.output, (args, res.output)
        assert not out.exists()
    # an existing non-empty output is kept unless --overwrite
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    res = invoke("merge", "--rank", "4", *peft_dirs, "--out", keep)
    assert res.exit_code == 2 and (keep / "notes.txt").read_text() == "mine"


def test_help_lists_match_the_merge_registry() -> None:
    """`rankwise merge --help` names methods and rules from static lists (no torch at start-up): they
    must be the registry's."""
    from rankwise.merge import RULES, merge_methods
    from rankwise.merge.dirs import METHODS
    from rankwise.verbs import merge as verb

    assert verb.HELP_METHODS == tuple(METHODS)
    assert verb.HELP_RULES == tuple(RULES)
    assert verb.HELP_FREE_RULE == tuple(n for n, m in merge_methods().items() if "rule" not in m.fixed)
