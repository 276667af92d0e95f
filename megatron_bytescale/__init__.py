"""megatron_bytescale: Hybrid Data Parallelism for long-context Megatron-LM training.

Data flow: ``planner`` (lengths -> Plan) -> ``runtime`` (Plan -> ring attention, offload,
HDP step on torch.distributed) -> ``megatron`` (flags, layer spec, training-loop glue).
``data`` feeds lengths and tokens; ``sim`` costs plans on clusters we do not have.
"""

__version__ = "0.1.0"

# Before anything imports megatron-core: where triton is not installed (the CPU build of torch),
# stand-ins for megatron-core's triton kernel modules, without which megatron.core (0.17+) does
# not import at all (triton_stand_ins.py says which and why).
from . import triton_stand_ins as _triton_stand_ins

_triton_stand_ins.install()
