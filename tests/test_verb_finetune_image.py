"""``rankwise finetune`` on images: VAPT / VPT / LoRA on the zoo's tiny ViT or a user's ViT directory and
``.npz`` data; trains, evaluates, saves, reloads with identical logits; the text path is untouched; bad input.

The zoo's pretrained tiny ViT is swapped for the seconds-long ``smoke`` build in a temporary cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.core.errors import ArtifactError
from rankwise.verbs import finetune_image
from rankwise.verbs.finetune import FinetuneJob, load_finetuned, run_finetune


@pytest.fixture(autouse=True)
def smoke_vit(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setattr(finetune_image, "ZOO_VIT", "smoke")


def _job(**kw) -> FinetuneJob:
    base = dict(task="rot90", steps=2, batch_size=8, limit_train=32, limit_eval=24, eval_every=1)
    base.update(kw)
    return FinetuneJob(**base)


def _npz(path: Path, n: int = 30, size: int = 16, labels=("a", "b", "c"), uint8: bool = False) -> Path:
    g = np.random.default_rng(0)
    images = g.random((n, size, size)).astype(np.float32)
    if uint8:
        images = (images * 255).astype(np.uint8)
    np.savez(path, images=images, labels=np.array([labels[i % len(labels)] for i in range(n)]))
    return path


@pytest.mark.parametrize("method", ["vapt", "vpt-deep", "vpt-shallow", "lora"])
def test_trains_saves_and_reloads_identically(tmp_path, method):
    out = tmp_path / "run"
    res = run_finetune(_job(method=method, out=out, options={"num_prompts": 4} if method != "lora" else {}))
    assert res.reload_max_abs_diff == 0.0 and [h[0] for h in res.history] == [1, 2]
    assert res.adapter_parameters > 0 and res.trainable_parameters > res.adapter_parameters
    meta = json.loads((out / "finetune.json").read_text())
    assert meta["method"] == method and meta["modality"] == "image" and meta["steps_done"] == 2
    assert meta["labels"] == [str(d) for d in range(10)]
    model, tok, _ = load_finetuned(out)
    assert tok is None
    x = torch.rand(3, 1, 16, 16)
    with torch.no_grad():
        a = model(pixel_values=x).logits
        b = load_finetuned(out)[0](pixel_values=x).logits
    assert torch.equal(a, b)
    if method != "lora":
        assert (out / "adapter" / "vapt.safetensors").is_file()
        assert meta["method_config"]["method"] == method


def test_user_vit_directory_and_npz(tmp_path):
    from rankwise import zoo

    vit_dir = tmp_path / "vit"
    zoo.tiny_vit(seed=1, num_labels=3, image_size=16).save_pretrained(str(vit_dir))
    data = _npz(tmp_path / "train.npz", uint8=True)
    res = run_finetune(FinetuneJob(method="vapt", model=vit_dir, data=data, steps=2, batch_size=8,
                                   out=tmp_path / "run", options={"num_prompts": 2}))
    assert res.labels == ["a", "b", "c"] and res.n_eval == 6 and res.reload_max_abs_diff == 0.0
    ev = _npz(tmp_path / "eval.npz", n=9)
    res2 = run_finetune(FinetuneJob(method="lora", model=vit_dir, data=data, eval_data=ev, steps=1, batch_size=8))
    assert res2.n_eval == 9 and res2.out is None


def test_cli_image_run(tmp_path):
    out = tmp_path / "cli"
    r = CliRunner().invoke(app, ["--quiet", "finetune", "--method", "vpt-deep", "--task", "digits5to9", "--steps",
                                 "2", "--limit-train", "16", "--limit-eval", "10", "-o", "num_prompts=2",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "vpt-deep: held-out accuracy" in r.output and "reloaded: held-out logits identical" in r.output
    assert json.loads((out / "finetune.json").read_text())["labels"] == ["5", "6", "7", "8", "9"]


def test_text_path_is_unchanged():
    assert not finetune_image.is_image_job(FinetuneJob(method="lora", task="topic"))
    assert not finetune_image.is_image_job(FinetuneJob(method="lora", data=Path("x.jsonl")))
    assert finetune_image.is_image_job(FinetuneJob(method="lora", task="rot90"))
    assert finetune_image.is_image_job(FinetuneJob(method="vapt"))


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="not an image task"):
        run_finetune(_job(method="vapt", task="topic"))
    with pytest.raises(ValueError, match="give an .npz file"):
        run_finetune(FinetuneJob(method="vapt", data=tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match="kernel_size=9 exceeds"):
        run_finetune(_job(method="vapt", options={"kernel_size": 9}))
    with pytest.raises(ValueError, match="VAPTConfig has no field"):
        run_finetune(_job(method="vapt", options={"bogus": 1}))
    with pytest.raises(ValueError, match="-o method"):
        run_finetune(_job(method="vapt", options={"method": "vpt-deep"}))
    with pytest.raises(ValueError, match="--rank does not apply"):
        run_finetune(_job(method="vapt", rank=4))
    with pytest.raises(ValueError, match="adamw"):
        run_finetune(_job(method="vapt", optimizer="adams"))
    small = _npz(tmp_path / "small.npz", size=8)
    with pytest.raises(ValueError, match="model expects"):
        run_finetune(FinetuneJob(method="vapt", data=small, steps=1))
    np.savez(tmp_path / "nolabels.npz", images=np.zeros((4, 16, 16), dtype=np.float32))
    with pytest.raises(ValueError, match="expected arrays 'images' and 'labels'"):
        run_finetune(FinetuneJob(method="vapt", data=tmp_path / "nolabels.npz", steps=1))
    with pytest.raises(FileNotFoundError):
        run_finetune(FinetuneJob(method="vapt", data=tmp_path / "missing.npz", steps=1))
    from rankwise import zoo

    with pytest.raises(ValueError, match="not an image classifier"):
        d = tmp_path / "llama"
        zoo.tiny_llama().save_pretrained(str(d))
        run_finetune(FinetuneJob(method="vapt", model=d, data=_npz(tmp_path / "d.npz"), steps=1))


def test_reload_refuses_another_backbone(tmp_path):
    out = tmp_path / "run"
    run_finetune(_job(method="vapt", out=out, options={"num_prompts": 2}))
    meta = json.loads((out / "finetune.json").read_text())
    from rankwise import zoo

    other = tmp_path / "other"
    zoo.tiny_vit(seed=5, num_labels=10, image_size=16).save_pretrained(str(other))
    meta["model"] = str(other)
    (out / "finetune.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="different base model"):
        load_finetuned(out)


def test_verb_helpers_import_no_torch_and_agree_with_the_job():
    import subprocess
    import sys

    from rankwise.train import image_job

    assert finetune_image.PROMPT_METHODS == image_job.PROMPT_METHODS
    code = "import sys, rankwise.verbs.finetune_image; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
