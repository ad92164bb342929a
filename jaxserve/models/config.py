"""Architecture-neutral model config parsed from a Hugging Face `config.json`.

Every supported family is reduced to one `ModelConfig`: a tuple of per-layer specs (which attention or
linear mixer, which MLP or MoE, which cache group) plus the global sizes. The parsers replicate the
defaults `transformers` applies in each config's `__post_init__`, so a hub `config.json` that omits a
field means the same thing here as there. Errors name the field and the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from .rope import RopeConfigError, RopeSpec, rope_spec, yarn_softmax_mscale


class ConfigError(ValueError):
    """A checkpoint config that cannot be served; the message names the field and the file."""


CacheKind = Literal["full", "sliding", "linear"]


@dataclass(frozen=True)
class GQASpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    rope: RopeSpec | None
    window: int | None = None  # sliding window (attend to the last `window` positions incl. itself)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3 per-head RMSNorm on q and k
    output_gate: bool = False  # Qwen3-Next: q_proj also yields a sigmoid gate on the attention output
    sinks: bool = False  # gpt-oss / MiMo: per-head sink logit in the softmax denominator
    sinks_name: str = "sinks"  # checkpoint name of the sink parameter
    v_scale: float = 1.0  # MiMo: values are multiplied by this

    @property
    def cache_kind(self) -> CacheKind:
        return "sliding" if self.window else "full"


@dataclass(frozen=True)
class MLASpec:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float
    rope: RopeSpec | None  # None: no positional encoding (Kimi Linear's MLA layers)
    attention_bias: bool = False
    cache_kind: CacheKind = "full"


@dataclass(frozen=True)
class GDNSpec:
    """Qwen3-Next Gated DeltaNet (scalar per-head decay)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    cache_kind: CacheKind = "linear"

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class KDASpec:
    """Kimi Delta Attention (per-channel decay)."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    cache_kind: CacheKind = "linear"

    @property
    def conv_dim(self) -> int:
        return 3 * self.num_heads * self.head_dim


@dataclass(frozen=True)
class MLPSpec:
    intermediate_size: int
    bias: bool = False


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    router: Literal["sigmoid_group", "softmax", "topk_softmax"]
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen3-Next: sigmoid gate on the shared expert
    expert_style: Literal["swiglu", "gpt_oss"] = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class LayerSpec:
    mixer: GQASpec | MLASpec | GDNSpec | KDASpec
    mlp: MLPSpec | MoESpec
    mixer_name: str = "self_attn"  # checkpoint module name: self_attn | linear_attn


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    norm_plus_one: bool = False  # Qwen3-Next RMSNorm scales by (1 + weight)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


class _Fields:
    """Reads fields of a config dict with transformers' defaults and aliases; errors name field and file."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def get(self, *names: str, default: Any = None) -> Any:
        for n in names:
            if n in self.d and self.d[n] is not None:
                return self.d[n]
        return default

    def req(self, *names: str) -> Any:
        v = self.get(*names)
        if v is None:
            raise ConfigError(f"{self.source}: required field {names[0]!r} is missing")
        return v

    def fail(self, name: str, msg: str):
        raise ConfigError(f"{self.source}: field {name!r}: {msg}")


def _rope_params(f: _Fields, layer_type: str | None = None, default_theta: float = 10000.0) -> dict:
    rp = f.get("rope_parameters")
    if rp is None:  # transformers < 5 layout: rope_theta + rope_scaling
        rp = dict(f.get("rope_scaling", default={}) or {})
        rp.setdefault("rope_theta", f.get("rope_theta", default=default_theta))
    elif layer_type is not None and layer_type in rp:
        rp = rp[layer_type]
    rp = dict(rp)
    rp.setdefault("rope_theta", f.get("rope_theta", default=default_theta))
    if "partial_rotary_factor" not in rp and f.get("partial_rotary_factor") is not None:
        rp["partial_rotary_factor"] = f.get("partial_rotary_factor")
    return rp


def _rope(f: _Fields, params: dict, head_dim: int, interleave=False, default_partial=1.0) -> RopeSpec:
    try:
        return rope_spec(params, head_dim, int(f.get("max_position_embeddings", default=4096)), interleave,
                         default_partial)
    except RopeConfigError as e:
        raise ConfigError(f"{f.source}: {e}") from None


def _eos(f: _Fields) -> tuple[int, ...]:
    e = f.get("eos_token_id")
    if e is None:
        return ()
    return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


def _base(f: _Fields, layers, **kw) -> ModelConfig:
    return ModelConfig(
        model_type=f.req("model_type"), vocab_size=int(f.req("vocab_size")), hidden_size=int(f.req("hidden_size")),
        layers=tuple(layers), rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        max_position_embeddings=int(f.get("max_position_embeddings", "model_max_length", default=4096)),
        bos_token_id=f.get("bos_token_id"), eos_token_ids=_eos(f), pad_token_id=f.get("pad_token_id"),
        raw=f.d, **kw)


def _check_layer_types(f: _Fields, types: list, n: int, allowed: set[str], name="layer_types") -> list[str]:
    if len(types) != n:
        f.fail(name, f"has {len(types)} entries, expected num_hidden_layers={n}")
    for t in types:
        if t not in allowed:
            f.fail(name, f"unknown entry {t!r}; allowed: {sorted(allowed)}")
    return list(types)


def _dense_gqa(f: _Fields) -> ModelConfig:
    mt = f.req("model_type")
    n = int(f.req("num_hidden_layers"))
    heads = int(f.req("num_attention_heads"))
    kv = int(f.get("num_key_value_heads", default=heads))
    hidden = int(f.req("hidden_size"))
    hd = int(f.get("head_dim", default=hidden // heads))
    if heads % kv:
        f.fail("num_key_value_heads", f"{kv} does not divide num_attention_heads={heads}")
    default_types = ["full_attention"] * n
    if mt == "qwen3" and f.get("use_sliding_window", default=False):
        mwl = int(f.get("max_window_layers", default=n))
        default_types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    types = _check_layer_types(f, f.get("layer_types", default=default_types), n,
                               {"full_attention", "sliding_attention"})
    rope = _rope(f, _rope_params(f), hd)
    bias = bool(f.get("attention_bias", default=False))
    layers = []
    for t in types:
        window = int(f.req("sliding_window")) if t == "sliding_attention" else None
        attn = GQASpec(heads, kv, hd, hd, hd ** -0.5, rope, window=window, qkv_bias=bias,
                       o_bias=bias, qk_norm=mt == "qwen3")
        layers.append(LayerSpec(attn, MLPSpec(int(f.req("intermediate_size")), bool(f.get("mlp_bias", default=False)))))
    return _base(f, layers)


def _deepseek_router_moe(f: _Fields, shared: bool) -> MoESpec:
    n_exp = int(f.req("n_routed_experts", "num_local_experts", "num_experts"))
    moe_i = int(f.req("moe_intermediate_size"))
    n_group = int(f.get("n_group", "num_expert_group", default=1))
    if n_exp % n_group:
        f.fail("n_group", f"{n_group} does not divide the {n_exp} routed experts")
    n_shared = int(f.get("n_shared_experts", "num_shared_experts", default=1)) if shared else 0
    return MoESpec(
        num_experts=n_exp, top_k=int(f.req("num_experts_per_tok", "num_experts_per_token")), intermediate_size=moe_i,
        router="sigmoid_group", norm_topk_prob=bool(f.get("norm_topk_prob", "moe_renormalize", default=True)),
        routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)), n_group=n_group,
        topk_group=int(f.get("topk_group", default=1)), shared_intermediate_size=moe_i * n_shared)


def _mla(f: _Fields, use_rope: bool) -> MLASpec:
    nope, rope_d = int(f.req("qk_nope_head_dim")), int(f.req("qk_rope_head_dim"))
    rp = _rope_params(f)
    scale = (nope + rope_d) ** -0.5
    rope = None
    if use_rope:
        rope = _rope(f, rp, rope_d, interleave=bool(f.get("rope_interleave", default=True)))
        scale *= yarn_softmax_mscale(rp)
    return MLASpec(
        num_heads=int(f.req("num_attention_heads")), q_lora_rank=f.get("q_lora_rank"),
        kv_lora_rank=int(f.req("kv_lora_rank")), qk_nope_head_dim=nope, qk_rope_head_dim=rope_d,
        v_head_dim=int(f.req("v_head_dim")), scale=scale, rope=rope,
        attention_bias=bool(f.get("attention_bias", default=False)))


def _deepseek_v3(f: _Fields) -> ModelConfig:
    n = int(f.req("num_hidden_layers"))
    first_dense = int(f.get("first_k_dense_replace", default=3))
    attn = _mla(f, use_rope=True)
    moe = _deepseek_router_moe(f, shared=True)
    dense = MLPSpec(int(f.req("intermediate_size")))
    return _base(f, [LayerSpec(attn, dense if i < first_dense else moe) for i in range(n)])


def _kimi_linear(f: _Fields) -> ModelConfig:
    n = int(f.req("num_hidden_layers"))
    lin = f.get("linear_attn_config", default={}) or {}
    types = f.get("layer_types")
    if types is None:
        if "full_attn_layers" in lin and "kda_layers" in lin:
            types = [None] * n
            for i in lin["full_attn_layers"]:
                types[i - 1] = "full_attention"
            for i in lin["kda_layers"]:
                types[i - 1] = "linear_attention"
        else:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    types = _check_layer_types(f, types, n, {"full_attention", "linear_attention"})
    mlp_types = f.get("mlp_layer_types")
    if mlp_types is None:
        k = int(f.get("first_k_dense_replace", default=1))
        mlp_types = ["dense" if i < k else "sparse" for i in range(n)]
    mlp_types = _check_layer_types(f, mlp_types, n, {"dense", "sparse"}, "mlp_layer_types")
    kda = KDASpec(num_heads=int(lin.get("num_heads", f.get("linear_num_heads", default=32))),
                  head_dim=int(lin.get("head_dim", f.get("linear_head_dim", default=128))),
                  conv_kernel=int(lin.get("short_conv_kernel_size", f.get("linear_conv_kernel_dim", default=4))))
    mla = _mla(f, use_rope=False)
    moe = _deepseek_router_moe(f, shared=True)
    dense = MLPSpec(int(f.req("intermediate_size")))
    layers = [LayerSpec(mla if t == "full_attention" else kda, moe if m == "sparse" else dense)
              for t, m in zip(types, mlp_types)]
    return _base(f, layers)


def _qwen3_next(f: _Fields) -> ModelConfig:
    n = int(f.req("num_hidden_layers"))
    interval = int(f.get("full_attention_interval", default=4))
    types = f.get("layer_types", default=["linear_attention" if (i + 1) % interval else "full_attention"
                                          for i in range(n)])
    types = _check_layer_types(f, types, n, {"full_attention", "linear_attention"})
    heads, kv = int(f.req("num_attention_heads")), int(f.req("num_key_value_heads"))
    hd = int(f.get("head_dim", default=256))
    rope = _rope(f, _rope_params(f), hd, default_partial=0.25)
    attn = GQASpec(heads, kv, hd, hd, hd ** -0.5, rope, qkv_bias=bool(f.get("attention_bias", default=False)),
                   o_bias=bool(f.get("attention_bias", default=False)), qk_norm=True, output_gate=True)
    gdn = GDNSpec(num_k_heads=int(f.get("linear_num_key_heads", default=16)),
                  num_v_heads=int(f.get("linear_num_value_heads", default=32)),
                  head_k_dim=int(f.get("linear_key_head_dim", default=128)),
                  head_v_dim=int(f.get("linear_value_head_dim", default=128)),
                  conv_kernel=int(f.get("linear_conv_kernel_dim", default=4)))
    if gdn.num_v_heads % gdn.num_k_heads:
        f.fail("linear_num_value_heads", f"{gdn.num_v_heads} is not a multiple of linear_num_key_heads")
    n_exp = int(f.get("num_experts", default=512))
    moe = MoESpec(num_experts=n_exp, top_k=int(f.get("num_experts_per_tok", default=10)),
                  intermediate_size=int(f.get("moe_intermediate_size", default=512)), router="softmax",
                  norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
                  shared_intermediate_size=int(f.get("shared_expert_intermediate_size", default=512)),
                  shared_expert_gate=True)
    dense = MLPSpec(int(f.req("intermediate_size")))
    mlp_only = set(f.get("mlp_only_layers", default=[]))
    step = int(f.get("decoder_sparse_step", default=1))
    layers = []
    for i, t in enumerate(types):
        mlp = moe if (i not in mlp_only and n_exp > 0 and (i + 1) % step == 0) else dense
        layers.append(LayerSpec(attn if t == "full_attention" else gdn, mlp,
                                "self_attn" if t == "full_attention" else "linear_attn"))
    return _base(f, layers, norm_plus_one=True)


def _gpt_oss(f: _Fields) -> ModelConfig:
    n = int(f.req("num_hidden_layers"))
    types = f.get("layer_types", default=["sliding_attention" if (i + 1) % 2 else "full_attention"
                                          for i in range(n)])
    types = _check_layer_types(f, types, n, {"full_attention", "sliding_attention"})
    heads, kv = int(f.req("num_attention_heads")), int(f.req("num_key_value_heads"))
    hd = int(f.get("head_dim", default=64))
    rp = f.get("rope_parameters") or {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096}
    rp = dict(rp)
    rp.setdefault("rope_theta", f.get("rope_theta", default=150000.0))
    rope = _rope(f, rp, hd)
    bias = bool(f.get("attention_bias", default=True))
    moe = MoESpec(num_experts=int(f.req("num_local_experts", "num_experts")),
                  top_k=int(f.req("num_experts_per_tok", "experts_per_token")),
                  intermediate_size=int(f.req("intermediate_size")), router="topk_softmax", expert_style="gpt_oss",
                  swiglu_alpha=float(f.get("swiglu_alpha", default=1.702)),
                  swiglu_limit=float(f.get("swiglu_limit", default=7.0)))
    layers = []
    for t in types:
        window = int(f.get("sliding_window", default=128)) if t == "sliding_attention" else None
        attn = GQASpec(heads, kv, hd, hd, hd ** -0.5, rope, window=window, qkv_bias=bias, o_bias=bias, sinks=True)
        layers.append(LayerSpec(attn, moe))
    return _base(f, layers)


def _mimo_v2_flash(f: _Fields) -> ModelConfig:
    n = int(f.req("num_hidden_layers"))
    types = f.get("layer_types", default=["full_attention" if (i == 0 or not (i + 1) % 6) else "sliding_attention"
                                          for i in range(n)])
    types = _check_layer_types(f, types, n, {"full_attention", "sliding_attention"})
    mlp_types = _check_layer_types(f, f.get("mlp_layer_types", default=["dense"] + ["sparse"] * (n - 1)), n,
                                   {"dense", "sparse"}, "mlp_layer_types")
    heads, kv = int(f.req("num_attention_heads")), int(f.req("num_key_value_heads"))
    hd, vd = int(f.get("head_dim", default=192)), int(f.get("v_head_dim", default=128))
    rps = f.get("rope_parameters") or {
        "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
    window = f.get("sliding_window")
    if window is None:
        window = int(f.d["sliding_window_size"]) + 1 if f.get("sliding_window_size") is not None else 129
    vs = f.get("attention_value_scale", default=0.707)
    bias = bool(f.get("attention_bias", default=False))
    moe = MoESpec(num_experts=int(f.req("n_routed_experts", "num_local_experts")),
                  top_k=int(f.get("num_experts_per_tok", default=8)),
                  intermediate_size=int(f.get("moe_intermediate_size", default=2048)), router="sigmoid_group",
                  norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
                  routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)),
                  n_group=int(f.get("n_group", default=1)), topk_group=int(f.get("topk_group", default=1)))
    dense = MLPSpec(int(f.req("intermediate_size")))
    layers = []
    for t, m in zip(types, mlp_types):
        swa = t == "sliding_attention"
        rp = dict(rps.get(t, rps) if isinstance(rps, dict) else rps)
        rope = _rope(f, rp, hd, default_partial=0.334)
        attn = GQASpec(heads, kv * 2 if swa else kv, hd, vd, hd ** -0.5, rope, window=int(window) if swa else None,
                       qkv_bias=bias, o_bias=False, sinks=swa, sinks_name="attention_sink_bias",
                       v_scale=float(vs) if vs is not None else 1.0)
        layers.append(LayerSpec(attn, moe if m == "sparse" else dense))
    return _base(f, layers)


PARSERS = {
    "llama": _dense_gqa,
    "qwen3": _dense_gqa,
    "deepseek_v3": _deepseek_v3,
    "kimi_linear": _kimi_linear,
    "qwen3_next": _qwen3_next,
    "gpt_oss": _gpt_oss,
    "mimo_v2_flash": _mimo_v2_flash,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(PARSERS))


def parse_config(d: dict, source: str = "config.json") -> ModelConfig:
    f = _Fields(d, source)
    mt = f.get("model_type")
    if mt is None:
        raise ConfigError(f"{source}: required field 'model_type' is missing; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if mt not in PARSERS:
        raise ConfigError(f"{source}: model_type {mt!r} is not supported; supported model types: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return PARSERS[mt](f)


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (a model directory needs config.json)")
    with open(path) as fh:
        try:
            d = json.load(fh)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON: {e}") from None
    return parse_config(d, path)
