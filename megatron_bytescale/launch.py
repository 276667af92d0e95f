"""``python -m megatron_bytescale.launch pretrain_gpt.py ...``: see megatron/launch.py."""

import sys

from .megatron.launch import main

if __name__ == "__main__":
    sys.exit(main())
