"""Position information: the sinusoid table and RoPE, its frequencies per layer and their scaling rules.

RoPE rotates pairs (i, i + r/2) of each head's first r = rotary_dim values (HF's rotate_half on the rotary slice) by
angle p * inv_freq[i]. The scaling rules change inv_freq (and, for yarn and longrope, scale cos and sin by an attention
factor); their formulas follow transformers.modeling_rope_utils, whose ROPE_INIT_FUNCTIONS the tests compare against.
Both the eager model and the fused decode step read the frequencies from here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gptkit.config import ModelConfig, RopeScaling  # RopeScaling is defined with the config, named here too

# YaRN's ramp ends when HF's config leaves them unset (Peng et al. 2023, section 3.2).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def sinusoidal_embedding(positions: Tensor, dim: int) -> Tensor:
    """Vaswani et al.'s table at the given positions: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions[..., None].float() * inv_freq  # (..., T, dim/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # (..., T, dim), sin/cos interleaved


def document_positions(document_ids: Tensor) -> Tensor:
    """Each token's position inside its document (B, T): counting restarts where a row's id changes."""
    index = torch.arange(document_ids.size(1), device=document_ids.device).expand_as(document_ids)  # (B, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # (B, T): where each token's document starts
    return index - first


def base_frequencies(theta: float, dim: int, device: torch.device | str | None = None) -> Tensor:
    """Unscaled RoPE inverse frequencies theta^(-2i/dim), i < dim/2, in fp32."""
    return 1.0 / wavelength_bases(theta, dim, device)


def wavelength_bases(theta: float, dim: int, device: torch.device | str | None = None) -> Tensor:
    """theta^(2i/dim), i < dim/2 in fp32: the reciprocals of the unscaled frequencies, which the rules divide by."""
    return theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def layer_rope(config: ModelConfig, layer_index: int) -> tuple[float, RopeScaling | None] | None:
    """(base, scaling rule) of layer layer_index's RoPE, or None where it applies none (no rope, a NoPE layer).

    With rope_local_theta set, a sliding layer takes that base unscaled (Gemma 3's local layers) and a full layer
    rope_theta with rope_scaling; without it every layer takes rope_theta with rope_scaling.
    """
    if config.position != "rope" or layer_index in (config.nope_layers or ()):
        return None
    if config.rope_local_theta is not None and config.layer_window(layer_index) is not None:
        return config.rope_local_theta, None
    return config.rope_theta, config.rope_scaling


def inv_frequencies(
    config: ModelConfig, layer_index: int, seq_len: int | None = None, device: torch.device | str | None = None
) -> Tensor:
    """Layer layer_index's RoPE inverse frequencies (rotary_dim / 2,) in fp32, scaled by its rule.

    seq_len is one past the largest position of the pass: dynamic and longrope choose their frequencies by it (as HF
    does per forward call); the other rules ignore it. A layer without RoPE (layer_rope None) gets rope_theta's.
    """
    base, scaling = layer_rope(config, layer_index) or (config.rope_theta, None)
    return scaled_frequencies(base, config.rotary_dim, scaling, config.block_size, seq_len, device)


def attention_factor(config: ModelConfig, layer_index: int) -> float:
    """What cos and sin are multiplied by in layer layer_index: yarn's and longrope's attention scaling, else 1."""
    rope = layer_rope(config, layer_index)
    scaling = rope[1] if rope is not None else None
    return 1.0 if scaling is None else scaling_attention_factor(scaling, config.block_size)


def scaled_frequencies(
    base: float,
    dim: int,
    scaling: RopeScaling | None,
    max_positions: int,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Inverse frequencies (dim / 2,) of a RoPE with this base over dim values, under the scaling rule.

    max_positions (the model's block_size) stands for HF's max_position_embeddings: dynamic scales once a pass
    reaches past it, and yarn and longrope without a factor take max_positions / original_max_position_embeddings.
    """
    inv_freq = base_frequencies(base, dim, device)
    if scaling is None:
        return inv_freq
    kind = scaling.rope_type
    if kind == "linear":  # position interpolation: positions divided by factor
        return inv_freq / scaling.factor
    if kind == "dynamic":  # NTK-aware: the base grows with the pass's length past the trained context
        length = max(seq_len or 0, max_positions)
        grown = base * ((scaling.factor * length / max_positions) - (scaling.factor - 1)) ** (dim / (dim - 2))
        return base_frequencies(grown, dim, device)
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "yarn":
        return _yarn(base, dim, scaling, _factor(scaling, max_positions), device)
    long = seq_len is not None and seq_len > scaling.original_max_position_embeddings
    divisors = torch.tensor(scaling.long_factor if long else scaling.short_factor, device=device)
    return 1.0 / (divisors * wavelength_bases(base, dim, device))  # longrope: a divisor per frequency


def scaling_attention_factor(scaling: RopeScaling, max_positions: int) -> float:
    """The factor yarn and longrope scale cos and sin by (HF's attention_scaling); 1 for the other rules."""
    if scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = _factor(scaling, max_positions)
    if scaling.rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))
    if scaling.mscale and scaling.mscale_all_dim:  # DeepSeek's ratio of two mscales
        return _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
    return _yarn_mscale(factor)


def _factor(scaling: RopeScaling, max_positions: int) -> float:
    """The rule's factor; yarn and longrope without one stretch the original context to max_positions."""
    if scaling.factor is not None:
        return scaling.factor
    return max_positions / scaling.original_max_position_embeddings


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1's rule: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    original, factor = scaling.original_max_position_embeddings, scaling.factor
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, scaling: RopeScaling, factor: float, device: torch.device | str | None) -> Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context interpolated (divided by
    factor), those turning more than beta_fast times kept, a linear ramp over the dimensions between."""
    original = scaling.original_max_position_embeddings

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = dimension(scaling.beta_fast or YARN_BETA_FAST)
    high = dimension(scaling.beta_slow or YARN_BETA_SLOW)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the frequency is kept (extrapolated), 0 where interpolated
    wavelengths = wavelength_bases(base, dim, device)
    return 1.0 / (factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


def cos_sin(positions: Tensor, inv_freq: Tensor, factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos and sin (B or 1, T, 2 * len(inv_freq)) of angles p * inv_freq for the half-split layout, times factor."""
    angles = positions[..., None].float() * inv_freq  # (B or 1, T, r/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B or 1, T, r)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Unscaled rotary angles p * theta^(-2i/d) for the half-split layout (dim i pairs with i + d/2), as in HF Llama."""
    return cos_sin(positions, base_frequencies(theta, head_dim, positions.device))


def rope_tables(config: ModelConfig, positions: Tensor) -> list[tuple[Tensor, Tensor] | None]:
    """Each layer's (cos, sin) at positions (B or 1, T), or None for a layer without RoPE; layers sharing a base and
    rule share one table."""
    seq_len = None
    if config.rope_scaling is not None and config.rope_scaling.rope_type in ("dynamic", "longrope"):
        seq_len = int(positions.max()) + 1 if positions.numel() else 0  # chooses the frequencies: one sync per pass
    tables: dict[tuple[float, RopeScaling | None], tuple[Tensor, Tensor]] = {}
    out: list[tuple[Tensor, Tensor] | None] = []
    for index in range(config.n_layer):
        rope = layer_rope(config, index)
        if rope is not None and rope not in tables:
            base, scaling = rope
            inv_freq = scaled_frequencies(
                base, config.rotary_dim, scaling, config.block_size, seq_len, positions.device
            )
            factor = 1.0 if scaling is None else scaling_attention_factor(scaling, config.block_size)
            tables[rope] = cos_sin(positions, inv_freq, factor)
        out.append(None if rope is None else tables[rope])
    return out


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (x_i, x_{i+r/2}) pair of the first r values of x (B, H, T, head_dim) by its position's angle,
    r = cos.size(-1) (partial rotary when r < head_dim: the rest pass unchanged)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # (B or 1, 1, T, r)
    rotary = cos.size(-1)
    if rotary < x.size(-1):
        return torch.cat([_rotate(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    return _rotate(x, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
