"""Tiny CLIP, T5 and Qwen2 tokenizers built in-process, so the demo and the tiny pipelines run offline.

The real tokenizers come from the Hub; dmap never downloads. These are real tokenizer files
(byte-level BPE for CLIP: vocab.json + merges.txt + tokenizer.json; Unigram for T5: tokenizer.json;
byte-level BPE with Qwen's chat special tokens for Qwen2: tokenizer.json),
deterministic, with ids below the tiny text encoders' vocabulary sizes, loadable with the plain
`CLIPTokenizer.from_pretrained` / `T5TokenizerFast.from_pretrained` a pipeline uses.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

# Common English words get their own tokens so prompts do not tokenize into single bytes only.
_WORDS = (
    "a an the of in on and with at to red blue green white black fox cat dog snow forest city "
    "sky night day photo painting portrait of tree river mountain sun moon house car"
).split()


def _bytes_to_unicode() -> list[str]:
    """CLIP's byte -> printable unicode map (the same table GPT-2 uses), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def _clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab: dict[str, int] = {}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    chars = _bytes_to_unicode()
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _WORDS:  # merge each word left to right: "r e" -> "re", "re d</w>" -> "red</w>"
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            merged = pair[0] + pair[1]
            if pair not in merges:
                merges.append(pair)
            if merged not in vocab:
                vocab[merged] = len(vocab)
            symbols = [merged] + symbols[2:]
    return vocab, merges


def write_clip_tokenizer(folder: str | Path, vocab_size: int, model_max_length: int = 77) -> Path:
    """A byte-level BPE CLIP tokenizer with fewer than `vocab_size` ids (< 600 ids)."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_and_merges()
    if len(vocab) > vocab_size:
        raise ValueError(f"the offline CLIP tokenizer needs {len(vocab)} ids; the text encoder has {vocab_size}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    tokenizer.save_pretrained(folder)
    # The classic files as well, for loaders that build CLIP's tokenizer from vocab + merges.
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    return folder


def write_t5_tokenizer(folder: str | Path, vocab_size: int, model_max_length: int = 512) -> Path:
    """A Unigram T5 tokenizer (pad=0, eos=1, unk=2 as in T5) with fewer than `vocab_size` ids."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -4.0) for c in string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation]
    pieces += [("▁" + w, -1.0) for w in _WORDS]
    if len(pieces) > vocab_size:
        raise ValueError(f"the offline T5 tokenizer needs {len(pieces)} ids; the text encoder has {vocab_size}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
    tokenizer.save_pretrained(folder)
    return folder


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _qwen2_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2 style byte-level BPE: every byte, the common words, and "Ġ" + word (the word after a space)."""
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode())}
    merges: list[tuple[str, str]] = []
    for word in _WORDS:  # merge each word left to right: "r e" -> "re", "re d" -> "red"
        symbols = list(word)
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
            symbols = [pair[0] + pair[1]] + symbols[2:]
    for word in _WORDS:  # then a space before it: "Ġ red" -> "Ġred"
        merges.append(("Ġ", word))
        vocab.setdefault("Ġ" + word, len(vocab))
    for special in QWEN_SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    return vocab, merges


def write_qwen2_tokenizer(folder: str | Path, vocab_size: int, model_max_length: int = 32768) -> Path:
    """A byte-level BPE Qwen2 tokenizer (<|im_start|>/<|im_end|> special, pad = <|endoftext|>), < 400 ids."""
    from transformers import Qwen2Tokenizer

    vocab, merges = _qwen2_vocab_and_merges()
    if len(vocab) > vocab_size:
        raise ValueError(f"the offline Qwen2 tokenizer needs {len(vocab)} ids; the text encoder has {vocab_size}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
                               model_max_length=model_max_length)
    tokenizer.save_pretrained(folder)
    return folder


def write_tokenizer_for(tokenizer_class: str, folder: str | Path, encoder_config: dict) -> Path:
    """The tokenizer a pipeline pairs with a text encoder, sized to that encoder's vocabulary."""
    vocab_size = int(encoder_config.get("vocab_size", 1000))
    if "CLIP" in tokenizer_class:
        max_len = int(encoder_config.get("max_position_embeddings", 77))
        return write_clip_tokenizer(folder, vocab_size, model_max_length=max_len)
    if "T5" in tokenizer_class:
        return write_t5_tokenizer(folder, vocab_size)
    if tokenizer_class.startswith("Qwen2Tokenizer"):
        return write_qwen2_tokenizer(folder, vocab_size)
    raise ValueError(f"no offline tokenizer for {tokenizer_class}")
