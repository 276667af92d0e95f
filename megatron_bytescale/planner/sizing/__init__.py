"""Data-aware sharding (design 2.1): ring sizes and offload ratios for long sequences, two-level
groups, and best-fit packing of short ones."""
