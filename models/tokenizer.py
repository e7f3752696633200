"""Tokenizers for the served models, built from GGUF metadata or a Hugging Face folder.

Both sources produce a :class:`Tokenizer` wrapping a ``tokenizers.Tokenizer``
(byte-level BPE for every supported family) together with the chat template and
the token ids that end a turn. :class:`IncrementalDetokenizer` turns a stream of
generated ids into text without ever emitting half a UTF-8 character.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

from models.errors import WeightsFormatError, WeightsNotFoundError

# Tokens that close a chat turn in the supported families (ChatML, Llama 3).
# Generation must stop on them even when the file names a different EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>")

# GGUF ``tokenizer.ggml.token_type`` values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes llama.cpp uses for its ``tokenizer.ggml.pre`` names; they are
# the same patterns the models' own tokenizer.json files use.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the chat template and stop tokens of one model."""

    def __init__(self, backend, *, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None):
        """Wrap ``backend`` (a ``tokenizers.Tokenizer``).

        ``eos_token_ids`` are the ids the model's metadata names; the ids of
        end-of-turn tokens present in the vocabulary are appended.
        """
        self._tok = backend
        self._bos_token_id = bos_token_id
        ids = list(eos_token_ids)
        for text in END_OF_TURN_TOKENS:
            tid = backend.token_to_id(text)
            if tid is not None:
                ids.append(tid)
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in ids))
        self._chat_template = chat_template

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader) -> "Tokenizer":
        """Build the tokenizer stored in a GGUF file (a path or an open ``GGUFReader``)."""
        from models.gguf_loader import gguf_field, open_gguf_reader

        reader = (open_gguf_reader(path_or_reader)
                  if isinstance(path_or_reader, (str, os.PathLike)) else path_or_reader)
        where = str(getattr(reader, "source_path", None) or "<gguf>")

        def field(key, default=None):
            return gguf_field(reader, key, default)

        kind = field("tokenizer.ggml.model")
        tokens = field("tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise WeightsFormatError(f"{where}: no tokenizer metadata (tokenizer.ggml.*)")
        if kind != "gpt2":
            raise WeightsFormatError(
                f"{where}: unsupported tokenizer model {kind!r} (only byte-level BPE, 'gpt2')")
        merges = field("tokenizer.ggml.merges")
        if merges is None:
            raise WeightsFormatError(f"{where}: BPE tokenizer without tokenizer.ggml.merges")
        types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
        bos = field("tokenizer.ggml.bos_token_id")
        eos_ids = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        try:
            backend = build_bpe_tokenizer(
                tokens, merges, types, pre=field("tokenizer.ggml.pre", "default"),
                bos_token=tokens[bos] if add_bos and bos is not None else None)
        except WeightsFormatError as e:
            raise WeightsFormatError(f"{where}: {e}") from None
        except Exception as e:  # tokenizers rejects merges of unknown tokens, etc.
            raise WeightsFormatError(
                f"{where}: inconsistent tokenizer metadata ({_one_line(e)})") from None
        return cls(backend, bos_token_id=None if bos is None else int(bos),
                   eos_token_ids=[int(i) for i in eos_ids if i is not None],
                   chat_template=field("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` from a Hugging Face model folder.

        ``tokenizer_config.json`` (chat template, BOS/EOS tokens),
        ``chat_template.jinja`` and ``generation_config.json`` (EOS ids) are
        used when present.
        """
        from tokenizers import Tokenizer as Backend

        folder = Path(path)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise WeightsNotFoundError(f"no tokenizer.json in {folder}")
        try:
            backend = Backend.from_file(str(tj))
        except Exception as e:
            raise WeightsFormatError(f"{tj}: unreadable tokenizer ({_one_line(e)})") from None
        tcfg = _read_json(folder / "tokenizer_config.json")
        gcfg = _read_json(folder / "generation_config.json")

        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        gen_eos = gcfg.get("eos_token_id")
        eos_ids: list[int] = (list(gen_eos) if isinstance(gen_eos, list)
                              else [] if gen_eos is None else [gen_eos])
        eos_text = _token_content(tcfg.get("eos_token"))
        if eos_text is not None and backend.token_to_id(eos_text) is not None:
            eos_ids.append(backend.token_to_id(eos_text))
        bos_text = _token_content(tcfg.get("bos_token"))
        bos = backend.token_to_id(bos_text) if bos_text is not None else None
        if bos is None:
            bos = gcfg.get("bos_token_id")
        return cls(backend, bos_token_id=bos, eos_token_ids=[int(i) for i in eos_ids],
                   chat_template=template)

    # -- properties ---------------------------------------------------------------

    @property
    def backend(self):
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the model's EOS plus end-of-turn tokens."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary entry ``token`` (e.g. ``"<|im_end|>"``), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry of ``token_id`` (byte-level form, e.g. ``"Ġworld"``)."""
        return self._tok.id_to_token(token_id)

    # -- encoding -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it become single ids.

        BOS is prepended only when the model asks for it (its post-processor);
        pass ``add_special_tokens=False`` for text that already carries it,
        such as a rendered chat template that starts with ``{{ bos_token }}``.
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences decode to U+FFFD."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the chat template.

        Rendering matches ``transformers``: a sandboxed Jinja environment with
        ``trim_blocks``/``lstrip_blocks``, ``bos_token``/``eos_token`` and any
        extra ``kwargs`` (e.g. ``tools``, ``date_string``) as variables.
        """
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        variables: dict[str, Any] = {}
        if self._bos_token_id is not None:
            variables["bos_token"] = self._tok.id_to_token(self._bos_token_id)
        if self._eos_token_ids:
            variables["eos_token"] = self._tok.id_to_token(self._eos_token_ids[0])
        variables.update(kwargs)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    @cached_property
    def _compiled_template(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            from jinja2.exceptions import TemplateError
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self._chat_template)


def build_bpe_tokenizer(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                        pre: str = "default", bos_token: str | None = None):
    """A byte-level BPE ``tokenizers.Tokenizer`` from llama.cpp-style vocabulary lists.

    ``pre`` is GGUF's ``tokenizer.ggml.pre``: ``smollm`` splits digits then
    applies the GPT-2 byte-level regex (as SmolLM2's tokenizer.json does);
    ``llama-bpe`` and ``qwen2``/``deepseek-r1-qwen`` use their models' split
    regexes; anything else falls back to the GPT-2 byte-level regex.
    ``bos_token``, if given, is prepended by the post-processor.
    """
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # duplicated entries keep their first id
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise WeightsFormatError(f"malformed BPE merge {m!r}")
        pairs.append((a, b))
    llama3 = pre in _LLAMA3_PRE
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=llama3))
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif llama3 or pre in _QWEN2_PRE:
        regex = _LLAMA3_SPLIT if llama3 else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if not llama3:
            backend.normalizer = normalizers.NFC()
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    if bos_token is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A:0 {bos_token}:1 $B:1",
            special_tokens=[(bos_token, vocab[bos_token])])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)

    # Control tokens (type 3) must match as whole units, never through BPE.
    special = [t for t, ty in zip(tokens, token_types) if ty == _TOKEN_TYPE_CONTROL]
    user = [t for t, ty in zip(tokens, token_types) if ty == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend


class IncrementalDetokenizer:
    """Turns generated ids into text pieces for streaming.

    The concatenation of everything :meth:`push` and :meth:`flush` return
    equals ``tokenizer.decode(all_ids)``. Text whose last character is still
    an incomplete UTF-8 sequence (decoded as U+FFFD) is held back.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        # ids[prefix:read] is already-emitted context; decoding from `prefix`
        # rather than from `read` keeps decoders that depend on the previous
        # token (leading-space handling) consistent with a full decode.
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly empty)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (incomplete characters as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if not final and (len(text) <= len(done) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise WeightsFormatError(f"{path}: unreadable JSON ({_one_line(e)})") from None
    return data if isinstance(data, dict) else {}


def _token_content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


__all__ = ["Tokenizer", "IncrementalDetokenizer", "build_bpe_tokenizer", "END_OF_TURN_TOKENS"]
