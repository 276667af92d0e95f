"""Data: repo-level corpora, Megatron indexed datasets, global batches, and the local and
Ray remote data loaders that deliver each rank's micro-batches of a planned step.

    corpus.py        source trees / text files -> documents (byte chunks)
    tokenizer.py     byte-level tokenizer (ids 0-255, EOD 256, PAD 257)
    indexed.py       documents -> PREFIX.bin/.idx (megatron-core) and the validated reader
    sampler.py       document lengths + seed -> global batches (token budget, context cuts)
    planning.py      stream position -> StepPlan (samples + Plan); Plan -> MicroBatchData
    local_loader.py  every rank plans, reads its own tokens
    ray_loader.py    server actors read, a scheduler actor plans ahead, ranks pull shards
    loader.py        StepLoader: the stepping API both loaders share
    loader_factory.py  make_loader("local" | "ray", ...)
    prepare.py       `bytescale prepare-data`  (the loader benchmark is tools/dataloader_bench.py)

Names are imported on first use, so importing this package stays cheap (no torch, Ray or
megatron-core until a loader or dataset is used).
"""

from importlib import import_module

_EXPORTS = {
    "ByteTokenizer": ".tokenizer",
    "DocumentDataset": ".indexed",
    "write_indexed_dataset": ".indexed",
    "GlobalBatchSampler": ".sampler",
    "Position": ".sampler",
    "Sample": ".sampler",
    "StepBatch": ".planning",
    "StepPlan": ".planning",
    "SamplesDigest": ".planning",
    "LocalDataLoader": ".local_loader",
    "RayDataLoader": ".ray_loader",
    "make_loader": ".loader_factory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
