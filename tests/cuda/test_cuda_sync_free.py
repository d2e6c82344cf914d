"""Static decode steps never synchronise with the GPU, for every preset.

``torch.cuda.set_sync_debug_mode("error")`` turns every host synchronisation (``.item()``,
``.cpu()``, a blocking copy, a data-dependent shape such as ``nonzero``) into an error. The
first decode step moves each layer into its buffers (``kvcake.step``) and may synchronise; the steps
after it must not. On the CPU (``KVCAKE_TEST_DEVICE=cpu``) the mode does not apply, and
tests/test_static.py counts host reads instead.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from cuda_helpers import DEVICE, ids

import kvcake
from kvcake import PRESETS, KVCakeCache, make_method
from kvcake.adapters import with_cache


@contextlib.contextmanager
def _sync_errors():
    if DEVICE.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", list(PRESETS))
def test_static_decode_steps_do_not_synchronise(on_device, name):
    model = on_device(torch.bfloat16)
    prompt = ids(200, seed=3).to(DEVICE)
    cache = KVCakeCache(model, make_method(name, budget=40, window=8), static=True)
    with kvcake.enable(model), torch.no_grad():
        tok = model(prompt, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
        tok = model(tok, **with_cache(model, cache)).logits[:, -1:].argmax(-1)  # into the buffers
        assert all(cache.layers[lid].static is not None for lid in cache.compressed)
        with _sync_errors():
            for _ in range(4):
                tok = model(tok, **with_cache(model, cache)).logits[:, -1:].argmax(-1)
    assert cache.get_seq_length() == 205  # the 200-token prompt and 5 single-token steps


def test_a_host_read_waits_for_its_copy_only(on_device):
    # CAKE's statistics are read one layer later (cascade.prefill_stage): starting the read must
    # not synchronise, and the host copy holds the values once waited for
    from kvcake.devices import HostRead

    x = torch.randn(64, 1024, device=DEVICE)
    stats = torch.stack([x.sum(), x.square().sum()]).double()
    with _sync_errors():
        read = HostRead(stats)
        for _ in range(8):  # more work queued behind the copy
            x = x @ x.T / 32
    host = read.wait()
    assert host.device.type == "cpu"
    assert torch.equal(host, stats.cpu())


def _same_either_way(on_device, monkeypatch, module, flag: str, name: str) -> KVCakeCache:
    """A prefill with ``module.flag`` False (the reference) and True: the same entries at every
    stage and the same logits. The second cache."""
    model = on_device(torch.bfloat16)
    prompt = ids(300, seed=2).to(DEVICE)
    runs = []
    for value in (False, True):
        monkeypatch.setattr(module, flag, value)
        cache = KVCakeCache(model, make_method(name, budget=48, window=8), record=True)
        with kvcake.enable(model), torch.no_grad():
            logits = model(prompt, **with_cache(model, cache)).logits[:, -1]
        runs.append((cache, logits))
    (ref, ref_logits), (got, logits) = runs
    assert torch.equal(logits, ref_logits)
    assert len(got.history) == len(ref.history)
    for (sa, la, pa), (sb, lb, pb) in zip(got.history, ref.history, strict=True):
        assert (sa, la) == (sb, lb) and torch.equal(pa, pb)
    return got


@pytest.mark.parametrize("name", ["adakv", "cake-adakv", "critical-adakv", "layer-defensivekv"])
def test_head_counts_on_the_host_equal_the_device(on_device, monkeypatch, name):
    # Ada-KV's counts from each layer's score places read through HostRead (head_counts.HOST_COUNTS)
    # keep the entries of counting on the device at every stage (the reference), on a GPU too,
    # where the copy is a pinned, non-blocking one waited for a layer later
    from kvcake import head_counts

    assert not _same_either_way(on_device, monkeypatch, head_counts, "HOST_COUNTS", name).head_places


@pytest.mark.parametrize("name", ["criticalkv", "layers=pyramid,heads=uniform,score=snapkv,select=critical"])
def test_value_norms_read_a_layer_later_equal_read_at_once(on_device, monkeypatch, name):
    # CriticalKV's candidate-set size copied through HostRead and waited for at the next layer's
    # update (pending_norms.DEFERRED) keeps the entries of reading it at once, on a GPU too
    from kvcake import pending_norms

    assert _same_either_way(on_device, monkeypatch, pending_norms, "DEFERRED", name).pending_norms is None
