"""Benchmarks: KV memory, prefill time and decode time of every method against the full cache.

Each bench is a function that prints markdown tables, writes ``<bench>.json`` and ``<bench>.png``
into ``out`` and returns its results; ``kvcake bench ...`` / ``python -m kvcake.bench ...`` run
them from the command line, and ``scripts/bench_all.sh`` regenerates ``docs/benchmarks.md``.

>>> from kvcake import bench
>>> models = bench.load_models(device=torch.device("cpu"), dtype=torch.float32)
>>> bench.bench_memory(models, lengths=(1024, 2048), out="bench-results")
"""

from .bandwidth import measure as measure_bandwidth
from .bandwidth import run as bench_bandwidth
from .common import (
    BenchCache,
    BenchModels,
    FullCache,
    PeakMemory,
    describe_machine,
    load_models,
    shared_prefill,
)
from .decode import run_decode as bench_decode
from .memory import (
    KVShape,
    cascade_peak_bound,
    compressed_kv_bytes,
    full_kv_bytes,
    layerwise_peak,
    ragged_kv_bytes,
)
from .memory import run as bench_memory
from .speed import run_prefill as bench_prefill

__all__ = [
    "BenchCache",
    "bench_bandwidth",
    "bench_decode",
    "bench_memory",
    "bench_prefill",
    "BenchModels",
    "FullCache",
    "KVShape",
    "PeakMemory",
    "cascade_peak_bound",
    "compressed_kv_bytes",
    "describe_machine",
    "full_kv_bytes",
    "layerwise_peak",
    "load_models",
    "measure_bandwidth",
    "ragged_kv_bytes",
    "shared_prefill",
]
