"""Static configuration of the Gemma family (frozen, hashable: usable as a jit static arg)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pasta_jax.errors import ConfigError

Family = Literal["gemma1", "gemma2", "gemma3"]
LayerKind = Literal["global", "local"]


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  """Architecture of one Gemma text model.

  Every feature of the three families is a field, so one model implementation serves all:
  Gemma 1 (MQA/GQA, GeGLU, RMSNorm with 1+w, scaled tied embeddings), Gemma 2 (+ post-norms,
  soft-capping, alternating local/global layers) and Gemma 3 (+ QK-norm, per-kind RoPE base,
  local:global pattern 5:1, linear RoPE scaling on global layers for 4B+).
  """

  family: Family
  vocab_size: int
  embed_dim: int
  hidden_dim: int  # GeGLU inner width
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  layer_kinds: tuple[LayerKind, ...]
  query_pre_attn_scalar: float
  rope_base_global: float = 10_000.0
  rope_base_local: float = 10_000.0
  rope_scale_global: float = 1.0  # linear position scaling on global layers (Gemma 3 4B+)
  sliding_window: int | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  use_qk_norm: bool = False
  use_post_attn_norm: bool = False
  use_post_ffw_norm: bool = False
  rms_norm_eps: float = 1e-6
  max_position: int = 8192
  name: str = ""

  def __post_init__(self):
    problems = []
    if len(self.layer_kinds) != self.num_layers:
      problems.append(f"layer_kinds has {len(self.layer_kinds)} entries for {self.num_layers} layers")
    if self.num_heads % self.num_kv_heads:
      problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if "local" in self.layer_kinds and not self.sliding_window:
      problems.append("local layers need a sliding_window")
    bad = set(self.layer_kinds) - {"global", "local"}
    if bad:
      problems.append(f"unknown layer kinds {sorted(bad)}")
    if problems:
      raise ValueError(f"invalid GemmaConfig {self.name or self.family!r}: " + "; ".join(problems))

  @property
  def num_query_groups(self) -> int:
    return self.num_heads // self.num_kv_heads

  def param_count(self) -> int:
    """Number of parameters (tied embedding counted once)."""
    d, f, h, k, hd = self.embed_dim, self.hidden_dim, self.num_heads, self.num_kv_heads, self.head_dim
    attn = d * hd * (2 * h + 2 * k) + (2 * hd if self.use_qk_norm else 0)
    norms = d * (2 + self.use_post_attn_norm + self.use_post_ffw_norm)
    return self.vocab_size * d + self.num_layers * (attn + 3 * d * f + norms) + d


def _pattern(num_layers: int, period: int) -> tuple[LayerKind, ...]:
  """Gemma 2 (period 2) and Gemma 3 (period 6): every `period`-th layer is global."""
  return tuple("global" if (i + 1) % period == 0 else "local" for i in range(num_layers))


def gemma1(name, vocab, d, f, layers, heads, kv_heads, head_dim, **kw) -> GemmaConfig:
  return GemmaConfig(
      family="gemma1", name=name, vocab_size=vocab, embed_dim=d, hidden_dim=f, num_layers=layers,
      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, layer_kinds=("global",) * layers,
      query_pre_attn_scalar=head_dim, **kw)


def gemma2(name, vocab, d, f, layers, heads, kv_heads, head_dim, window=4096, qpas=None, **kw) -> GemmaConfig:
  return GemmaConfig(
      family="gemma2", name=name, vocab_size=vocab, embed_dim=d, hidden_dim=f, num_layers=layers,
      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, layer_kinds=_pattern(layers, 2),
      query_pre_attn_scalar=qpas or head_dim, sliding_window=window, attn_logit_softcap=50.0,
      final_logit_softcap=30.0, use_post_attn_norm=True, use_post_ffw_norm=True, **kw)


def gemma3(name, vocab, d, f, layers, heads, kv_heads, head_dim, window, qpas=None, scale=1.0, period=6,
           **kw) -> GemmaConfig:
  return GemmaConfig(
      family="gemma3", name=name, vocab_size=vocab, embed_dim=d, hidden_dim=f, num_layers=layers,
      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, layer_kinds=_pattern(layers, period),
      query_pre_attn_scalar=qpas or head_dim, sliding_window=window, rope_base_global=1_000_000.0,
      rope_base_local=10_000.0, rope_scale_global=scale, use_qk_norm=True, use_post_attn_norm=True,
      use_post_ffw_norm=True, **kw)


GEMMA3_VOCAB = 262_144  # 270M and 1B (text-only checkpoints)
GEMMA3_MM_VOCAB = 262_208  # 4B and up: the text vocab of the multimodal checkpoints
PRESETS: dict[str, GemmaConfig] = {
    "gemma1-2b": gemma1("gemma1-2b", 256_000, 2048, 16384, 18, 8, 1, 256),
    "gemma1-7b": gemma1("gemma1-7b", 256_000, 3072, 24576, 28, 16, 16, 256),
    "gemma2-2b": gemma2("gemma2-2b", 256_000, 2304, 9216, 26, 8, 4, 256),
    "gemma2-9b": gemma2("gemma2-9b", 256_000, 3584, 14336, 42, 16, 8, 256),
    "gemma3-270m": gemma3("gemma3-270m", GEMMA3_VOCAB, 640, 2048, 18, 4, 1, 256, window=512, max_position=32_768),
    "gemma3-1b": gemma3("gemma3-1b", GEMMA3_VOCAB, 1152, 6912, 26, 4, 1, 256, window=512, max_position=32_768),
    "gemma3-4b": gemma3("gemma3-4b", GEMMA3_MM_VOCAB, 2560, 10240, 34, 8, 4, 256, window=1024, scale=8.0,
                        max_position=131_072),
    "gemma3-12b": gemma3("gemma3-12b", GEMMA3_MM_VOCAB, 3840, 15360, 48, 16, 8, 256, window=1024, scale=8.0,
                         max_position=131_072),
    "gemma3-27b": gemma3("gemma3-27b", GEMMA3_MM_VOCAB, 5376, 21504, 62, 32, 16, 128, window=1024,
                         qpas=168, scale=8.0, max_position=131_072),
    # Tiny configs of each family for tests: same code paths, seconds on a CPU.
    "tiny-gemma1": gemma1("tiny-gemma1", 512, 64, 128, 2, 4, 1, 16),
    "tiny-gemma2": gemma2("tiny-gemma2", 512, 64, 128, 4, 4, 2, 16, window=8),
    # Gemma 3's local/global interleave in 3 layers (local, local, global), not 6: the suite traces and
    # compiles this model hundreds of times, in time proportional to its layers.
    "tiny-gemma3": gemma3("tiny-gemma3", 512, 64, 128, 3, 4, 2, 16, window=8, period=3),
}


def get_config(name: str) -> GemmaConfig:
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown model config {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def config_to_dict(config: GemmaConfig) -> dict[str, Any]:
  out = dataclasses.asdict(config)
  out["layer_kinds"] = list(config.layer_kinds)
  return out


def config_from_dict(fields: dict[str, Any]) -> GemmaConfig:
  known = {f.name for f in dataclasses.fields(GemmaConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ConfigError(f"checkpoint config has fields this version does not know: {unknown}")
  try:
    return GemmaConfig(**{**fields, "layer_kinds": tuple(fields["layer_kinds"])})
  except (TypeError, KeyError, ValueError) as e:
    raise ConfigError(f"invalid checkpoint config: {e}") from None
