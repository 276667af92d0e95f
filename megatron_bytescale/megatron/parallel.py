"""Megatron's parallel groups under HDP (design 2.1).

HDP flattens Megatron's DP x CP mesh into one dimension: the HDP group *is* Megatron's
data-parallel group with context parallel (``get_data_parallel_group(with_context_parallel=
True)``), and Megatron's CP size stays 1 because ring attention forms its rings per step
inside that group. TP and PP are Megatron's own. With world = TP x PP x HDP, the HDP group of
a rank holds the ranks with the same TP and PP coordinates, so a ring runs among the HDP ranks
that hold the same attention-head shard (Megatron's default order "tp-cp-ep-dp-pp": TP ranks
are adjacent, e.g. world 4 with TP 2 gives TP groups {0,1},{2,3} and HDP groups {0,2},{1,3}).

Ring members are named by HDP rank (0..hdp_world_size-1); ring_comm translates them to global ranks.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import ConfigError
from . import cpu_compat


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, vpp: int = 1) -> dist.ProcessGroup:
    """Initialise Megatron's model-parallel state (TP x PP, CP 1, expert parallelism ``ep``,
    ``vpp`` virtual pipeline stages per device) on the initialised world and return the HDP
    group. Installs the CPU workarounds when CUDA is absent. EP groups are blocks of ``ep``
    consecutive HDP ranks (planner.expert.slots).

    Calling it again with the same sizes returns the existing group; other sizes are an error
    (call ``destroy_parallel()`` first)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "init_parallel needs an initialised torch.distributed world: call "
            "torch.distributed.init_process_group first (local_world.run_local_world does)"
        )
    if tp < 1 or pp < 1 or ep < 1:
        raise ConfigError(
            f"tensor, pipeline and expert parallel sizes must be at least 1, got tp={tp}, pp={pp}, ep={ep}"
        )
    if vpp < 1 or (vpp > 1 and pp < 2):
        raise ConfigError(f"vpp={vpp} virtual pipeline stages need pp >= 2 (got pp={pp}); use vpp=1 or more stages")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ConfigError(
            f"world size {world} does not divide by tp {tp} x pp {pp}; choose sizes whose product divides {world}"
        )
    cpu_compat.install()
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        )
        if current != (tp, pp, ep, vpp):
            raise ConfigError(
                f"Megatron parallel state is already initialised with tp={current[0]}, pp={current[1]}, "
                f"ep={current[2]}, vpp={current[3]}; "
                f"call destroy_parallel() before init_parallel(tp={tp}, pp={pp}, ep={ep}, vpp={vpp})"
            )
        return hdp_group()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=1,  # HDP forms its rings per step inside the HDP group
        expert_model_parallel_size=ep,
        # a gloo world needs no second set of gloo groups; an NCCL world keeps Megatron's default
        create_gloo_process_groups=dist.get_backend() != "gloo",
    )
    return hdp_group()


def is_initialized() -> bool:
    return parallel_state.model_parallel_is_initialized()


def _require() -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise ConfigError("Megatron parallel state is not initialised: call init_parallel(tp, pp) first")


def hdp_group() -> dist.ProcessGroup:
    """The HDP group: Megatron's data-parallel group with context parallel (DP x CP flattened)."""
    _require()
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def hdp_rank() -> int:
    return dist.get_rank(hdp_group())


def hdp_world_size() -> int:
    return dist.get_world_size(hdp_group())


def pipeline_group() -> dist.ProcessGroup:
    """The stages of this rank's pipeline (Megatron's pipeline-model-parallel group)."""
    _require()
    return parallel_state.get_pipeline_model_parallel_group()


def pipeline_stages() -> int:
    _require()
    return parallel_state.get_pipeline_model_parallel_world_size()


def destroy_parallel() -> None:
    """Forget Megatron's parallel state and RNG tracker (tests; the world itself stays)."""
    from megatron.core.tensor_parallel import random as megatron_random

    parallel_state.destroy_model_parallel()
    megatron_random.initialize_rng_tracker(force_reset=True)
