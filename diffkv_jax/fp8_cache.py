"""FP8 (e4m3) paged KV cache with calibrated per-(layer, KV head) scales (``--kv fp8``).

The baseline that vLLM and SGLang offer as ``kv_cache_dtype="fp8_e4m3"``: every
token is kept, K and V are stored as ``float8_e4m3fn`` (1 byte per element,
half of 16-bit), each divided by a scale calibrated offline: one for K and one
for V per (layer, KV head), ``scale = margin * amax / 448`` over calibration
text (:func:`calibrate_fp8_scales`). Values past ``448 * scale`` saturate at
the largest finite FP8 value instead of becoming NaN (e4m3fn has no infinity).

Pages, page tables, allocation and accounting are :class:`FullCache`'s; only
how K/V are stored and read differs. Prompt attention runs on the unquantized
K/V of the prompt, as with every other cache method here; decode attention
reads the FP8 pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from diffkv_jax import attention as attn_ref
from diffkv_jax.paged_cache import FullCache
from models.config import ModelConfig
from models.llama import LlamaForCausalLM

FP8_DTYPE = "float8_e4m3fn"
#: Largest finite float8_e4m3fn value.
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
#: Calibrated amax is multiplied by this before it becomes the scale. Other and
#: longer text exceeds a short calibration's amax (SmolLM2, 2 x 2048 test tokens
#: against 2 x 512 calibration tokens: up to 1.5x), and e4m3's relative precision
#: is the same over its whole normal range, so headroom costs next to nothing
#: while a clipped outlier key loses attention mass.
DEFAULT_MARGIN = 2.0
#: Scale floor, so a (layer, head) whose calibration values were all zero still
#: divides by a positive number.
_MIN_SCALE = 1e-12

NEED_SCALES = (
    "the fp8 cache needs calibrated scales k_scale and v_scale, one per (layer, KV head) "
    "([num_layers][num_kv_heads], or one number for all): compute them with "
    "diffkv_jax.fp8_cache.calibrate_fp8_scales(cfg, params, token_batches); "
    "scripts/eval.py does this itself when --methods names fp8 without scales")

Scales = tuple[tuple[float, ...], ...]


def encode_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` as float8_e4m3fn, saturated at +-448 (NaN only where ``x`` is NaN).

    ``scale`` broadcasts against ``x`` (e.g. ``[KVH, 1]`` for ``x [..., KVH, D]``).
    """
    y = x.astype(jnp.float32) / scale
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def scale_table(value: Any, num_layers: int, num_kv_heads: int, what: str = "scale") -> Scales:
    """``value`` (a number, or nested sequences / an array broadcastable to
    ``[num_layers, num_kv_heads]``) as a hashable tuple of tuples of positive floats."""
    try:
        arr = np.broadcast_to(np.asarray(value, np.float64), (num_layers, num_kv_heads))
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number or [num_layers={num_layers}]"
                         f"[num_kv_heads={num_kv_heads}] numbers, got {repr(value)[:80]}"
                         ) from None
    if not (np.isfinite(arr).all() and (arr > 0).all()):
        raise ValueError(f"{what} must be positive and finite")
    return tuple(tuple(float(x) for x in row) for row in arr)


@dataclasses.dataclass(frozen=True)
class Fp8Cache(FullCache):
    """:class:`FullCache` storing K and V as scaled float8_e4m3fn. Hashable (a jit key).

    Attributes (besides :class:`FullCache`'s):
      k_scale, v_scale: ``[num_layers][num_kv_heads]`` positive floats (anything
        :func:`scale_table` accepts; stored as tuples). A stored value ``x`` is
        ``encode_fp8(x, scale)``; it reads back as ``float32(stored) * scale``.
      dtype: the storage dtype, always ``"float8_e4m3fn"`` (the compute dtype of
        the model does not matter here: attention math runs in float32).

    Decoding is the reference attention only (``attention_impl="reference"``).
    """

    dtype: str = FP8_DTYPE
    k_scale: Scales = ()
    v_scale: Scales = ()

    name = "fp8"

    def __post_init__(self):
        super().__post_init__()
        if self.attention_impl != "reference":
            raise ValueError("fp8 decodes through the reference attention; "
                             f"attention_impl={self.attention_impl!r} is not supported")
        if jnp.dtype(self.dtype) != jnp.dtype(FP8_DTYPE):
            raise ValueError(f"the fp8 cache stores {FP8_DTYPE}, not {self.dtype}")
        for what in ("k_scale", "v_scale"):
            value = getattr(self, what)
            if value is None or np.size(value) == 0:
                raise ValueError(NEED_SCALES)
            object.__setattr__(self, what, scale_table(value, self.num_layers,
                                                       self.num_kv_heads, what))

    def _scales(self, table: Scales, layer) -> jax.Array:
        """``[KVH]`` scales of ``layer`` (a traced index under the layer scan)."""
        return jnp.asarray(table, jnp.float32)[layer]

    def _encode(self, layer, k, v):
        ks = self._scales(self.k_scale, layer)[:, None]
        vs = self._scales(self.v_scale, layer)[:, None]
        return encode_fp8(k, ks), encode_fp8(v, vs)

    def _decode_pages(self, layer, k, v):
        ks = self._scales(self.k_scale, layer)[:, None]
        vs = self._scales(self.v_scale, layer)[:, None]
        return k.astype(jnp.float32) * ks, v.astype(jnp.float32) * vs

    def _paged_attention(self, layer, q, k_pages, v_pages, page_ids, lengths, work):
        # softmax(q . (s_k k)) (s_v v) == s_v softmax((s_k q) . k) v per KV head: the
        # scales go on the query and the output instead of on every gathered token.
        group = q.shape[1] // self.num_kv_heads
        ks = jnp.repeat(self._scales(self.k_scale, layer), group)[:, None]
        vs = jnp.repeat(self._scales(self.v_scale, layer), group)[:, None]
        out = attn_ref.paged_decode_attention(q.astype(jnp.float32) * ks, k_pages, v_pages,
                                              page_ids, lengths)
        return out * vs


def build_fp8(cfg: ModelConfig, *, max_seqs: int, max_context: int, dtype: Any,
              page_size: int | None, **options) -> Fp8Cache:
    """The ``fp8`` entry of :data:`diffkv_jax.methods.METHOD_SPECS`.

    Options: ``k_scale``, ``v_scale`` (required, see :class:`Fp8Cache` and
    :func:`calibrate_fp8_scales`), ``page_size`` (default 16), ``attention_impl``
    (``"reference"`` only). ``dtype`` (the compute dtype) does not change the
    storage, which is always float8_e4m3fn.
    """
    k_scale, v_scale = options.pop("k_scale", None), options.pop("v_scale", None)
    impl = options.pop("attention_impl", "reference")
    if options:
        raise ValueError(f"options {sorted(options)} do not apply to the fp8 cache")
    return Fp8Cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                    max_context=max_context, page_size=page_size or 16, attention_impl=impl,
                    k_scale=k_scale, v_scale=v_scale)


def kv_amax(cfg: ModelConfig, params, token_batches: Iterable, dtype=jnp.float32
            ) -> tuple[np.ndarray, np.ndarray]:
    """Largest ``|K|`` and ``|V|`` per (layer, KV head), ``[L, KVH]`` each, over a prefill
    of every batch (K after RoPE, as the cache stores it; no padding)."""
    L, H = cfg.num_layers, cfg.num_kv_heads

    def capture(state, layer, q, k, v, lengths):
        ka, va = state
        ka = ka.at[layer].max(jnp.abs(k.astype(jnp.float32)).max(axis=(0, 1, 3)))
        va = va.at[layer].max(jnp.abs(v.astype(jnp.float32)).max(axis=(0, 1, 3)))
        return (ka, va), attn_ref.causal_attention(q, k, v, lengths)

    model = LlamaForCausalLM(cfg, attention_fn=capture, dtype=dtype, param_dtype=dtype)

    @jax.jit
    def amax(params, tokens):
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        zeros = jnp.zeros((L, H), jnp.float32)
        _, state = model.apply({"params": params}, tokens, positions, (zeros, zeros),
                               jnp.full((B,), T, jnp.int32))
        return state

    k_max, v_max = np.zeros((L, H), np.float32), np.zeros((L, H), np.float32)
    seen = False
    for batch in token_batches:
        tokens = np.atleast_2d(np.asarray(batch, np.int32))
        if tokens.size == 0:
            continue
        ka, va = jax.device_get(amax(params, jnp.asarray(tokens)))
        k_max, v_max = np.maximum(k_max, ka), np.maximum(v_max, va)
        seen = True
    if not seen:
        raise ValueError("calibration needs at least one non-empty token sequence")
    return k_max, v_max


def calibrate_fp8_scales(cfg: ModelConfig, params, token_batches: Iterable,
                         dtype=jnp.float32, margin: float = DEFAULT_MARGIN
                         ) -> tuple[Scales, Scales]:
    """Per-(layer, KV head) FP8 scales ``(k_scale, v_scale)`` from calibration text.

    Args:
      cfg, params: the model (``dtype``: its compute dtype, so K/V are the ones it
        will store).
      token_batches: token sequences (lists of ids) or ``[B, T]`` arrays of
        equal-length ones; each is prefilled once, jitted (one compilation per shape).
      margin: ``scale = margin * amax / 448`` (default :data:`DEFAULT_MARGIN`); 1
        maps the calibration amax onto e4m3's largest value.
    Returns:
      Two ``[num_layers][num_kv_heads]`` tuples, ready for ``make_method("fp8", ...,
      k_scale=, v_scale=)``.
    """
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    k_max, v_max = kv_amax(cfg, params, token_batches, dtype)
    k_scale, v_scale = (np.maximum(margin * a.astype(np.float64) / FP8_MAX, _MIN_SCALE)
                        for a in (k_max, v_max))
    return (scale_table(k_scale, cfg.num_layers, cfg.num_kv_heads),
            scale_table(v_scale, cfg.num_layers, cfg.num_kv_heads))
