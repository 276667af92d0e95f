"""megatron_bytescale: Hybrid Data Parallelism for long-context Megatron-LM training.

Data flow: ``planner`` (lengths -> Plan) -> ``runtime`` (Plan -> ring attention, offload,
HDP step on torch.distributed) -> ``megatron`` (flags, layer spec, training-loop glue).
``data`` feeds lengths and tokens; ``sim`` costs plans on clusters we do not have.
"""

__version__ = "0.1.0"
