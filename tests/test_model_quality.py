"""The embedded model is the real SmolLM2: low perplexity on English, high on shuffled tokens."""

import jax
import jax.numpy as jnp
import numpy as np

from diffkv_jax.steps import forward_no_cache

PARAGRAPH = (
    "Water is a chemical compound made of two hydrogen atoms and one oxygen atom. At room "
    "temperature it is a liquid, but it freezes into ice at zero degrees Celsius and boils "
    "at one hundred degrees Celsius at sea level. Water covers about seventy percent of the "
    "surface of the Earth, and all known forms of life depend on it."
)


def perplexity(cfg, params, ids):
    logits = forward_no_cache(cfg, params, jnp.asarray([ids]), jnp.asarray([len(ids)]))[0]
    logp = jax.nn.log_softmax(logits[:-1], axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(ids[1:])[:, None], axis=-1).mean()
    return float(jnp.exp(nll))


def test_perplexity_english_vs_shuffled(smollm):
    ids = smollm.tokenizer.encode(PARAGRAPH)
    assert len(ids) >= 40
    ppl = perplexity(smollm.cfg, smollm.params, ids)
    shuffled = list(np.random.default_rng(0).permutation(ids))
    ppl_shuffled = perplexity(smollm.cfg, smollm.params, shuffled)
    print(f"perplexity {ppl:.2f}, shuffled {ppl_shuffled:.1f}")
    assert ppl < 15
    assert ppl_shuffled > 500


def _reference_logits_float64(path, ids, n_heads=9, n_kv=3, head_dim=64, theta=1e5, eps=1e-5):
    """An independent float64 numpy forward straight from the GGUF tensors.

    It keeps llama.cpp's permuted Q/K rows and applies adjacent-pair RoPE to them,
    so it shares no code (and no un-permutation) with the Flax model.
    """
    import gguf

    rd = gguf.GGUFReader(path)
    W = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
         for t in rd.tensors}
    T = len(ids)
    x = W["token_embd.weight"][ids]
    ang = np.arange(T)[:, None] * (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim))
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    def rope_pairs(v):
        out = np.empty_like(v)
        a, b = v[..., 0::2], v[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    causal = np.tril(np.ones((T, T), bool))[None]
    for i in range(sum(1 for n in W if n.endswith("attn_norm.weight"))):
        w = lambda n: W[f"blk.{i}.{n}.weight"]  # noqa: E731
        h = rms(x, w("attn_norm"))
        q = rope_pairs((h @ w("attn_q").T).reshape(T, n_heads, head_dim))
        k = rope_pairs((h @ w("attn_k").T).reshape(T, n_kv, head_dim))
        v = (h @ w("attn_v").T).reshape(T, n_kv, head_dim)
        k, v = (np.repeat(a, n_heads // n_kv, axis=1) for a in (k, v))
        s = np.where(causal, np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(T, -1) @ w("attn_output").T
        h = rms(x, w("ffn_norm"))
        g, u = h @ w("ffn_gate").T, h @ w("ffn_up").T
        x = x + (g / (1 + np.exp(-g)) * u) @ w("ffn_down").T
    return rms(x, W["output_norm.weight"]) @ W["token_embd.weight"].T


def test_model_matches_independent_float64_reference(smollm):
    from models.gguf_loader import embedded_gguf_path

    ids = smollm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    ref = _reference_logits_float64(embedded_gguf_path(), ids)
    ours = np.asarray(forward_no_cache(smollm.cfg, smollm.params, jnp.asarray([ids]),
                                       jnp.asarray([len(ids)]))[0])
    # float32 vs float64 over 30 layers: ~2e-4 on logits of magnitude ~30.
    assert np.abs(ours - ref).max() < 2e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
