"""The ``bytescale`` subcommands: each module parses its command line (``add_arguments``),
runs the library code it drives and prints the result (``main(args) -> int``).

Argument parsing and printing live here, above every library package, so the planner, the
simulator, the data loaders and the Megatron glue take values, not flags. A module imports only
the standard library and the base layer at its top; everything else is imported inside ``main``,
so ``bytescale COMMAND --help`` answers without loading numpy, numba, torch or megatron-core.

    demo.py              `bytescale demo`: HDP against the static mesh on 4 CPU processes
    verify.py            `bytescale verify`: HDP on N gloo ranks against one rank
    plan.py              `bytescale plan`: one step's plan as a table
    simulate.py          `bytescale simulate`: the strategies on a simulated cluster
    profile.py           `bytescale profile`: the cost model's coefficients, measured here
    prepare_data.py      `bytescale prepare-data`: a Megatron indexed dataset from files
    dataloader_bench.py  `bytescale dataloader-bench`: planning and delivery time of the loaders
    patches.py           `bytescale patches`: the pretrain_gpt.py patch series for a checkout
"""
