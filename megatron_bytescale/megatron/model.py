"""Build megatron-core's GPTModel for HDP from a model args file (or a ModelSpec).

The model is Megatron's own GPTModel, with the HDP layer spec (our ring attention as core
attention) and true-position RoPE. Weights are initialised with Megatron's CPU path
(``use_cpu_initialization``): every rank draws the *full* master weight from a CPU generator
seeded with ``seed`` and keeps its TP shard, so the initial model is the same whatever the
number of HDP ranks, and with TP the shards are slices of the same full weights as TP = 1.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from ..errors import ConfigError
from ..planner.specs import MODEL_DIR, ModelSpec, _resolve, read_args_file
from . import parallel
from .layer_spec import hdp_gpt_layer_spec
from .rotary import use_true_positions

# Megatron's multi-latent attention flags (name, type, Megatron's default): their values go to
# megatron-core's MLATransformerConfig under the same names
MLA_FLAGS = (
    ("--q-lora-rank", int, None),
    ("--kv-lora-rank", int, 32),
    ("--qk-head-dim", int, 128),
    ("--qk-pos-emb-head-dim", int, 64),
    ("--v-head-dim", int, 128),
    ("--rope-type", str, None),
    ("--rotary-scaling-factor", float, 1.0),
    ("--mscale", float, 1.0),
    ("--mscale-all-dim", float, 0.0),
)


@dataclass(frozen=True)
class Architecture:
    """The Megatron flags that shape a GPT beyond ModelSpec's sizes (Megatron's defaults apply
    to an args file; a bare ModelSpec gets the LLaMA-style choices all our configs declare)."""

    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    untie_embeddings: bool = True
    add_bias_linear: bool = False
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    qk_layernorm: bool = False
    # multi-latent attention: (field, value) pairs of megatron-core's MLATransformerConfig; None: not MLA
    mla: tuple[tuple[str, object], ...] | None = None
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1

    @classmethod
    def from_args(cls, argv: list[str], name: str) -> Architecture:
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        parser.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
        parser.add_argument("--norm-epsilon", type=float, default=1e-5)
        parser.add_argument("--position-embedding-type", default="learned_absolute")
        parser.add_argument("--rotary-base", type=int, default=10000)
        parser.add_argument("--rotary-percent", type=float, default=1.0)
        parser.add_argument("--untie-embeddings-and-output-weights", action="store_true")
        parser.add_argument("--disable-bias-linear", action="store_true")
        parser.add_argument("--init-method-std", type=float, default=0.02)
        parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
        parser.add_argument("--qk-layernorm", action="store_true")
        parser.add_argument("--multi-latent-attention", action="store_true")
        for flag, kind, default in MLA_FLAGS:  # Megatron's defaults
            parser.add_argument(flag, type=kind, default=default)
        parser.add_argument("--mtp-num-layers", type=int, default=None)
        parser.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1)
        try:
            args, _ = parser.parse_known_args(argv)
        except SystemExit:
            raise ConfigError(f"model {name!r}: cannot parse its architecture flags {argv}") from None
        mla = None
        if args.multi_latent_attention:
            names = [flag[2:].replace("-", "_") for flag, _, _ in MLA_FLAGS]
            # a rope type left unset keeps megatron-core's default (yarn), as Megatron's arguments do
            mla = tuple((n, getattr(args, n)) for n in names if not (n == "rope_type" and args.rope_type is None))
        return cls(
            normalization=args.normalization,
            norm_epsilon=args.norm_epsilon,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
            untie_embeddings=args.untie_embeddings_and_output_weights,
            add_bias_linear=not args.disable_bias_linear,
            init_method_std=args.init_method_std,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            qk_layernorm=args.qk_layernorm,
            mla=mla,
            mtp_num_layers=args.mtp_num_layers,
            mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        )


def load_model(model: str | Path | ModelSpec) -> tuple[ModelSpec, Architecture]:
    """Sizes and architecture flags of a model name (configs/models), args file or ModelSpec."""
    if isinstance(model, ModelSpec):
        return model, Architecture()
    path = _resolve(str(model), MODEL_DIR, ".args", "model")
    spec = ModelSpec.load(str(path))
    return spec, Architecture.from_args(read_args_file(path), spec.name)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's vocabulary padding (a multiple of ``divisible_by * tp``)."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def transformer_config(
    spec: ModelSpec, arch: Architecture, *, dtype: torch.dtype = torch.float32, hidden_dropout: float = 0.0, **overrides
) -> TransformerConfig:
    """Megatron TransformerConfig for the model on the initialised TP x PP layout."""
    if arch.position_embedding_type != "rope":
        raise ConfigError(
            f"model {spec.name!r} uses position embedding {arch.position_embedding_type!r}; HDP places tokens at "
            "their true positions with RoPE: add --position-embedding-type rope"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if spec.num_attention_heads % tp or (spec.num_query_groups % tp and tp % spec.num_query_groups):
        raise ConfigError(
            f"model {spec.name!r}: {spec.num_attention_heads} heads / {spec.num_query_groups} KV groups "
            f"do not split over tp={tp}; choose a TP size dividing the head count"
        )
    fields = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_epsilon,
        add_bias_linear=arch.add_bias_linear,
        init_method_std=arch.init_method_std,
        hidden_dropout=hidden_dropout,
        attention_dropout=0.0,  # ring attention has none
        num_moe_experts=spec.num_experts or None,
        moe_router_topk=spec.moe_router_topk if spec.num_experts else 2,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=1,
        use_cpu_initialization=True,  # full master weights from a seeded CPU generator, then TP shards
        perform_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,  # dtype of the activations sent between pipeline stages
        cuda_graph_scope=[],  # megatron-core's default ("full") only triggers its own deprecation warning
        qk_layernorm=arch.qk_layernorm,
    )
    if arch.mtp_num_layers:
        fields.update(mtp_num_layers=arch.mtp_num_layers, mtp_loss_scaling_factor=arch.mtp_loss_scaling_factor)
    config_class = TransformerConfig
    if arch.mla is not None:
        fields.update(dict(arch.mla), rotary_base=arch.rotary_base, multi_latent_attention=True)
        fields.update(apply_rope_fusion=False)  # the fused YaRN kernel is triton's (GPUs)
        config_class = MLATransformerConfig
    fields.update(overrides)
    if spec.num_experts and tp > 1 and not fields.get("sequence_parallel"):
        raise ConfigError(
            f"model {spec.name!r}: megatron-core runs MoE with tp={tp} only with sequence parallelism; pass "
            "sequence_parallel=True or use tp=1"
        )
    return config_class(**fields)


def build_gpt_model(
    model: str | Path | ModelSpec,
    *,
    seed: int = 1234,
    dtype: torch.dtype = torch.float32,
    hidden_dropout: float = 0.0,
    max_sequence_length: int = 1 << 21,
    device: str | torch.device = "cpu",
    vp_stage: int | None = None,
    **config_overrides,
) -> GPTModel:
    """Megatron GPTModel (local layer spec + HDP core attention + true-position RoPE) for this
    rank's TP/PP position; needs ``parallel.init_parallel`` first.

    ``model``: a name in configs/models (``"tiny"``), an args file path, or a ModelSpec.
    ``seed`` fixes the initial weights (the same on every HDP rank; TP ranks hold shards of the
    same full weights as TP = 1) and Megatron's dropout RNG streams.
    ``hidden_dropout`` defaults to 0 (Megatron's default is 0.1) so that runs compare exactly.
    ``device``: where the model lives (weights are drawn on the CPU, then moved; "cuda" on a GPU).
    ``config_overrides``: extra TransformerConfig fields.
    ``vp_stage``: with virtual pipeline stages (``parallel.init_parallel(vpp=V)``), the model
    chunk to build (``build_gpt_chunks`` builds all of them).
    With PP > 1 each stage draws only its own layers, so stage weights differ from PP = 1's.
    """
    if not parallel.is_initialized():
        raise ConfigError("build_gpt_model needs Megatron's parallel state: call parallel.init_parallel(tp, pp) first")
    spec, arch = load_model(model)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None:
        if vp_stage is None or not 0 <= vp_stage < vpp:
            raise ConfigError(
                f"the parallel state has {vpp} virtual pipeline stages: build chunk vp_stage in 0..{vpp - 1}"
            )
        config_overrides = {"virtual_pipeline_model_parallel_size": vpp, **config_overrides}
    config = transformer_config(spec, arch, dtype=dtype, hidden_dropout=hidden_dropout, **config_overrides)
    tp = config.tensor_model_parallel_size
    # Dropout streams (Megatron's RNG tracker), then the CPU generator the weights are drawn from.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    layer_spec = hdp_gpt_layer_spec(
        num_experts=spec.num_experts or None,
        normalization=arch.normalization,
        sequence_parallel=config.sequence_parallel,
        num_layers=get_num_layers_to_build(config, vp_stage=vp_stage),
        qk_layernorm=arch.qk_layernorm,
        multi_latent_attention=arch.mla is not None,
    )
    mtp_spec = None
    if arch.mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        from . import mtp

        mtp.install()

        last = layer_spec.layer_specs[-1] if isinstance(layer_spec, TransformerBlockSubmodules) else layer_spec
        mtp_spec = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp_stage)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        mtp_block_spec=mtp_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, arch.make_vocab_size_divisible_by, tp),
        max_sequence_length=max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=not arch.untie_embeddings,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rotary_base,
        vp_stage=vp_stage,
    )
    if vp_stage is not None:
        gpt.vp_stage = vp_stage  # as Megatron's get_model marks its chunks
    return use_true_positions(gpt.to(device))


def build_gpt_chunks(model: str | Path | ModelSpec, **kwargs) -> list[GPTModel]:
    """This device's model chunks under virtual pipeline stages (Megatron's interleaved layout:
    chunk ``c`` holds layer block ``c * PP + stage``), each a ``build_gpt_model``; one model
    without them. ``kwargs``: as for ``build_gpt_model``."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return [build_gpt_model(model, **kwargs)]
    return [build_gpt_model(model, vp_stage=c, **kwargs) for c in range(vpp)]
