"""ModelConfig: every decoder-only variant gptkit builds, as one typed dataclass, plus named presets; and a run's
model section (a preset or a model to start from, plus overrides) resolved into one."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from gptkit.errors import ConfigError
from gptkit.presets import PRESETS, RENAMED

logger = logging.getLogger(__name__)

# relu2: relu(x)^2 (Primer); geglu: GELU(tanh)(x W_gate) * (x W_up) (Gemma), swiglu with SiLU (Llama)
Activation = Literal["relu", "relu2", "gelu", "gelu_tanh", "swiglu", "geglu"]
Norm = Literal["layernorm", "rmsnorm"]
# pre: x + f(norm(x)); post: norm(x + f(x)); sandwich: x + norm_post(f(norm(x))) (Gemma 2/3);
# sublayer_post: x + norm(f(x)) (OLMo 2)
NormPosition = Literal["pre", "post", "sandwich", "sublayer_post"]
Position = Literal["learned", "sinusoidal", "rope", "none"]
LayerType = Literal["full", "sliding"]
QKNormScope = Literal["head", "width"]
RopeType = Literal["linear", "dynamic", "llama3", "yarn", "longrope"]

# Fields whose None is a setting of its own (not a default resolved in __post_init__).
NULLABLE = frozenset(
    {"logit_softcap", "rope_scaling", "rope_local_theta", "sliding_window", "layer_types", "nope_layers"}
    | {"embedding_scale", "attn_scale", "attn_softcap"}
    | {"n_experts", "moe_ffn_hidden", "moe_shared_hidden", "moe_dense_layers"}  # mixture of experts (issue 55)
)
# Scales and bases that must be > 0 where set.
POSITIVE = ("rope_local_theta", "embedding_scale", "residual_scale", "attn_scale", "attn_softcap", "logit_scale")
# Activations whose fc holds [gate; up]: two products of ffn_hidden columns each.
GATED = frozenset({"swiglu", "geglu"})

# SwiGLU's hidden size is 8/3 of the width (Shazeer 2020 keeps the FFN's parameter count equal
# to a 4x MLP); rounded up to this multiple so that matmuls stay aligned.
SWIGLU_MULTIPLE = 64

# Each rope_type's required parameters (HF's names, as transformers.modeling_rope_utils reads them).
ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}

ROPE_FLOATS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling rule: rope_type plus HF's parameters for it (gptkit.positions computes the frequencies)."""

    rope_type: RopeType
    factor: float | None = None  # how many times the trained context the positions stretch to
    original_max_position_embeddings: int | None = None  # the context the model was pretrained at
    low_freq_factor: float | None = None  # llama3: wavelengths above original / low_freq_factor are divided by factor
    high_freq_factor: float | None = None  # llama3: wavelengths below original / high_freq_factor are kept
    beta_fast: float | None = None  # yarn: rotations where the ramp ends (HF's default 32)
    beta_slow: float | None = None  # yarn: rotations where the ramp starts (HF's default 1)
    attention_factor: float | None = None  # yarn, longrope: cos and sin scaled by this; None derives it from factor
    mscale: float | None = None  # yarn: DeepSeek's numerator scale of the derived attention factor
    mscale_all_dim: float | None = None  # yarn: its denominator scale
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors within the original context
    long_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors past it
    truncate: bool | None = None  # yarn: round the ramp's ends to whole dimensions (HF's default true)

    @classmethod
    def from_dict(cls, data: Any) -> RopeScaling:
        """Build from an HF-style dict {"rope_type": ..., parameters}; a wrong key or value is a ConfigError."""
        if not isinstance(data, dict):
            raise ConfigError(f"rope_scaling must be a mapping with a rope_type, got {data!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown rope_scaling field {unknown[0]!r}; known fields: {', '.join(sorted(known))}")
        if data.get("rope_type") not in ROPE_REQUIRED:
            choices = ", ".join(ROPE_REQUIRED)
            raise ConfigError(f"rope_scaling.rope_type must be one of {choices}; got {data.get('rope_type')!r}")
        values = dict(data)
        for name in ROPE_FLOATS:
            if _is_number(values.get(name)):
                values[name] = float(values[name])  # 8 and 8.0 read back alike from JSON
        for name in ("short_factor", "long_factor"):
            if values.get(name) is not None:
                if not isinstance(values[name], (list, tuple)) or not all(_is_number(v) for v in values[name]):
                    raise ConfigError(f"rope_scaling.{name} must be a list of numbers, got {values[name]!r}")
                values[name] = tuple(float(v) for v in values[name])
        scaling = cls(**values)
        scaling.validate()
        return scaling

    def validate(self) -> None:
        """Raise ConfigError naming the first missing or invalid parameter."""
        for name in ROPE_REQUIRED[self.rope_type]:
            if getattr(self, name) is None:
                raise ConfigError(f"rope_scaling.{name} is required for rope_type {self.rope_type}")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("rope_type", "short_factor", "long_factor"):
                continue
            if f.name == "truncate":
                if not isinstance(value, bool):
                    raise ConfigError(f"rope_scaling.truncate must be true or false, got {value!r}")
            elif not _is_number(value) or not 0 < value < math.inf:
                raise ConfigError(f"rope_scaling.{f.name} must be a positive number, got {value!r}")
        original = self.original_max_position_embeddings
        if original is not None and not isinstance(original, int):
            raise ConfigError(f"rope_scaling.original_max_position_embeddings must be an integer, got {original!r}")
        if self.rope_type == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ConfigError("rope_scaling.low_freq_factor must be below high_freq_factor")

    def to_dict(self) -> dict[str, Any]:
        """HF's form: rope_type and the parameters that are set, lists for the longrope factors."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class ModelConfig:
    """Shape and architecture of a decoder-only transformer (docs/spec.md section 1). Defaults are GPT-2 small."""

    vocab_size: int = 50257  # token ids the model reads and predicts (a run takes it from the data's meta.json)
    block_size: int = 1024  # maximum context the model is trained for
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block (query heads)
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None means n_head (multi-head)
    n_embd: int = 768  # width of the residual stream (each head is n_embd / n_head wide)
    ffn_hidden: int | None = None  # the MLP's inner width; None means 4*n_embd, or 8/3*n_embd rounded for swiglu
    activation: Activation = "gelu_tanh"  # the MLP's nonlinearity (gelu is exact GELU, gelu_tanh its approximation)
    norm: Norm = "layernorm"  # layernorm or rmsnorm
    norm_eps: float = 1e-5  # added to the variance inside each norm
    norm_position: NormPosition = "pre"  # pre: norm before attention and MLP (GPT-2); post: after the residual add
    position: Position = "learned"  # learned table, fixed sinusoids, rope (rotary), or none
    rope_theta: float = 10000.0  # rope: base of the rotary frequencies
    attn_bias: bool = True  # biases in the q/k/v and output projections
    mlp_bias: bool = True  # biases in the MLP's two (or three) projections
    norm_bias: bool = True  # LayerNorm's shift; RMSNorm has none
    lm_head_bias: bool = False  # a bias on the output logits
    tie_embeddings: bool = True  # the LM head shares the token embedding's weights
    dropout: float = 0.0  # dropout probability on attention, residual and embedding outputs while training
    qk_norm: bool = False  # RMSNorm with a learned gain over head_dim on each head's q and k, before RoPE (Qwen3)
    logit_softcap: float | None = None  # logits = c * tanh(z / c) (Gemma 2's final-logit soft-cap); None: raw z
    zero_init_proj: bool = False  # the residual output projections (attn.proj, mlp.proj) start at zero
    vocab_multiple: int = 1  # embedding and LM head rows rounded up to a multiple of this (padded_vocab_size)
    # The model families' switches (gptkit issue 54); each default leaves the model as above.
    head_dim: int | None = None  # width of one head; None means n_embd // n_head (q, k, v are n_head * head_dim wide)
    rotary_dim: int | None = None  # RoPE rotates each head's first rotary_dim dims (partial rotary); None: head_dim
    rope_scaling: RopeScaling | None = None  # a RoPE scaling rule (linear, dynamic, llama3, yarn, longrope)
    rope_local_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3); None: rope_theta
    sliding_window: int | None = None  # W: a windowed layer's query i attends keys j with i - W < j <= i
    layer_types: list[LayerType] | None = None  # per layer full or sliding; None: all sliding with a window, else full
    nope_layers: list[int] | None = None  # layers that apply no RoPE (SmolLM3)
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX)
    norm_gain_offset: float = 0.0  # RMSNorm multiplies by (offset + w) (Gemma: 1, its w starting at 0)
    embedding_scale: float | None = None  # token embeddings times this (Gemma sqrt(n_embd), Granite)
    residual_scale: float = 1.0  # each sublayer's output times this before its residual add (Granite)
    attn_scale: float | None = None  # the attention score scale; None means 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) before the mask (Gemma 2)
    logit_scale: float = 1.0  # logits times this before logit_softcap (Granite: 1 / logits_scaling)
    qk_norm_scope: QKNormScope = "head"  # qk_norm over each head's head_dim (Qwen3) or q's and k's whole width (OLMo 2)
    # Mixture of experts (gptkit issue 55, gptkit.moe): n_experts None keeps every feed-forward dense.
    n_experts: int | None = None  # E expert MLPs in each MoE layer, a linear router choosing among them
    n_experts_per_token: int = 2  # k: each token's output sums its top-k experts' outputs, weighted by the router
    moe_ffn_hidden: int | None = None  # each expert's hidden size (HF's moe_intermediate_size); None: ffn_hidden
    moe_renormalize: bool = True  # top-k weights divided by their sum (Mixtral, Qwen3-MoE); false: softmax's own
    moe_shared_hidden: int | None = None  # hidden size of a shared expert every token passes (Qwen2-MoE); None: none
    moe_shared_gate: bool = False  # the shared expert's output times sigmoid(x w) (Qwen2-MoE)
    moe_layer_step: int = 1  # layers i with (i + 1) % step == 0 are MoE (Qwen2-MoE's decoder_sparse_step)
    moe_dense_layers: list[int] | None = None  # layers kept dense (Qwen2-MoE's mlp_only_layers)
    moe_aux_loss: float = 0.0  # Switch Transformer load-balancing loss coefficient (alpha), added when training
    moe_z_loss: float = 0.0  # router z-loss coefficient (ST-MoE: mean logsumexp(router logits)^2), when training

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None and isinstance(self.n_embd, int) and isinstance(self.n_head, int) and self.n_head > 0:
            if self.n_embd % self.n_head:
                raise ConfigError(
                    f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}), or head_dim must be set"
                )
            self.head_dim = self.n_embd // self.n_head
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling.from_dict(self.rope_scaling)
        if isinstance(self.layer_types, tuple):
            self.layer_types = list(self.layer_types)
        if isinstance(self.nope_layers, tuple):
            self.nope_layers = list(self.nope_layers)
        if self.ffn_hidden is None:
            if self.activation in GATED:
                hidden = math.ceil(8 * self.n_embd / 3)
                self.ffn_hidden = SWIGLU_MULTIPLE * math.ceil(hidden / SWIGLU_MULTIPLE)
            else:
                self.ffn_hidden = 4 * self.n_embd
        self.validate()

    def layer_window(self, index: int) -> int | None:
        """Layer index's attention window W (its query i attends keys i - W < j <= i), or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[index] == "sliding":
            return self.sliding_window
        return None

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the LM head: vocab_size rounded up to vocab_multiple (GPT-2's 50257 -> 50304 at
        64, for faster GPU products). The rows past vocab_size are never looked up, never in a softmax."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def validate(self) -> None:
        """Raise ConfigError (a ValueError) naming the first field whose value is invalid."""
        for name, expected in _field_types().items():
            value = getattr(self, name)
            if value is None and name in NULLABLE:
                continue
            if expected is bool:
                if not isinstance(value, bool):
                    raise ConfigError(f"{name} must be true or false, got {value!r}")
            elif expected is int:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"{name} must be an integer, got {value!r}")
                if value < 1:
                    raise ConfigError(f"{name} must be >= 1, got {value}")
            elif expected is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ConfigError(f"{name} must be a finite number, got {value!r}")
                setattr(self, name, float(value))
            elif expected is RopeScaling:
                if not isinstance(value, RopeScaling):
                    raise ConfigError(f"rope_scaling must be a mapping with a rope_type (or null), got {value!r}")
                value.validate()
            elif get_origin(expected) is list:
                self._validate_list(name, value, get_args(expected)[0])
            else:
                choices = get_args(expected)
                if value not in choices:
                    raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        self._validate_families()
        self._validate_experts()
        if self.position == "sinusoidal" and self.n_embd % 2:
            raise ConfigError(f"position sinusoidal needs an even n_embd, got {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be > 0, got {self.norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.logit_softcap is not None and not 0 < self.logit_softcap < math.inf:
            raise ConfigError(f"logit_softcap must be > 0 and finite (or null for none), got {self.logit_softcap}")

    def _validate_list(self, name: str, value: Any, item: Any) -> None:
        """layer_types (one full or sliding per layer) and nope_layers (layer indices)."""
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list (or null), got {value!r}")
        for entry in value:
            if item is int and (isinstance(entry, bool) or not isinstance(entry, int) or not 0 <= entry < self.n_layer):
                raise ConfigError(f"{name} must hold layer indices in [0, {self.n_layer}), got {entry!r}")
            if item is not int and entry not in get_args(item):
                raise ConfigError(f"{name} entries must be one of {', '.join(get_args(item))}; got {entry!r}")
        if name == "layer_types" and len(value) != self.n_layer:
            raise ConfigError(f"layer_types must name one type per layer; got {len(value)} for n_layer {self.n_layer}")

    def _validate_families(self) -> None:
        """The checks between fields: rotary width, windows, scales and which switches combine."""
        if self.position == "rope" and (self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise ConfigError(
                f"position rope needs an even rotary_dim of at most head_dim {self.head_dim}; got {self.rotary_dim}"
            )
        if self.position != "rope":
            for name in ("rope_scaling", "rope_local_theta", "nope_layers"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} applies to position rope only; unset it or set position: rope")
        if self.layer_types is not None and "sliding" in self.layer_types and self.sliding_window is None:
            raise ConfigError("layer_types has sliding layers but sliding_window is not set; set sliding_window")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(self.rope_scaling, name)) != self.rotary_dim // 2:
                    raise ConfigError(f"rope_scaling.{name} must hold rotary_dim / 2 = {self.rotary_dim // 2} numbers")
        for name in POSITIVE:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        if self.parallel_residual and self.norm_position == "post":
            raise ConfigError("parallel_residual needs norm_position pre, sandwich or sublayer_post, not post")

    def _validate_experts(self) -> None:
        """The mixture-of-experts fields: k within E, non-negative loss coefficients, settings that need experts."""
        if self.n_experts is None:
            moe_only = ("moe_ffn_hidden", "moe_shared_hidden", "moe_dense_layers")
            if any(getattr(self, name) is not None for name in moe_only) or self.moe_shared_gate:
                raise ConfigError("the moe_* settings need n_experts; set n_experts or unset them")
            return
        if self.n_experts_per_token > self.n_experts:
            raise ConfigError(
                f"n_experts_per_token ({self.n_experts_per_token}) must be at most n_experts ({self.n_experts})"
            )
        for name in ("moe_aux_loss", "moe_z_loss"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 turns it off), got {getattr(self, name)}")
        if self.moe_shared_gate and self.moe_shared_hidden is None:
            raise ConfigError("moe_shared_gate gates a shared expert: set moe_shared_hidden too")

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer index's feed-forward is a mixture of experts (Qwen2-MoE's rule: every moe_layer_step-th layer
        counting from 1, except moe_dense_layers)."""
        if self.n_experts is None or index in (self.moe_dense_layers or ()):
            return False
        return (index + 1) % self.moe_layer_step == 0

    @property
    def expert_hidden(self) -> int:
        """Each expert's hidden size: moe_ffn_hidden, or ffn_hidden when unset."""
        return self.ffn_hidden if self.moe_ffn_hidden is None else self.moe_ffn_hidden

    def to_dict(self) -> dict[str, Any]:
        """All fields, with derived defaults resolved, as plain JSON-able values (rope_scaling as HF's dict)."""
        out = dataclasses.asdict(self)
        out["rope_scaling"] = self.rope_scaling.to_dict() if self.rope_scaling is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict of field values; an unknown key is a ConfigError naming it."""
        if not isinstance(data, dict):
            raise ConfigError(f"a model config must be a mapping of fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config field {unknown[0]!r}; known fields: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """The named architecture from PRESETS; unknown names are a ConfigError listing the choices."""
        return cls(**PRESETS[preset_name(name)])

    @classmethod
    def load(cls, name_or_path: str | Path) -> ModelConfig:
        """A preset name, a config JSON file, or a model directory holding config.json."""
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ConfigError(f"cannot read model config {path}: {err}") from None
            if isinstance(data, dict) and isinstance(data.get("model"), dict):
                data = data["model"]  # a model directory's config.json nests the fields
            return cls.from_dict(data)
        if str(name_or_path) in PRESETS or str(name_or_path) in RENAMED:
            return cls.preset(str(name_or_path))
        raise ConfigError(f"{str(name_or_path)!r} is neither a preset nor a config file; presets: {', '.join(PRESETS)}")


@functools.cache
def preset_name(name: str) -> str:
    """The preset called name now (a former name is read with a warning); unknown names are a ConfigError."""
    if name in RENAMED:
        logger.warning("preset %r is now called %r: the same shape; write the new name", name, RENAMED[name])
        return RENAMED[name]
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return name


def _field_types() -> dict[str, Any]:
    """Each field's annotation with Optional stripped, e.g. {"n_kv_head": int, "norm": Norm}."""
    types = {}
    for name, hint in get_type_hints(ModelConfig).items():
        args = [a for a in get_args(hint) if a is not type(None)]
        types[name] = args[0] if type(None) in get_args(hint) else hint
    return types


@dataclass
class ModelSection:
    """Where the architecture comes from; the remaining model keys are ModelConfig fields, kept in `fields`."""

    preset: str | None = None  # a gptkit preset name; its fields are the base the other keys override
    init_from: str | None = None  # a model directory whose weights (and config) start the run: fine-tuning
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)


# The model section's own keys; its others are ModelConfig's fields.
MODEL_SPECIAL = {"preset": str | None, "init_from": str | None}


def resolve_model(section: ModelSection, vocab_size: int, init_config: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig a run trains: preset (or init_from's config) + overrides, vocab_size from the data."""
    overrides = dict(section.fields)
    if "vocab_size" in overrides and overrides["vocab_size"] != vocab_size:
        raise ConfigError(
            f"model.vocab_size {overrides['vocab_size']} does not match the data's vocab_size {vocab_size} "
            "(meta.json); drop model.vocab_size or prepare the data with the matching tokenizer"
        )
    if init_config is not None:
        base = init_config.to_dict()
        if base["vocab_size"] != vocab_size:
            raise ConfigError(
                f"model.init_from {section.init_from} has vocab_size {base['vocab_size']} but the data's is "
                f"{vocab_size}; prepare the data with that model's tokenizer"
            )
        # A fine-tune may change dropout; and a RoPE model's context and its scaling, since its weights do not depend
        # on them (extending a trained model's context: a longer block_size with rope_scaling).
        changeable = {"dropout"} | ({"block_size", "rope_scaling"} if base["position"] == "rope" else set())
        for key, value in overrides.items():
            if key not in changeable and value != base[key]:
                raise ConfigError(
                    f"model.{key} {value!r} conflicts with init_from's {base[key]!r}; only "
                    f"{', '.join(sorted(changeable))} may change"
                )
    elif section.preset is not None:
        base = dict(PRESETS[preset_name(section.preset)])  # raw, so derived sizes follow overridden widths
    else:
        base = {}
    base.update(overrides)
    base["vocab_size"] = vocab_size
    try:
        return ModelConfig.from_dict(base)
    except ConfigError as err:
        raise ConfigError(f"model: {err}") from None
