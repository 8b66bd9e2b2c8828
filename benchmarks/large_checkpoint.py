"""Compressing a checkpoint larger than the memory it may use: ``python -m benchmarks.large_checkpoint``.

What it shows: :func:`rankwise.compress.compress_checkpoint` compresses a synthetic Llama-shaped
checkpoint of at least ``--size-gb`` GB (default 2; sharded safetensors, float32, seeded random weights)
in a child process whose memory is capped at ``--cap-fraction`` (default 0.5) of the checkpoint's size,
and measures the child's peak resident set above its post-import baseline (``VmHWM - VmRSS`` after
``import torch, transformers, rankwise``). Goals: it completes under the cap; the peak above the
baseline is at most 0.3x the checkpoint; and, on a small model of the same shape family, the output of
``compress_checkpoint`` is identical (weights and logits) to ``compress(mode="whole")``.

The cap: a cgroup memory limit (``--cap cgroup``): a cgroup v2 scope (``systemd-run --user --scope -p
MemoryMax=...``) where systemd's user manager runs, else a cgroup v1 memory group made for the run
(``memory.limit_in_bytes``, swap included where accounted; needs write access to
``/sys/fs/cgroup/memory``, as root in a container has); the kernel charges everything the child touches,
page cache included, and reclaims or OOM-kills at the limit. ``--cap rlimit`` sets ``RLIMIT_DATA``
instead, which limits *address space* (private writable mappings), not memory in use: the allocator's
arenas and the private mappings torch makes of whole safetensors shards count in full whether touched or
not (seen here: a 1 GB RLIMIT_DATA stopped the 2 GB run when torch could not map one 202 MB shard). ``--cap auto`` (default) tries the
cgroups first. The JSON (``benchmarks/results/large_checkpoint.json``) records which cap ran and, for
cgroup v1, the group's peak charge and how often it hit the limit.

The default shapes (hidden 1024, intermediate 2752, 8 heads, vocabulary 8192, as many blocks as the size
needs: 39 for 2 GB) keep Llama's proportions (intermediate = 2.69 x hidden) and depth: the peak is one
block's working set, so the ratio to the checkpoint falls with the number of blocks (see the memory formula
in ``docs/compress.md``). This is a benchmark for an idle machine (minutes; it writes twice the checkpoint's
size to ``--work-dir``), never a test: ``--smoke`` runs a tiny version without a cap to check the wiring.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PEAK_GOAL = 0.3


def llama_shape(size_gb: float, hidden: int = 1024, intermediate: int = 2752, heads: int = 8, kv_heads: int = 8,
                vocab: int = 8192) -> dict[str, int]:
    """Llama config values with enough blocks for ``size_gb`` GB (1e9 bytes) of float32 weights."""
    head = hidden // heads
    per_block = (2 * hidden * hidden + 2 * hidden * kv_heads * head + 3 * hidden * intermediate + 2 * hidden) * 4
    fixed = (2 * vocab * hidden + hidden) * 4
    layers = max(1, -(-int(size_gb * 1e9 - fixed) // per_block))
    return {"hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "num_hidden_layers": layers}


def memory_estimate(config: dict[str, Any], *, method: str = "swift-svd", tokens: int = 65536, ratio: float = 0.4,
                    param_bytes: int | None = None, act_bytes: int | None = None,
                    measure_error: bool = True) -> dict[str, float]:
    """Peak memory of ``compress_checkpoint`` above the import baseline, by term, from a Llama-style config (bytes).

    The formula of ``docs/compress.md``: ``peak ~ max(N + A, P + rho P + S + F + A)`` with ``P`` one block's
    weights, ``S`` its float64 statistics (all of a block's targets at once), ``F`` the float64 work
    buffers of fitting its largest layer, ``A`` the cached block inputs and outputs (``2 T d`` elements),
    ``N`` the non-block weights (embedding, head). ``param_bytes`` / ``act_bytes`` default to the
    config's dtype (2 for bfloat16/float16, 4 otherwise). ``measure_error`` (``CompressConfig``'s, on by
    default) adds every target's input covariance to ``S``.
    """
    d, f = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * config.get("head_dim", d // heads)
    V, L = config["vocab_size"], config["num_hidden_layers"]
    dtype = str(config.get("torch_dtype", config.get("dtype", "float32")))
    b = param_bytes or (2 if dtype in ("bfloat16", "float16") else 4)
    a = act_bytes or b
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)]  # out x in: q k v o gate up down
    P = b * sum(m * n for m, n in shapes)
    if method.replace("_", "-") in ("swift-svd", "swiftsvd", "swift"):
        # Y^T Y (m x m) where m <= n; a layer wider at the output needs X^T X (n x n) only (R H R^T);
        # X^T X of the others when the error is measured
        S = 8 * sum(n * n if m > n else m * m + (n * n if measure_error else 0) for m, n in shapes)
        F = max(24 * m * n + 16 * n * n if m > n else 24 * m * m for m, n in shapes)  # QR/reduction or eigh
    else:
        S = 8 * sum(n * n for _, n in shapes)  # input covariances (SVD-LLM, ASVD, ...)
        F = max(8 * (3 * n * n + 2 * m * n) for m, n in shapes)  # Cholesky, W S, its SVD
    A = 2 * tokens * d * a
    N = b * ((1 if config.get("tie_word_embeddings") else 2) * V * d + d)
    peak = max(N + A, P + ratio * P + S + F + A)
    return {"block_weights_P": P, "factors_rho_P": ratio * P, "statistics_S": S, "fit_workspace_F": F,
            "activations_A": A, "non_block_N": N, "peak": peak, "checkpoint": b * (L * P / b + N / b)}


def write_checkpoint(path: Path, shape: dict[str, int], seed: int = 0, blocks_per_shard: int = 4) -> int:
    """A ``save_pretrained``-style sharded safetensors Llama checkpoint, written block by block; returns its bytes.

    Weights are ``N(0, 1/fan_in)`` (norms 1) from a seeded generator; memory stays at one shard.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=False)
    cfg = LlamaConfig(**shape, max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(path))
    g = torch.Generator().manual_seed(seed)
    d, f, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * (d // shape["num_attention_heads"])

    def w(m: int, n: int) -> torch.Tensor:
        return torch.randn(m, n, generator=g) / n ** 0.5

    def block(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        return {p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.k_proj.weight": w(kv, d),
                p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, d),
                p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": torch.ones(d),
                p + "post_attention_layernorm.weight": torch.ones(d)}

    n_shards = 1 + -(-L // blocks_per_shard)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(n_shards):
        if s == 0:
            tensors = {"model.embed_tokens.weight": torch.randn(shape["vocab_size"], d, generator=g) * 0.02,
                       "model.norm.weight": torch.ones(d), "lm_head.weight": w(shape["vocab_size"], d)}
        else:
            tensors = {}
            for i in range((s - 1) * blocks_per_shard, min(L, s * blocks_per_shard)):
                tensors.update(block(i))
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({k: name for k in tensors})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _batches(vocab: int, n: int, seq: int, seed: int = 1) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (1, seq), generator=g)} for _ in range(n)]


def _config(method: str, ratio: float) -> Any:
    from rankwise.compress import CompressConfig

    return CompressConfig(method=method, ratio=ratio, allocation="uniform")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """In the capped process: import, note the baseline, compress, note the peak."""
    import gc

    import torch
    from transformers import LlamaForCausalLM  # noqa: F401  (the modelling code belongs to the baseline)

    from rankwise.compress import compress_checkpoint

    torch.set_num_threads(args.threads)
    shape = json.loads(Path(args.ckpt, "config.json").read_text())
    batches = _batches(shape["vocab_size"], args.batches, args.seq)
    gc.collect()
    base = _status_kib("VmRSS")
    base_anon = _status_kib("RssAnon")
    peaks = {"RssAnon": base_anon, "RssFile": _status_kib("RssFile")}
    done = threading.Event()

    def sample() -> None:  # VmHWM has no anonymous-only twin: sample the split every 20 ms
        while not done.wait(0.02):
            for k in peaks:
                peaks[k] = max(peaks[k], _status_kib(k))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        rep = compress_checkpoint(args.ckpt, _config(args.method, args.ratio), batches, args.out)
    finally:
        done.set()
        sampler.join()
    secs = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"baseline_rss_bytes": base * 1024, "peak_rss_bytes": peak * 1024, "peak_above_baseline_bytes":
            (peak - base) * 1024, "baseline_anon_bytes": base_anon * 1024,
            "peak_anon_above_baseline_bytes": (peaks["RssAnon"] - base_anon) * 1024,
            "peak_file_rss_bytes": peaks["RssFile"] * 1024, "seconds": secs, "params_before": rep.params_before,
            "params_after": rep.params_after, "ledger": rep.extra.get("memory")}


def _cgroup_works() -> bool:
    if shutil.which("systemd-run") is None:
        return False
    probe = subprocess.run(["systemd-run", "--user", "--scope", "--quiet", "-p", "MemoryMax=1G", "true"],
                           capture_output=True, text=True)
    return probe.returncode == 0


#: A cgroup v1 memory hierarchy (machines without systemd's user manager, containers that mount it rw).
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def _cgroup_v1_group(cap_bytes: int) -> Path | None:
    """A fresh cgroup v1 memory group limited to ``cap_bytes`` (swap too, where accounted), or None."""
    if not (CGROUP_V1 / "cgroup.procs").is_file() or not os.access(CGROUP_V1, os.W_OK):
        return None
    group = CGROUP_V1 / f"rankwise-bench-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(cap_bytes))
        if (group / "memory.memsw.limit_in_bytes").is_file():  # no escape into swap
            (group / "memory.memsw.limit_in_bytes").write_text(str(cap_bytes))
        (group / "memory.swappiness").write_text("0")
    except OSError:
        _rmdir_quietly(group)
        return None
    return group


def _rmdir_quietly(group: Path) -> None:
    try:
        group.rmdir()  # cgroup directories are removed with rmdir once their processes have exited
    except OSError:
        pass


def run_capped(cmd: list[str], cap_bytes: int | None, how: str) -> tuple[subprocess.CompletedProcess, str, dict]:
    """Run ``cmd`` under a memory cap (``how``: auto / cgroup / rlimit / none).

    Returns the result, the kind of cap and what the cap's accounting saw (cgroup v1: the peak charged
    memory, page cache included, and how often the limit was hit). ``auto`` tries a cgroup v2 scope
    (``systemd-run --user``), then a cgroup v1 memory group, then ``RLIMIT_DATA``.
    """
    if cap_bytes is None or how == "none":
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT), "none", {}
    if how in ("auto", "cgroup") and _cgroup_works():
        wrapped = ["systemd-run", "--user", "--scope", "--quiet", "-p", f"MemoryMax={cap_bytes}",
                   "-p", "MemorySwapMax=0"] + cmd
        return subprocess.run(wrapped, capture_output=True, text=True, cwd=ROOT), "cgroup v2 MemoryMax", {}
    if how in ("auto", "cgroup"):
        group = _cgroup_v1_group(cap_bytes)
        if group is not None:
            procs = str(group / "cgroup.procs")

            def enter() -> None:
                with open(procs, "w") as fh:  # the child joins the group before it execs
                    fh.write(str(os.getpid()))
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, preexec_fn=enter)
                seen = {k: int((group / f"memory.{k}").read_text()) for k in ("max_usage_in_bytes", "failcnt")}
                oom = (group / "memory.oom_control").read_text() if (group / "memory.oom_control").is_file() else ""
                seen["oom_kills"] = next((int(line.split()[1]) for line in oom.splitlines()
                                          if line.startswith("oom_kill ")), 0)
            finally:
                _rmdir_quietly(group)
            return proc, "cgroup v1 memory.limit_in_bytes", seen
    if how == "cgroup":
        raise SystemExit("--cap cgroup: neither systemd-run --user --scope nor a writable cgroup v1 memory "
                         "hierarchy is available here; use --cap rlimit")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, cap_bytes))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, preexec_fn=limit), "RLIMIT_DATA", {}


def _failure(proc: subprocess.CompletedProcess, seen: dict) -> str:
    """Why the capped child failed, in one line (the OOM killer, else the last line that is not a warning)."""
    if seen.get("oom_kills"):
        return f"killed by the cgroup's OOM killer (exit status {proc.returncode})"
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip() and " W" not in ln[:8] and "Warning" not in ln]
    return f"exit status {proc.returncode}: " + (lines[-1][:200] if lines else "no message")


def identical_on_small_model(work: Path, method: str, ratio: float) -> bool:
    """``compress_checkpoint`` and ``compress(mode="whole")`` on a small checkpoint of the same family."""
    import torch
    from transformers import LlamaForCausalLM

    from rankwise.compress import compress, compress_checkpoint, load_compressed

    shape = llama_shape(0.0, hidden=64, intermediate=172, heads=4, kv_heads=4, vocab=128)
    shape["num_hidden_layers"] = 3
    src = work / "small"
    write_checkpoint(src, shape, seed=3, blocks_per_shard=1)
    batches = _batches(shape["vocab_size"], 4, 32, seed=4)
    whole = LlamaForCausalLM.from_pretrained(str(src), local_files_only=True).eval()
    rw = compress(whole, _config(method, ratio), calib=batches, mode="whole")
    rc = compress_checkpoint(src, _config(method, ratio), batches, work / "small-out")
    back = load_compressed(work / "small-out")
    sw, sb = whole.state_dict(), back.state_dict()
    same = rw.ranks == rc.ranks and list(sw) == list(sb) and all(torch.equal(sw[k], sb[k]) for k in sw)
    with torch.no_grad():
        same = same and all(torch.equal(whole(**b).logits, back(**b).logits) for b in batches)
    return bool(same)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.large_checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (1e9 bytes), float32 (2)")
    ap.add_argument("--cap-fraction", type=float, default=0.5, help="memory cap as a fraction of the checkpoint (0.5)")
    ap.add_argument("--cap", choices=("auto", "cgroup", "rlimit", "none"), default="auto")
    ap.add_argument("--method", default="swift-svd")
    ap.add_argument("--ratio", type=float, default=0.4)
    ap.add_argument("--batches", type=int, default=8, help="calibration sequences (8)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (256)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("RANKWISE_BENCH_THREADS", "1")))
    ap.add_argument("--work-dir", type=Path, default=None, help="where the checkpoint and output go (a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--smoke", action="store_true", help="tiny checkpoint, no cap: check the wiring only")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--estimate", type=Path, default=None, metavar="CONFIG_JSON",
                    help="print the memory formula's terms for a checkpoint's config.json (--tokens) and exit")
    ap.add_argument("--tokens", type=int, default=65536, help="calibration tokens for --estimate (65536)")
    ap.add_argument("--child", nargs=3, metavar=("CKPT", "OUT", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.ckpt, args.out, dest = args.child
        Path(dest).write_text(json.dumps(child(args)))
        return 0
    if args.estimate is not None:
        est = memory_estimate(json.loads(args.estimate.read_text()), method=args.method, tokens=args.tokens,
                              ratio=args.ratio)
        for k, v in est.items():
            print(f"  {k:<18} {v / 1e9:9.2f} GB")
        return 0
    if not 0 < args.cap_fraction <= 1:
        ap.error(f"--cap-fraction must be in (0, 1], got {args.cap_fraction}")
    from benchmarks.harness import environment

    env0 = dict(environment(), loadavg_at="start")  # the machine's load, not this run's own
    size_gb = 0.02 if args.smoke else args.size_gb
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rankwise-large-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        shape = llama_shape(size_gb)
        if args.smoke:
            shape = llama_shape(size_gb, hidden=128, intermediate=344, heads=4, kv_heads=4, vocab=512)
        print(f"writing a {size_gb:g} GB Llama-shaped checkpoint {shape} to {work / 'ckpt'} ...", flush=True)
        ckpt_bytes = write_checkpoint(work / "ckpt", shape)
        cap = None if args.smoke else int(args.cap_fraction * ckpt_bytes)
        cmd = [sys.executable, "-m", "benchmarks.large_checkpoint", "--method", args.method, "--ratio", str(args.ratio),
               "--batches", str(args.batches if not args.smoke else 2), "--seq", str(args.seq if not args.smoke else 32),
               "--threads", str(args.threads),
               "--child", str(work / "ckpt"), str(work / "out"), str(work / "child.json")]
        print(f"compressing under a cap of {cap} bytes ...", flush=True)
        proc, kind, seen = run_capped(cmd, cap, "none" if args.smoke else args.cap)
        ok = proc.returncode == 0 and (work / "child.json").is_file()
        res = json.loads((work / "child.json").read_text()) if ok else {}
        same = identical_on_small_model(work, args.method, args.ratio)
        peak_ratio = res["peak_above_baseline_bytes"] / ckpt_bytes if ok else None
        from benchmarks.harness import write_json

        metrics = [
            {"name": "checkpoint size", "value": ckpt_bytes / 1e9, "unit": "GB", "goal": f">= {size_gb:g} GB",
             "met": ckpt_bytes >= size_gb * 1e9},
            {"name": f"completed under a cap of {args.cap_fraction:g} x checkpoint ({kind})",
             "value": "yes" if ok else "no: " + _failure(proc, seen),
             "goal": "yes", "met": ok if cap is not None else None},
            {"name": "peak RSS above the import baseline / checkpoint size",
             "value": peak_ratio if peak_ratio is not None else "-", "goal": f"<= {PEAK_GOAL}",
             "met": None if peak_ratio is None else peak_ratio <= PEAK_GOAL},
            {"name": "output identical to whole-model mode on a small model", "value": "yes" if same else "no",
             "goal": "yes", "met": same},
        ]
        if ok:
            metrics.append({"name": "of which anonymous memory (peak sampled every 20 ms) / checkpoint size",
                            "value": res["peak_anon_above_baseline_bytes"] / ckpt_bytes})
            if seen.get("max_usage_in_bytes"):
                metrics.append({"name": "peak charge of the cgroup (page cache included) / cap",
                                "value": seen["max_usage_in_bytes"] / cap})
            metrics.append({"name": "wall time of compress_checkpoint", "value": res["seconds"], "unit": "s"})
        data = {"benchmark": "large_checkpoint", "smoke": bool(args.smoke), "environment": dict(env0,
                threads=args.threads), "params": {"shape": shape, "method": args.method, "ratio": args.ratio,
                "calibration": f"{args.batches} x {args.seq} tokens", "cap_bytes": cap, "cap_kind": kind,
                "checkpoint_bytes": ckpt_bytes}, "child": res, "cap_accounting": seen, "metrics": metrics}
        out = args.out / "smoke" if args.smoke else args.out
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "large_checkpoint.json", data)
        for m in metrics:
            print(f"  {m['name']}: {m['value']} {m.get('unit', '')}  (goal {m.get('goal', '-')})")
        print(f"wrote {out / 'large_checkpoint.json'}")
        return 0 if ok and same else 1
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
