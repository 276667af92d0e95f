"""Virtual pipeline stages a job can lay out: the check ``bytescale plan`` and the simulator
share, before any work (standard library only)."""

from __future__ import annotations

from .errors import ConfigError


def check_vpp(vpp: int, pp: int, layers_per_stage: int) -> None:
    """Refuse virtual pipeline stages that cannot be laid out, before any work."""
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
        raise ConfigError(f"--vpp {vpp!r}: give a whole number of model chunks per pipeline device >= 1 (1: no VPP)")
    if vpp > 1 and pp <= 1:
        raise ConfigError(
            f"--vpp {vpp} needs pipeline stages: virtual stages interleave a pipeline's chunks; pass --pp > 1 or "
            "--vpp 1"
        )
    if layers_per_stage % vpp:
        raise ConfigError(
            f"--vpp {vpp} does not divide the {layers_per_stage} layers of a pipeline stage into equal chunks; "
            f"use a divisor of {layers_per_stage}"
        )
