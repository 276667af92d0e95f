"""Model and hardware descriptions the cost model is built from.

A model is a Megatron argument file (``configs/models/<name>.args``): the same file a user
passes to ``pretrain_gpt.py`` is the one the planner reads, so the two never disagree.
A hardware spec is a small YAML file (``configs/hardware/<name>.yaml``).
"""

from __future__ import annotations

import argparse
import ast
import shlex
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from ..errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
MODEL_DIR = CONFIG_DIR / "models"
HARDWARE_DIR = CONFIG_DIR / "hardware"


def available(directory: Path, suffix: str) -> list[str]:
    return sorted(p.name[: -len(suffix)] for p in directory.glob(f"*{suffix}"))


def _resolve(name_or_path: str, directory: Path, suffix: str, what: str) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = directory / f"{name_or_path}{suffix}"
    if candidate.is_file():
        return candidate
    raise ConfigError(
        f"unknown {what} {name_or_path!r}: choose one of {', '.join(available(directory, suffix))} "
        f"or give the path of a {suffix} file"
    )


def read_args_file(path: str | Path) -> list[str]:
    """Megatron arguments from a file: one or more per line, ``#`` starts a comment."""
    tokens: list[str] = []
    for line in Path(path).read_text().splitlines():
        tokens.extend(shlex.split(line, comments=True))
    return tokens


# Megatron's multi-latent attention sizes and its defaults (--q-lora-rank None: no query latent)
MLA_DEFAULTS = {
    "--q-lora-rank": None,
    "--kv-lora-rank": 32,
    "--qk-head-dim": 128,
    "--qk-pos-emb-head-dim": 64,
    "--v-head-dim": 128,
}


def moe_layer_count(freq: str | int | list[int], num_layers: int, name: str) -> int:
    """How many of ``num_layers`` layers are MoE under Megatron's ``--moe-layer-freq``: an
    integer k (every k-th layer, from the first) or a pattern such as ``([0]*3+[1]*58)`` (one
    0/1 per layer), read without evaluating code: lists of integers, ``+`` and ``*`` only; or
    the value Megatron's parser already made of it (an int or a list)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    try:
        pattern = value(ast.parse(freq.strip(), mode="eval").body) if isinstance(freq, str) else freq
    except (SyntaxError, ValueError, TypeError):
        raise ConfigError(
            f"model {name!r}: --moe-layer-freq {freq!r}: give an integer or a list pattern like ([0]*3+[1]*58)"
        ) from None
    if isinstance(pattern, int):
        if pattern <= 0:
            raise ConfigError(f"model {name!r}: --moe-layer-freq must be positive, got {pattern}")
        return len(range(0, num_layers, pattern))
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise ConfigError(
            f"model {name!r}: --moe-layer-freq {freq!r} must give one 0 or 1 per layer ({num_layers} layers), "
            f"got {len(pattern)} values"
        )
    return sum(pattern)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # KV heads (GQA); equals num_attention_heads without GQA
    kv_channels: int  # head dimension
    ffn_hidden_size: int
    vocab_size: int
    swiglu: bool = True
    num_experts: int = 0  # 0: dense MLP
    moe_router_topk: int = 1
    moe_ffn_hidden_size: int = 0  # one routed expert's FFN width (0: ffn_hidden_size)
    moe_shared_expert_size: int = 0  # the shared experts' FFN width, all together (0: none)
    dense_layers: int = 0  # layers of a MoE model with a dense MLP of ffn_hidden_size (--moe-layer-freq)
    # multi-latent attention (kv_lora_rank > 0): K and V made from a kv_lora_rank-wide latent
    # plus one shared rotary key; queries of qk_head_dim + qk_pos_emb_head_dim per head, values
    # of v_head_dim (kv_channels is then unused); q_lora_rank 0: queries projected directly
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    mtp_num_layers: int = 0  # multi-token prediction depths: one more transformer layer each

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def k_head_dim(self) -> int:
        """Per head of queries and keys (MLA: the no-rope part and the rotary part)."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.is_mla else self.kv_channels

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.kv_channels

    @property
    def query_size(self) -> int:
        return self.num_attention_heads * self.k_head_dim

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    @property
    def active_experts(self) -> int:
        """MLPs each token passes through (top-k for MoE, one for a dense model)."""
        return self.moe_router_topk if self.num_experts else 1

    @property
    def attention_layers(self) -> int:
        """Transformer layers a token passes through: the model's and one per MTP depth."""
        return self.num_layers + self.mtp_num_layers

    def ring_values_per_token(self, tp: int = 1) -> dict[str, int]:
        """Per ring transport the model may use, the values one token of a ring block holds in
        what travels, per TP rank: K and V (``"kv"``), and for multi-latent attention also the
        latent and rotary key (``"latent"``: the same on every TP rank, whatever the heads)."""
        if not self.is_mla:
            return {"kv": 2 * max(1, self.num_query_groups // tp) * self.kv_channels}
        heads = self.num_attention_heads // tp
        return {"kv": heads * (self.k_head_dim + self.v_dim), "latent": self.kv_lora_rank + self.qk_pos_emb_head_dim}

    @classmethod
    def from_args(cls, argv: list[str], name: str = "custom") -> ModelSpec:
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        parser.add_argument("--num-layers", type=int)
        parser.add_argument("--hidden-size", type=int)
        parser.add_argument("--num-attention-heads", type=int)
        parser.add_argument("--group-query-attention", action="store_true")
        parser.add_argument("--num-query-groups", type=int, default=None)
        parser.add_argument("--kv-channels", type=int, default=None)
        parser.add_argument("--ffn-hidden-size", type=int, default=None)
        parser.add_argument("--swiglu", action="store_true")
        parser.add_argument("--num-experts", type=int, default=0)
        parser.add_argument("--moe-router-topk", type=int, default=2)
        parser.add_argument("--vocab-size", type=int, default=32000)
        parser.add_argument("--moe-ffn-hidden-size", type=int, default=None)
        parser.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
        parser.add_argument("--moe-layer-freq", default="1")
        parser.add_argument("--multi-latent-attention", action="store_true")
        for flag, default in MLA_DEFAULTS.items():
            parser.add_argument(flag, type=int, default=default)
        parser.add_argument("--mtp-num-layers", type=int, default=None)
        try:
            args, _ = parser.parse_known_args(argv)
        except SystemExit:
            raise ConfigError(f"model {name!r}: cannot parse its Megatron arguments {argv}") from None
        for flag in ("num_layers", "hidden_size", "num_attention_heads"):
            if getattr(args, flag) is None:
                raise ConfigError(f"model {name!r}: --{flag.replace('_', '-')} is missing from its arguments")
        heads = args.num_attention_heads
        kv_channels = args.kv_channels
        if kv_channels is None:
            if args.hidden_size % heads:
                raise ConfigError(
                    f"model {name!r}: hidden size {args.hidden_size} does not divide by {heads} heads; add "
                    "--kv-channels"
                )
            kv_channels = args.hidden_size // heads
        groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else heads
        if heads % groups:
            raise ConfigError(f"model {name!r}: {heads} heads do not divide into {groups} query groups")
        ffn = args.ffn_hidden_size or 4 * args.hidden_size
        mla = {}
        if args.multi_latent_attention:
            mla = {f[2:].replace("-", "_"): getattr(args, f[2:].replace("-", "_")) or 0 for f in MLA_DEFAULTS}
            if not mla["kv_lora_rank"]:
                raise ConfigError(f"model {name!r}: --multi-latent-attention needs a positive --kv-lora-rank")
        moe_layers = moe_layer_count(args.moe_layer_freq, args.num_layers, name) if args.num_experts else 0
        spec = cls(
            name=name,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=kv_channels,
            ffn_hidden_size=ffn,
            vocab_size=args.vocab_size,
            swiglu=args.swiglu,
            num_experts=args.num_experts or 0,
            moe_router_topk=args.moe_router_topk if args.num_experts else 1,
            moe_ffn_hidden_size=(args.moe_ffn_hidden_size or 0) if args.num_experts else 0,
            moe_shared_expert_size=(args.moe_shared_expert_intermediate_size or 0) if args.num_experts else 0,
            dense_layers=args.num_layers - moe_layers if args.num_experts else 0,
            mtp_num_layers=args.mtp_num_layers or 0,
            **mla,
        )
        for f in fields(spec):
            value = getattr(spec, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"model {name!r}: {f.name} must not be negative, got {value}")
        return spec

    @classmethod
    def load(cls, name_or_path: str) -> ModelSpec:
        path = _resolve(name_or_path, MODEL_DIR, ".args", "model")
        name = path.name[: -len(".args")] if path.name.endswith(".args") else path.stem
        return cls.from_args(read_args_file(path), name=name)


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_bf16_flops: float
    mfu: float
    memory_bytes: float
    gpus_per_node: int
    bw_intra_node: float
    bw_inter_node: float
    bw_d2h: float
    bw_h2d: float
    p2p_latency_s: float = 2e-5
    layer_overhead_s: float = 1e-4
    # pinned host memory per GPU for offloaded activations (bytes): a share of the node's
    # RAM, since pinned pages cannot be swapped and the OS, the data loader and the
    # optimizer's host state need the rest
    host_memory_bytes: float = 128e9

    @property
    def flops(self) -> float:
        """Achieved FLOP/s in transformer layers."""
        return self.peak_bf16_flops * self.mfu

    @classmethod
    def from_dict(cls, data: dict, source: str = "hardware spec") -> HardwareSpec:
        return cls(**_typed_fields(cls, data, source))

    @classmethod
    def load(cls, name_or_path: str) -> HardwareSpec:
        path = _resolve(name_or_path, HARDWARE_DIR, ".yaml", "hardware")
        return cls.from_dict(load_mapping(path), source=str(path))


def load_mapping(path: str | Path) -> dict:
    """A YAML or JSON file holding one mapping (JSON is YAML); errors name the file."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); give a YAML or JSON file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"{path}: not valid YAML/JSON ({problem}{where}); fix the file or regenerate it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(data).__name__}")
    return data


def _typed_fields(cls, data: dict, source: str) -> dict:
    """Check ``data`` against a dataclass: known fields only, required present, numbers positive."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    out = {}
    for name, f in known.items():
        if name not in data:
            if f.default is f.default_factory:  # both MISSING: required
                raise ConfigError(f"{source}: required field {name!r} is missing")
            continue
        value = data[name]
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind == "str":
            out[name] = str(value)
            continue
        if isinstance(value, str):  # YAML 1.1 reads 1.0e9 (no exponent sign) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: field {name!r} must be a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{source}: field {name!r} must be a finite number, got {value!r}")
        # a bandwidth divides a byte count: zero would be a ZeroDivisionError later
        if value < 0 or (value == 0 and (kind == "int" or name.startswith("bw_"))):
            raise ConfigError(f"{source}: field {name!r} must be positive, got {value!r}")
        if kind == "int":
            if value != int(value):
                raise ConfigError(f"{source}: field {name!r} must be a whole number, got {value!r}")
            value = int(value)
        out[name] = float(value) if kind == "float" else value
    return out
