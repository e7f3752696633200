"""Loading weights: safetensors dirs, hub cache lookup, orbax cache, presets, random init."""

from __future__ import annotations

import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from models.checkpoint import cached_convert, restore_params, save_params, source_key
from models.config import PRESETS, UnknownModelError, get_preset
from models.errors import WeightsFormatError, WeightsNotFoundError
from models.loading import load_model, random_params
from models.params import check_params, param_shapes
from models.safetensors_loader import find_hf_snapshot, hf_cache_roots, load_safetensors_dir

L, H, NQ, NKV, V, I = 2, 64, 4, 2, 128, 96
D = H // NQ


def hf_config(model_type="llama", tie=False):
    return {
        "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
        "model_type": model_type, "vocab_size": V, "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": L, "num_attention_heads": NQ, "num_key_value_heads": NKV,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": tie,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
    }


def hf_tensors(bias=False, tie=False, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H)}
    if not tie:
        t["lm_head.weight"] = r(V, H)
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = r(H)
        t[p + "post_attention_layernorm.weight"] = r(H)
        t[p + "self_attn.q_proj.weight"] = r(NQ * D, H)
        t[p + "self_attn.k_proj.weight"] = r(NKV * D, H)
        t[p + "self_attn.v_proj.weight"] = r(NKV * D, H)
        t[p + "self_attn.o_proj.weight"] = r(H, NQ * D)
        t[p + "mlp.gate_proj.weight"] = r(I, H)
        t[p + "mlp.up_proj.weight"] = r(I, H)
        t[p + "mlp.down_proj.weight"] = r(H, I)
        if bias:
            t[p + "self_attn.q_proj.bias"] = r(NQ * D)
            t[p + "self_attn.k_proj.bias"] = r(NKV * D)
            t[p + "self_attn.v_proj.bias"] = r(NKV * D)
    return t


def write_safetensors(path, tensors, raw=False):
    """save_file, or a hand-written file when asked or when save_file cannot store the dtype."""
    if not raw:
        try:
            save_file(tensors, str(path))
            return
        except Exception:
            pass
    codes = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}
    header, blobs, off = {}, [], 0
    for k, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": codes[a.dtype], "shape": list(a.shape),
                     "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def make_dir(root, model_type="llama", bias=False, tie=False, dtype=np.float32, shards=1,
             drop=()):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config(model_type, tie)))
    t = hf_tensors(bias=bias, tie=tie, dtype=dtype)
    for k in drop:
        del t[k]
    if shards == 1:
        write_safetensors(root / "model.safetensors", t)
    else:
        names = sorted(t)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: t[k] for k in names[s::shards]}
            write_safetensors(root / fname, part)
            weight_map.update({k: fname for k in part})
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    return t


def expect(t, bias=False, tie=False):
    """Independent re-statement of the HF -> params mapping."""
    def stack(name, transpose):
        return np.stack([t[f"model.layers.{i}.{name}"].T if transpose
                         else t[f"model.layers.{i}.{name}"] for i in range(L)])

    def proj(name, with_bias):
        p = {"kernel": stack(f"self_attn.{name}.weight", True)}
        if with_bias:
            p["bias"] = stack(f"self_attn.{name}.bias", False)
        return p

    e = {
        "embed": {"embedding": t["model.embed_tokens.weight"]},
        "layers": {
            "attn_norm": {"scale": stack("input_layernorm.weight", False)},
            "attn": {"q_proj": proj("q_proj", bias), "k_proj": proj("k_proj", bias),
                     "v_proj": proj("v_proj", bias), "o_proj": proj("o_proj", False)},
            "mlp_norm": {"scale": stack("post_attention_layernorm.weight", False)},
            "mlp": {n: {"kernel": stack(f"mlp.{n}.weight", True)}
                    for n in ("gate_proj", "up_proj", "down_proj")},
        },
        "final_norm": {"scale": t["model.norm.weight"]},
    }
    if not tie:
        e["lm_head"] = {"kernel": t["lm_head.weight"].T}
    return e


def assert_tree_equal(got, want, dtype):
    gl, gt = jax.tree_util.tree_flatten_with_path(got)
    wl, wt = jax.tree_util.tree_flatten_with_path(want)
    assert gt == wt
    for (path, g), (_, w) in zip(gl, wl):
        assert g.dtype == dtype, path
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w).astype(dtype), err_msg=str(path))


# --------------------------------------------------------------------------- safetensors


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_llama_dir_exact(tmp_path, dtype):
    t = make_dir(tmp_path / "m")
    cfg, params = load_safetensors_dir(tmp_path / "m", dtype=dtype)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim) == (L, H, NKV, D)
    assert not cfg.qkv_bias and not cfg.tie_word_embeddings and cfg.name == "m"
    check_params(params, cfg)
    assert_tree_equal(params, expect(t), jnp.dtype(dtype))


def test_bf16_checkpoint(tmp_path):
    t = make_dir(tmp_path / "m", dtype=ml_dtypes.bfloat16)
    cfg, params = load_safetensors_dir(tmp_path / "m", dtype=jnp.bfloat16)
    assert_tree_equal(params, expect(t), jnp.dtype(jnp.bfloat16))
    # Upcasting bf16 -> f32 is exact.
    _, p32 = load_safetensors_dir(tmp_path / "m", dtype=jnp.float32)
    assert_tree_equal(p32, expect(t), jnp.dtype(jnp.float32))


def test_raw_header_fallback(tmp_path, monkeypatch):
    # Old safetensors releases cannot hand bf16 to numpy; the loader then reads
    # the bytes itself. Simulate that by making get_tensor fail for bf16.
    import contextlib

    from models import safetensors_loader as sl
    t = {"a": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
         "b": np.ones((4,), np.float32)}
    write_safetensors(tmp_path / "x.safetensors", t, raw=True)
    with contextlib.ExitStack() as stack:
        shard = sl._Shard(tmp_path / "x.safetensors", stack)
        real_get = shard._f.get_tensor

        class NoBf16:
            def get_tensor(self, name):
                if name == "a":
                    raise TypeError("data type 'bfloat16' not understood")
                return real_get(name)

        shard._f = NoBf16()
        for k, v in t.items():
            got = shard.get(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            np.testing.assert_array_equal(got, v)


def test_qwen2_bias_tied(tmp_path):
    t = make_dir(tmp_path / "q", model_type="qwen2", bias=True, tie=True)
    cfg, params = load_safetensors_dir(tmp_path / "q", dtype=jnp.float32)
    assert cfg.qkv_bias and cfg.tie_word_embeddings and "lm_head" not in params
    assert_tree_equal(params, expect(t, bias=True, tie=True), jnp.dtype(jnp.float32))


def test_sharded_with_index(tmp_path):
    t = make_dir(tmp_path / "s", shards=3)
    assert len(list((tmp_path / "s").glob("*.safetensors"))) == 3
    cfg, params = load_safetensors_dir(tmp_path / "s", dtype=jnp.float32)
    assert_tree_equal(params, expect(t), jnp.dtype(jnp.float32))


def test_cfg_argument_keeps_name_and_checks_arch(tmp_path):
    make_dir(tmp_path / "m")
    file_cfg, _ = load_safetensors_dir(tmp_path / "m", dtype=jnp.float32)
    mine = file_cfg.replace(name="tiny", eos_token_ids=(2, 3))
    cfg, _ = load_safetensors_dir(tmp_path / "m", cfg=mine, dtype=jnp.float32)
    assert cfg == mine
    with pytest.raises(WeightsFormatError, match="hidden_size"):
        load_safetensors_dir(tmp_path / "m", cfg=mine.replace(hidden_size=128))


def test_missing_tensor(tmp_path):
    make_dir(tmp_path / "m", drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(WeightsFormatError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj"):
        load_safetensors_dir(tmp_path / "m")


def test_untied_without_lm_head(tmp_path):
    make_dir(tmp_path / "m", drop=["lm_head.weight"])
    with pytest.raises(WeightsFormatError, match="lm_head.weight"):
        load_safetensors_dir(tmp_path / "m")


def test_missing_config_and_files(tmp_path):
    make_dir(tmp_path / "m")
    os.remove(tmp_path / "m" / "config.json")
    with pytest.raises(WeightsFormatError, match="config.json") as e:
        load_safetensors_dir(tmp_path / "m")
    assert str(tmp_path / "m") in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps(hf_config()))
    with pytest.raises(WeightsFormatError, match="safetensors"):
        load_safetensors_dir(tmp_path / "e")


def test_bad_shape(tmp_path):
    make_dir(tmp_path / "m")
    cfg = hf_config()
    cfg["intermediate_size"] = I + 1
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsFormatError, match="shape"):
        load_safetensors_dir(tmp_path / "m")


def test_unsupported_extra_tensor(tmp_path):
    root = tmp_path / "m"
    make_dir(root)
    write_safetensors(root / "extra.safetensors",
                      {"model.layers.0.self_attn.o_proj.bias": np.zeros(H, np.float32)})
    with pytest.raises(WeightsFormatError, match="o_proj.bias"):
        load_safetensors_dir(root)


# --------------------------------------------------------------------------- hub cache


def test_hf_cache_roots(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    roots = hf_cache_roots()
    assert roots[0] == tmp_path / "hub" and len(roots) == 2  # HF_HOME/hub deduplicated
    assert roots[1].parts[-3:] == (".cache", "huggingface", "hub")


def test_find_hf_snapshot(monkeypatch, tmp_path):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.delenv("HF_HOME", raising=False)
    cfg = get_preset("llama3-8b")
    repo = hub / "models--meta-llama--Meta-Llama-3-8B-Instruct"
    with pytest.raises(WeightsNotFoundError) as e:
        find_hf_snapshot(cfg)
    msg = str(e.value)
    assert "llama3-8b" in msg and str(repo / "snapshots") in msg and "--model-path" in msg
    assert "\n" not in msg

    # An incomplete snapshot (no safetensors) is not accepted.
    (repo / "snapshots" / "aaa").mkdir(parents=True)
    (repo / "snapshots" / "aaa" / "config.json").write_text("{}")
    with pytest.raises(WeightsNotFoundError):
        find_hf_snapshot(cfg)

    for rev in ("old", "main1"):
        make_dir(repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("main1\n")
    os.utime(repo / "snapshots" / "old", (2e9, 2e9))  # newest, but refs/main wins
    assert find_hf_snapshot(cfg) == repo / "snapshots" / "main1"
    (repo / "refs" / "main").write_text("gone")
    assert find_hf_snapshot(cfg) == repo / "snapshots" / "old"


def test_find_hf_snapshot_extra_roots(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    cfg = get_preset("qwen2.5-7b")
    make_dir(tmp_path / "other" / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "x")
    snap = find_hf_snapshot(cfg, extra_roots=[tmp_path / "other"])
    assert snap.name == "x"


# --------------------------------------------------------------------------- orbax


def test_save_restore_roundtrip(tmp_path):
    make_dir(tmp_path / "m", model_type="qwen2", bias=True)
    cfg, params = load_safetensors_dir(tmp_path / "m", dtype=jnp.bfloat16)
    cfg = cfg.replace(rope_scaling=PRESETS["llama3.1-8b"].rope_scaling, eos_token_ids=(2, 5))
    save_params(params, tmp_path / "ckpt", cfg)
    cfg2, params2 = restore_params(tmp_path / "ckpt")
    assert cfg2 == cfg
    assert_tree_equal(params2, jax.tree.map(np.asarray, params), jnp.dtype(jnp.bfloat16))
    for x in jax.tree.leaves(params2):
        assert isinstance(x, jax.Array)


def test_restore_errors(tmp_path):
    with pytest.raises(WeightsFormatError):
        restore_params(tmp_path / "nothing")


def test_cached_convert_calls_loader_once(tmp_path):
    make_dir(tmp_path / "m")
    calls = []

    def loader():
        calls.append(1)
        return load_safetensors_dir(tmp_path / "m", dtype=jnp.float32)

    key = source_key(tmp_path / "m", jnp.float32)
    assert key != source_key(tmp_path / "m", jnp.bfloat16)
    cfg1, p1 = cached_convert(key, loader, cache_dir=tmp_path / "cache")
    cfg2, p2 = cached_convert(key, loader, cache_dir=tmp_path / "cache")
    assert len(calls) == 1 and cfg1 == cfg2
    assert_tree_equal(p2, jax.tree.map(np.asarray, p1), jnp.dtype(jnp.float32))
    # Only the finished entry is left behind, no temporaries.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [key]


def test_cached_convert_ignores_partial_entry(tmp_path):
    make_dir(tmp_path / "m")
    (tmp_path / "cache" / "k" / "params").mkdir(parents=True)  # as if a crash mid-write
    calls = []

    def loader():
        calls.append(1)
        return load_safetensors_dir(tmp_path / "m", dtype=jnp.float32)

    cached_convert("k", loader, cache_dir=tmp_path / "cache")
    cached_convert("k", loader, cache_dir=tmp_path / "cache")
    assert len(calls) == 1


# --------------------------------------------------------------------------- load_model


def test_load_model_unknown_preset(tmp_path):
    with pytest.raises(UnknownModelError):
        load_model("no-such-model", cache_dir=tmp_path)


def test_load_model_missing_path(tmp_path):
    with pytest.raises(WeightsNotFoundError):
        load_model(model_path=tmp_path / "absent", cache_dir=tmp_path)


def test_load_model_hf_dir(tmp_path, monkeypatch):
    from models import tokenizer
    monkeypatch.setattr(tokenizer.Tokenizer, "from_hf_dir", staticmethod(lambda p: ("tok", p)))
    t = make_dir(tmp_path / "tiny")
    m1 = load_model(model_path=tmp_path / "tiny", dtype=jnp.float32, cache_dir=tmp_path / "c")
    m2 = load_model(str(tmp_path / "tiny"), dtype=jnp.float32, cache_dir=tmp_path / "c")
    assert m1.cfg == m2.cfg and m1.cfg.name == "tiny" and m1.tokenizer == ("tok", tmp_path / "tiny")
    assert_tree_equal(m2.params, expect(t), jnp.dtype(jnp.float32))
    assert len(list((tmp_path / "c").iterdir())) == 1  # the second load hit the cache
    with pytest.raises(WeightsFormatError, match="llama3-8b"):
        load_model("llama3-8b", model_path=tmp_path / "tiny", cache_dir=tmp_path / "c")


def test_load_model_preset_without_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HF_HOME", raising=False)
    with pytest.raises(WeightsNotFoundError, match="qwen2.5-7b"):
        load_model("qwen2.5-7b", cache_dir=tmp_path / "cache")


# --------------------------------------------------------------------------- random init


def test_random_params_smollm2():
    cfg = get_preset("smollm2-135m")
    params = random_params(cfg, jax.random.key(0), jnp.float32)
    check_params(params, cfg)
    for x in jax.tree.leaves(params):
        assert x.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(params["final_norm"]["scale"]), 1.0)
    emb = np.asarray(params["embed"]["embedding"])
    assert 0.015 < emb.std() < 0.025
    q = np.asarray(params["layers"]["attn"]["q_proj"]["kernel"])
    assert not np.array_equal(q[0], q[1])  # layers differ


def test_big_preset_random_params_abstract():
    # Big presets are only traced (eval_shape), never materialised.
    for name in ("llama3-70b", "qwen2.5-32b"):
        cfg = get_preset(name)
        abstract = jax.eval_shape(lambda: random_params(cfg, 0, jnp.bfloat16))
        got = jax.tree.map(lambda x: x.shape, abstract)
        assert got == jax.tree.map(tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(abstract))
