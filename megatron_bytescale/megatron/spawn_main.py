"""What a process spawned by the launcher imports as its main module.

Under ``python -m megatron_bytescale.launch pretrain_gpt.py``, multiprocessing's "spawn" start
method (Megatron's torch_dist checkpoint writer starts a ``Manager`` that way,
dist_checkpointing/strategies/filesystem_async.py:55) would re-run the unpatched pretrain_gpt.py
in the child, importing Megatron before anything of ours: on CPU, without triton, that import
fails. The launcher names this module as the main module's spec instead, so a spawned child
gets the CPU backend (nothing on a CUDA machine) and none of the training script. The child
also dies with the rank that spawned it (a rank killed with its launcher leaves no helper behind).
"""

import os

from ..process_lifetime import die_with_launcher
from .pretrain_hooks import install_cpu_backend

die_with_launcher(os.getppid())
install_cpu_backend()
