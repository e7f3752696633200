"""Random decode-attention cases on the device, shared by the kernel benchmarks.

A case is the rows of a batch at one context length, stored in one or more
tiers (random codes and metadata, random page order); :func:`case_reference`
dequantizes them for the plain-jnp reference.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp

from pallas_kernels import paged_decode as pdk

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
#: Named tier mixes: (k_bits, v_bits, slots, fraction of the context).
MIXES = {
    "bf16": [(16, 16, 16, 1.0)],
    "int8": [(8, 8, 32, 1.0)],
    "diffkv-high": [(8, 4, 32, 1.0)],
    "diffkv-low": [(4, 2, 64, 1.0)],
    "diffkv-50/50": [(8, 4, 32, 0.5), (4, 2, 64, 0.5)],
    # 35% of tokens K8V4, 45% K4V2, 20% pruned
    "diffkv-mix": [(8, 4, 32, 0.35), (4, 2, 64, 0.45)],
}


def random_case(key, mix: str, S: int, H: int, D: int, context: int,
                page_order: str = "random"):
    """``(tiers, bytes_read)``: the tier inputs of ``S x H`` rows and the bytes a
    kernel must read for them (codes or values, metadata, page IDs).

    ``page_order``: "random" (a random permutation of the pool, as a serving
    pool's free list hands pages out) or "sorted" (each row's pages side by side,
    rows in order: every stream a kernel reads is sequential, a diagnostic of
    what the pages' scatter costs)."""
    if page_order not in ("random", "sorted"):
        raise ValueError(f"page_order must be 'random' or 'sorted', not {page_order!r}")
    tiers, nbytes = [], 0
    for kb, vb, cap, frac in MIXES[mix]:
        fmt = pdk.TierFormat(kb, vb, D, cap)
        n = int(context * frac)
        npr = max(1, -(-n // cap))
        P = S * H * npr
        key, a, b, c = jax.random.split(key, 4)
        order = jax.random.permutation(c, P) if page_order == "random" else jnp.arange(P)
        pages = order.reshape(S, H, npr).astype(jnp.int32)
        n_tok = jnp.full((S, H), n, jnp.int32)
        if fmt.quantized:
            data = jax.random.randint(a, (P, fmt.data_bytes), 0, 256, jnp.int32).astype(jnp.uint8)
            meta = jax.random.uniform(b, (2, P, cap, 2), jnp.float16, 0.01, 0.1)
            kv, vv = pdk.page_views(data, fmt)
            tiers.append(pdk.TierInput(fmt, kv, vv, (pdk.pack_meta(meta[0, ..., 0], meta[0, ..., 1]),
                                                    pdk.pack_meta(meta[1, ..., 0], meta[1, ..., 1])),
                                       pages, n_tok))
            nbytes += n * (fmt.key_width + fmt.value_width + 8) + npr * 4
        else:
            k = jax.random.normal(a, (P, cap, D), jnp.bfloat16)
            v = jax.random.normal(b, (P, cap, D), jnp.bfloat16)
            tiers.append(pdk.TierInput(fmt, k, v, None, pages, n_tok))
            nbytes += n * 4 * D + npr * 4
    return tiers, nbytes * S * H


def case_reference(q, tiers):
    """Per tier ``(o, m, l, logits)`` of the plain-jnp reference on dequantized tokens."""
    from diffkv_jax import quantization as qz

    out = []
    for t in tiers:
        f, ids = t.fmt, t.pages
        S, H, NP = ids.shape
        if f.quantized:
            P = t.keys.shape[0]
            flat = t.keys.reshape(P, -1)
            keys = flat[:, :f.slots * f.key_width].reshape(P, f.slots, f.key_width)
            vals = flat[:, f.slots * f.key_width:].reshape(P, f.value_width, f.slots)
            km = jax.lax.bitcast_convert_type(t.meta[0], jnp.float16)
            vm = jax.lax.bitcast_convert_type(t.meta[1], jnp.float16)
            kh = qz.dequantize_packed(keys[ids], km[ids, :f.slots, 0], km[ids, :f.slots, 1],
                                      f.k_bits, f.head_dim)
            vh = qz.dequantize_packed(vals[ids].swapaxes(-1, -2), vm[ids, :f.slots, 0],
                                      vm[ids, :f.slots, 1], f.v_bits, f.head_dim)
        else:
            kh, vh = t.keys[ids], t.values[ids]
        n = NP * f.slots
        out.append(pdk.tier_attention_reference(q.astype(jnp.float32),
                                                kh.reshape(S, H, n, -1), vh.reshape(S, H, n, -1),
                                                t.n_tok))
    return out


def case_output(q, tiers):
    """The plain-jnp reference's attention output: :func:`case_reference`'s tiers merged."""
    return pdk.merge_partials([r[:3] for r in case_reference(q, tiers)])[0]


def time_ms(fn, *args, reps: int = 20, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean time of ``reps`` back-to-back calls (ms).

    Back-to-back calls keep the device busy, so host dispatch stays out of the
    figure once it is shorter than the call itself.
    """
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / reps)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def chained_call(fn, launches: int, prepare=None, threaded: bool = False):
    """A jitted ``chain(q, zero, *rest)`` running ``launches`` of ``fn`` one after the
    other, as :func:`time_chained_ms` times it. The launches are unrolled, as the
    engine's decode step unrolls its layers: XLA's GPU loops copy their condition
    to the host every step, and the device waited ~10 µs for it per launch.
    ``threaded`` (with ``prepare``): ``fn`` returns ``(outputs, prepared)`` and each
    launch gets the previous one's ``prepared`` (state a launch updates in place,
    as the merge counters of :func:`pallas_kernels.paged_decode.paged_decode_merged`)."""
    def total(q, prepared, *rest):
        out = fn(q, *rest) if prepare is None else fn(q, prepared, *rest)
        if threaded:
            out, prepared = out
        out = out[0] if isinstance(out, (tuple, list)) else out
        return jnp.sum(out.astype(jnp.float32)), prepared

    @jax.jit
    def chain(q, zero, *rest):
        prepared = None if prepare is None else prepare(*rest)
        for _ in range(launches):
            t, prepared = total(q, prepared, *rest)
            q = q + (zero * t).astype(q.dtype)
        return q

    return chain


def time_chained_ms(fn, q, *rest, launches: int, reps: int = 5, rounds: int = 5,
                    prepare=None, chain=None, threaded: bool = False) -> float:
    """Device time of one ``fn(q, *rest)`` (ms), from ``launches`` of them chained in
    one jitted call, as a decode step runs one attention launch per layer: no host
    dispatch between them. ``fn`` returns an array, or a tuple that starts with one;
    each launch takes ``q + 0 * sum(the previous output)`` (with the zero an
    argument: a reduction and an elementwise op per launch, the same for every
    variant), so no launch can be hoisted out of the loop and no part of an output
    left uncomputed. ``prepare(*rest)``, if given, runs once per call, before the
    chain (what a decode step computes once for all its layers, as the work list):
    the launches are then ``fn(q, prepared, *rest)`` and its cost is shared by them.

    The figure includes what the chain adds per launch (the reduction and the
    add); :func:`kernel_ms` gives the kernels' time alone.
    ``chain``: the :func:`chained_call` of the same arguments, if already built
    (one compilation for the timing and the trace); ``threaded``: as there."""
    chain = chain or chained_call(fn, launches, prepare, threaded)
    zero = jnp.float32(0)
    return time_ms(chain, q, zero, *rest, reps=reps, rounds=rounds) / launches


#: Name fragments of the attention kernels in a profiler trace: ours (the decode
#: launch and the one-launch merge) and JAX's Pallas ``paged_attention``.
ATTENTION_KERNELS = ("paged_decode", "merge_rows", "paged_attention")


def kernel_ms(fn, q, *rest, launches: int, prepare=None, names=ATTENTION_KERNELS,
              chain=None, threaded: bool = False):
    """``(ms, kernels)``: the device time per launch of the kernels whose names hold
    one of ``names``, read from a profiler trace of :func:`chained_call` (without
    the chain's own reductions and adds, or the gaps between kernels), and every
    kernel's ``(name, ms per launch)``; ms is None where no kernel matched.
    ``chain``, ``threaded``: as in :func:`time_chained_ms`."""
    from scripts.device_profile import kernel_times

    chain = chain or chained_call(fn, launches, prepare, threaded)
    zero = jnp.float32(0)
    rows, _, _ = kernel_times(lambda: jax.block_until_ready(chain(q, zero, *rest)), calls=5)
    per_launch = [(name, ms / launches) for name, ms, _ in rows]
    hit = [ms for name, ms in per_launch if any(n in name for n in names)]
    return (sum(hit) if hit else None), per_launch


def time_launch_ms(fn, q, *rest, chain: int = 0, prepare=None, threaded: bool = False) -> float:
    """:func:`time_chained_ms` over ``chain`` launches, or :func:`time_ms` of
    back-to-back calls where ``chain`` is 0 (``prepare``, if given, then inside
    every call; ``threaded``: as :func:`chained_call`'s)."""
    if chain:
        return time_chained_ms(fn, q, *rest, launches=chain, prepare=prepare,
                               threaded=threaded)
    if prepare is not None:
        inner = fn

        @jax.jit
        def fn(q, *rest):
            out = inner(q, prepare(*rest), *rest)
            return out[0] if threaded else out  # (outputs, prepared) where threaded
    return time_ms(fn, q, *rest)


def write_results(path: str, bw: float, args, rows, **extra) -> None:
    """A benchmark's results as JSON: the copy bandwidth of its run, the device,
    its arguments (``args``: an argparse namespace) and ``rows``, with ``extra``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"copy_bandwidth_tbps": bw, "device": jax.devices()[0].device_kind,
                   "args": vars(args), "rows": rows, **extra}, fh, indent=1)


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth (TB/s, bytes read + written) through XLA."""
    x = jnp.ones((int(gib * 2**28),), jnp.float32)
    ms = time_ms(jax.jit(lambda a: a + 1), x, reps=5, rounds=3)
    return 2 * x.nbytes / (ms * 1e-3) / 1e12
