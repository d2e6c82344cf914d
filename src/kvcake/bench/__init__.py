"""Benchmarks: KV memory, prefill time and decode time of every method against the full cache.

Each bench is a function that prints markdown tables, writes ``<bench>.json`` and ``<bench>.png``
into ``out`` and returns its results; ``kvcake bench ...`` / ``python -m kvcake.bench ...`` run
them from the command line, and ``scripts/bench_all.sh`` regenerates ``docs/benchmarks.md``.

>>> from kvcake import bench
>>> models = bench.load_models(device=torch.device("cpu"), dtype=torch.float32)
>>> bench.bench_memory(models, lengths=(1024, 2048), out="bench-results")
"""

from typing import TYPE_CHECKING

from kvcake.lazy import lazy_exports

# Each public name and where it is defined, imported on first use: ``kvcake --help`` builds
# ``kvcake bench``'s parser without loading torch.
_EXPORTS = {
    "measure_bandwidth": ".bandwidth:measure",
    "bench_bandwidth": ".bandwidth:run",
    "BenchCache": ".common",
    "BenchModels": ".common",
    "FullCache": ".common",
    "PeakMemory": ".common",
    "describe_machine": ".common",
    "load_models": ".common",
    "shared_prefill": ".common",
    "bench_decode": ".decode:run_decode",
    "KVShape": ".memory",
    "cascade_peak_bound": ".memory",
    "compressed_kv_bytes": ".memory",
    "full_kv_bytes": ".memory",
    "layerwise_peak": ".memory",
    "ragged_kv_bytes": ".memory",
    "bench_memory": ".memory:run",
    "bench_prefill": ".speed:run_prefill",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and editors
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
