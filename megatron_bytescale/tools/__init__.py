"""Tools on top of the core packages: they measure or drive the layers below and nothing
below imports them.

    profiler.py          `bytescale profile`: the cost model's coefficients, measured
    layer_stack.py       stacks of transformer layers of a model's shape (megatron-core or torch)
    offload_bench.py     memory saved and time kept by activation offloading (scripts/gpu/check_offload.py)
    dataloader_bench.py  `bytescale dataloader-bench`: planning and delivery time of the loaders
"""
