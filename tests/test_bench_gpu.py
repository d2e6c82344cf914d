"""``kvcake bench gpu`` on the CPU at the tiny shape: the smoke run of the GPU page's command, the
compiled-decode column's three outcomes, the targets' arithmetic and the named shapes."""

from __future__ import annotations

import json

import pytest
import torch

from kvcake import fp8
from kvcake.bench import gpu
from kvcake.bench.cli import main
from kvcake.bench.gpu import (
    CPU_TARGETS,
    FULL_DYNAMIC,
    FULL_STATIC,
    GpuSettings,
    render_page,
    run_gpu,
    targets,
)
from kvcake.bench.shapes import random_model, shape_config
from kvcake.method import PRESETS
from shared_checks import KWARGS_HANDOFF

TINY = dict(shape="tiny", lengths=(64,), budget=40, rounds=1, steps=1)


def test_smoke_run_writes_the_page(tmp_path):
    doc = tmp_path / "docs" / "benchmarks-gpu.md"
    argv = ["gpu", "--device", "cpu", "--shape", "tiny", "--lengths", "96", "--budget", "40", "--rounds", "1",
            "--steps", "1", "--no-compile", "--out", str(tmp_path / "out"), "--doc", str(doc)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((tmp_path / "out" / "gpu.json").read_text())
    names = [r["cache"] for r in result["rows"]]
    assert names == [FULL_DYNAMIC, FULL_STATIC, *PRESETS]  # every preset and the full cache at its best
    rows = {r["cache"]: r for r in result["rows"]}
    assert rows[FULL_DYNAMIC]["prefill_ratio"] == 1.0
    full_kv = rows[FULL_DYNAMIC]["kv_mib"]
    for name in PRESETS:
        assert 0 < rows[name]["kv_mib"] < full_kv, name  # 40 of 96 tokens kept
        assert rows[name]["eager_ms"] > 0 and rows[name]["compiled_ms"] == "n/a (--no-compile)"
    page = doc.read_text()
    assert "python -m kvcake.bench gpu --device cpu --shape tiny" in page
    assert f"torch: {torch.__version__}" in page and "transformers: " in page and "driver: " in page
    assert all(f"| 96 | {name} |" in page for name in PRESETS)
    assert "## Targets" in page
    assert page.startswith("# kvcake on the CPU") and CPU_TARGETS in page  # the GPU targets, read on the CPU
    result["sdpa_backends"] = {int(n): b for n, b in result["sdpa_backends"].items()}  # JSON's keys are text
    on_gpu = render_page(result, {"device": "cuda"})
    assert on_gpu.startswith("# kvcake on a GPU") and CPU_TARGETS not in on_gpu


def test_a_latent_attention_shape_runs_every_preset():
    """``--shape tiny-mla`` (DeepSeek-V3's latent attention, ``kvcake.latent``): every preset and the
    full cache at its best prefill and decode, each preset holding less than the full cache."""
    attention = (
        random_model("tiny-mla", 8, device=torch.device("meta"), dtype=torch.float32)
        .model.layers[0]
        .self_attn
    )
    if not callable(getattr(attention, "expand_kv", None)):
        pytest.skip("this transformers caches latent attention's expanded keys (refused: kvcake.latent)")
    settings = GpuSettings(**{**TINY, "shape": "tiny-mla"}, compile=False)
    result = run_gpu(settings, device=torch.device("cpu"), dtype=torch.float32)
    rows = {r["cache"]: r for r in result["rows"]}
    assert list(rows) == [FULL_DYNAMIC, FULL_STATIC, *PRESETS]
    for name in PRESETS:
        assert 0 < rows[name]["kv_mib"] < rows[FULL_DYNAMIC]["kv_mib"], name  # 40 of 64 tokens kept
        assert rows[name]["eager_ms"] > 0, name


def test_one_command_per_length_merges_into_one_page(tmp_path):
    """``--merge``: a long GPU run split into commands under a time limit still makes one page."""
    doc, out = tmp_path / "page.md", str(tmp_path / "out")
    argv = ["gpu", "--device", "cpu", "--shape", "tiny", "--budget", "40", "--rounds", "1", "--steps", "1",
            "--no-compile", "--methods", "snapkv", "--out", out, "--doc", str(doc)]  # fmt: skip
    assert main([*argv, "--lengths", "96"]) == 0
    with pytest.raises(ValueError, match="differs in budget"):
        main([*argv, "--lengths", "80", "--merge", "--budget", "50"])
    assert main([*argv, "--lengths", "80", "--merge"]) == 0
    merged = json.loads((tmp_path / "out" / "gpu.json").read_text())
    names = [FULL_DYNAMIC, FULL_STATIC, "snapkv"]
    assert [(r["length"], r["cache"]) for r in merged["rows"]] == [(n, c) for n in (80, 96) for c in names]
    page = doc.read_text()
    assert " --lengths 96" in page and " --lengths 80 --merge" in page and "| 80 | snapkv |" in page
    assert "| 96 | snapkv |" in page


@pytest.mark.parametrize("outcome", ["works", "reuses its output", "fails"])
def test_compiled_column(monkeypatch, outcome):
    """A cache that cannot be traced reads 'not compileable'; a compile error is a row entry, not a
    crash. "reuses its output": the step returns one buffer that its next call overwrites, as a
    CUDA graph does; the bench must not feed that buffer back as the next step's token. Each
    cache's step is a code object of its own: dynamo keeps its graphs per code object, so with one
    shared the caches' graphs added up to its recompile limit (12 of 16 failed at the tiny shape)."""
    codes = []

    def fake_compile(fn, **kwargs):
        assert kwargs["fullgraph"] is True
        codes.append(fn.__code__)
        if outcome == "works":
            return fn
        if outcome == "reuses its output":
            out = torch.zeros(1, 1, dtype=torch.long)

            def graph_like(tok, pos, cache):
                if tok.data_ptr() == out.data_ptr():
                    raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")
                out.copy_(fn(tok, pos, cache))
                return out

            return graph_like

        def broken(*args):
            raise RuntimeError("cannot trace this")

        return broken

    monkeypatch.setattr(gpu.torch, "compile", fake_compile)
    result = run_gpu(
        GpuSettings(**TINY, methods=("snapkv",)), device=torch.device("cpu"), dtype=torch.float32
    )
    rows = {r["cache"]: r["compiled_ms"] for r in result["rows"]}
    assert codes and len({id(code) for code in codes}) == len(codes)  # dynamo keys on the object
    assert rows[FULL_DYNAMIC] == "n/a (not compileable)"  # DynamicCache
    for name in (FULL_STATIC, "snapkv"):  # a KVCakeCache decodes in static storage by default
        if name == "snapkv" and not KWARGS_HANDOFF:  # releases whose models keep kwargs from update
            assert rows[name] == "n/a (not compileable)"
            continue
        if outcome != "fails":
            assert isinstance(rows[name], float) and rows[name] > 0
        else:
            assert rows[name] == "n/a (compile failed: RuntimeError)"


def _row(length, cache, prefill_ratio=1.0, eager_ms=10.0, peak_mib=100.0, compiled_ms="n/a (--no-compile)"):
    return dict(length=length, cache=cache, prefill_ratio=prefill_ratio, eager_ms=eager_ms, peak_mib=peak_mib,
                compiled_ms=compiled_ms)  # fmt: skip


def test_targets_arithmetic():
    rows = []
    for n, ms in ((8192, 10.0), (32768, 12.0)):
        rows += [_row(n, FULL_DYNAMIC, eager_ms=ms, peak_mib=1000), _row(n, FULL_STATIC, eager_ms=ms)]
        rows += [_row(n, "snapkv", 1.05, 10.0, 500), _row(n, "adakv", 1.2, 13.0, 560)]
        rows += [_row(n, "cake-oneshot", 1.0, 10.0, 1000)]
    result = dict(settings=dict(methods=["snapkv", "adakv", "cake-oneshot"]), rows=rows)
    checks = targets(result)
    got = {(c["target"], c["length"], c["cache"]): c["ok"] for c in checks}
    assert (
        got["prefill <= 1.10 x full", 32768, "snapkv"] and not got["prefill <= 1.10 x full", 32768, "adakv"]
    )
    assert ("prefill <= 1.10 x full", 8192, "snapkv") not in got  # the prefill target: 32k and 128k
    assert not got["eager decode <= 1.2 x snapkv's", 8192, "adakv"]  # 13 / 10: snapkv holds the same bytes
    assert got["eager decode at 8k <= at 32k", 8192, FULL_DYNAMIC]  # 10 ms at 8k, 12 at 32k
    assert got["eager decode at 8k <= at 32k", 8192, "snapkv"]  # 10 and 10
    assert ("eager decode at 8k <= at 32k", 32768, "snapkv") not in got
    # where both rows have a compiled step, the decode targets compare those
    rows = [_row(n, m, eager_ms=10.0, compiled_ms=c) for n in (8192, 32768)
            for m, c in (("snapkv", 4.0), ("adakv", 4.4 if n == 8192 else 5.0))]  # fmt: skip
    got = {
        (c["target"], c["length"], c["cache"]): c["value"]
        for c in targets(dict(settings=dict(methods=["snapkv", "adakv"]), rows=rows))
    }
    assert got["compiled decode <= 1.2 x snapkv's", 8192, "adakv"] == pytest.approx(1.1)
    assert got["compiled decode at 8k <= at 32k", 8192, "adakv"] == pytest.approx(0.88)
    mem = [c for c in checks if c["target"].startswith("prefill peak")]
    assert {c["cache"]: c["ok"] for c in mem} == {
        "snapkv": True,
        "adakv": False,
    }  # 0.50 and 0.56; one-shot exempt


def test_settings_and_shapes_checked():
    with pytest.raises(ValueError, match="budget"):
        GpuSettings(**{**TINY, "budget": 64})
    with pytest.raises(ValueError, match="unknown"):
        GpuSettings(**TINY, methods=("nope",))
    with pytest.raises(ValueError, match="unknown shape 'llama-9'"):
        shape_config("llama-9", 128)
    # the default shape is Llama-3.1-8B's: 8.03 billion parameters (built on meta: no memory)
    model = random_model("llama-3.1-8b", 128, device=torch.device("meta"), dtype=torch.bfloat16)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.03
    # SmolLM2-135M-Instruct's (kvcake's default model): 134,515,008, as the real one, whose output
    # projection is its embedding (tied; transformers 5.0 does not tie on meta, so it is left out)
    model = random_model("smollm2-135m", 128, device=torch.device("meta"), dtype=torch.bfloat16)
    assert model.config.tie_word_embeddings
    assert sum(p.numel() for n, p in model.named_parameters() if not n.startswith("lm_head.")) == 134_515_008
    # and DeepSeek-V2-Lite's: 15.71 billion (latent attention, MoE)
    model = random_model("deepseek-v2-lite", 128, device=torch.device("meta"), dtype=torch.bfloat16)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 15.71


def test_a_cache_out_of_memory_is_a_row_entry(monkeypatch):
    measure = gpu._Runner.measure

    def oom_for_h2o(self, name):
        if name == "h2o":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return measure(self, name)

    monkeypatch.setattr(gpu._Runner, "measure", oom_for_h2o)
    settings = GpuSettings(**TINY, methods=("h2o", "snapkv"), compile=False)
    result = run_gpu(settings, device=torch.device("cpu"), dtype=torch.float32)
    rows = {r["cache"]: r for r in result["rows"]}
    assert rows["h2o"]["prefill_s"] == "OOM" and isinstance(rows["snapkv"]["prefill_s"], float)
    assert "| 64 | h2o | OOM | OOM |" in gpu.gpu_table(result)
    monkeypatch.setattr(gpu, "PREFILL_LENGTHS", (64,))  # the tiny run's length as a target length
    assert {c["cache"] for c in targets(result)} == {"snapkv"}


def test_machine_description_names_the_library_version_without_installed_metadata(monkeypatch):
    # a GPU run from a copied tree (PYTHONPATH=src) has no kvcake metadata: its page said None
    import importlib.metadata

    from kvcake import __version__
    from kvcake.bench.common import describe_machine

    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    info = describe_machine(torch.device("cpu"), torch.float32, "sdpa")
    assert info["kvcake"] == __version__
    assert info["transformers"] is None  # the others still read metadata


def test_a_float8_row_beside_its_method(monkeypatch):
    """``snapkv+fp8`` is SnapKV with its kept entries in float8 (``kvcake.fp8``): its own row, the
    same entries in a quarter of float32's bytes (without the rings, ``RECENT = 0``: their bytes are
    ``tests/test_fp8.py``'s); ``nope+fp8`` is refused as ``nope`` is."""
    monkeypatch.setattr(fp8, "RECENT", 0)
    settings = GpuSettings(**TINY, methods=("snapkv", "snapkv+fp8"), compile=False)
    result = run_gpu(settings, device=torch.device("cpu"), dtype=torch.float32)
    rows = {r["cache"]: r for r in result["rows"]}
    assert rows["snapkv+fp8"]["kv_mib"] == pytest.approx(rows["snapkv"]["kv_mib"] / 4)
    assert rows["snapkv+fp8"]["eager_ms"] > 0
    with pytest.raises(ValueError, match="unknown"):
        GpuSettings(**TINY, methods=("nope+fp8",))
