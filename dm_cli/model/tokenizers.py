"""Tiny tokenizers built in-process, so the demo and the tiny pipelines run offline.

The real tokenizers come from the Hub; dmap never downloads. These are real tokenizer files
(byte-level BPE for CLIP: vocab.json + merges.txt + tokenizer.json; Unigram for T5: tokenizer.json;
byte-level BPE with chat templates for Qwen2/Qwen3 and for the Mistral tokenizer inside a Pixtral
processor), deterministic, with ids below the tiny text encoders' vocabulary sizes, loadable with
the plain `<Class>.from_pretrained` a pipeline uses.
"""

from __future__ import annotations

import json
import string
from functools import lru_cache
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
    # transformers: imported on use, so start-up stays free of torch
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
    # transformers: imported on use, so start-up stays free of torch
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


def _byte_level_vocab_and_merges(specials: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2 style byte-level BPE (as Qwen2 and Mistral's tekken are): the 256 byte symbols, then each
    word of _WORDS merged left to right, bare and with the leading-space marker "Ġ"."""
    vocab = {token: i for i, token in enumerate(specials)}
    for c in _bytes_to_unicode():
        vocab.setdefault(c, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _WORDS + ["Ġ" + w for w in _WORDS]:
        symbols = ["Ġ", *word[1:]] if word.startswith("Ġ") else list(word)
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
            symbols = [pair[0] + pair[1]] + symbols[2:]
    return vocab, merges


def _check_vocab(name: str, vocab: dict, vocab_size: int) -> None:
    if len(vocab) > vocab_size:
        raise ValueError(f"the offline {name} tokenizer needs {len(vocab)} ids; the text encoder has {vocab_size}")


# Qwen3's chat template, reduced to what text-to-image pipelines use: plain-text messages, the
# generation prompt, and `enable_thinking=False` (an empty think block, as Qwen3's own template writes).
_QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + text + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def write_qwen2_tokenizer(folder: str | Path, vocab_size: int, model_max_length: int = 32768) -> Path:
    """A byte-level BPE Qwen2 tokenizer (Qwen2.5 and Qwen3 use this class) with Qwen's chat template."""
    # transformers and tokenizers: imported on use, so start-up stays free of torch
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _byte_level_vocab_and_merges(_QWEN_SPECIALS)
    _check_vocab("Qwen2", vocab, vocab_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", unk_token=None, model_max_length=model_max_length)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in _QWEN_SPECIALS])
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


# Mistral's instruct format as Mistral Small 3.x writes it: system prompt, then [INST] user [/INST].
_MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' + text + '[/INST]' -}}"
    "{%- else -%}{{- text + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def write_pixtral_processor(folder: str | Path, encoder_config: dict) -> Path:
    """A PixtralProcessor folder (Mistral-3's): a byte-level BPE Mistral tokenizer with its instruct
    chat template, plus the processor and image-processor configs sized to the encoder's vision tower.

    Written as files, not through `PixtralProcessor` (whose class needs torchvision): with
    torchvision, `PixtralProcessor.from_pretrained` loads the folder; without it, the tokenizer alone
    loads with `AutoTokenizer.from_pretrained`, which is all a text-to-image pipeline uses. Special
    tokens sit at the ids the text encoder's config names (bos/eos/pad, `image_token_index`).
    """
    # transformers and tokenizers: imported on use, so start-up stays free of torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = encoder_config.get("text_config") or {}
    vision = encoder_config.get("vision_config") or {}
    vocab_size = int(text.get("vocab_size", 32000))
    wanted = {  # token -> id the config gives it (None: next free id)
        "<unk>": 0,
        "<s>": encoder_config.get("bos_token_id", text.get("bos_token_id")),
        "</s>": encoder_config.get("eos_token_id", text.get("eos_token_id")),
        "<pad>": encoder_config.get("pad_token_id", text.get("pad_token_id")),
        "[IMG]": encoder_config.get("image_token_index"),
    }
    order = ["<unk>", "<s>", "</s>", "<pad>", "[IMG]", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
             "[IMG_BREAK]", "[IMG_END]"]
    slots = {i: t for t, i in wanted.items() if isinstance(i, int)}  # id -> token
    free = iter(i for i in range(2 * len(order)) if i not in slots)
    for token in order:
        if token not in slots.values():
            slots[next(free)] = token
    if sorted(slots) != list(range(len(slots))):
        raise ValueError(f"the text encoder's special token ids {sorted(slots)} leave gaps the offline tokenizer cannot fill")
    specials = [slots[i] for i in sorted(slots)]
    vocab, merges = _byte_level_vocab_and_merges(specials)
    _check_vocab("Mistral", vocab, vocab_size)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", model_max_length=int(text.get("max_position_embeddings", 512)))
    tokenizer.chat_template = _MISTRAL_CHAT_TEMPLATE
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    patch = int(vision.get("patch_size", 14))
    merge = int(encoder_config.get("spatial_merge_size", 1))
    processor = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
                 "patch_size": patch, "processor_class": "PixtralProcessor", "spatial_merge_size": merge}
    image = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
             "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
             "image_processor_type": "PixtralImageProcessor", "patch_size": patch, "processor_class": "PixtralProcessor",
             "resample": 3, "rescale_factor": 1 / 255, "size": {"longest_edge": int(vision.get("image_size", 1540))}}
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n", encoding="utf-8")
    (folder / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n", encoding="utf-8")
    return folder


# Qwen2-VL's vision tokens and the text encoder config keys that give their ids (its vision tower finds the image's
# place by `image_token_id`, so the offline tokenizer must put them exactly there)
_QWEN_VL_TOKENS = {"<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id",
                   "<|vision_pad|>": "vision_token_id", "<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id"}
# Qwen2.5-VL-7B-Instruct's image processor bounds (min_pixels, max_pixels), as Qwen-Image-Edit's processor has them
_QWEN_VL_PIXELS = (3136, 12845056)


def write_qwen2_vl_processor(folder: str | Path, encoder_config: dict) -> Path:
    """A Qwen2VLProcessor folder (Qwen-Image-Edit's `processor`): the Qwen2 tokenizer with the vision tokens at the
    ids the text encoder's config names, and a Qwen2VLImageProcessor config sized to its vision tower (patch, merge,
    temporal patch). `Qwen2VLProcessor.from_pretrained` loads it where torchvision is installed; without it,
    `qwen2_vl_processor` does (PIL, no video processor)."""
    # transformers and tokenizers: imported on use, so start-up stays free of torch
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text = encoder_config.get("text_config") or {}
    vision = encoder_config.get("vision_config") or {}
    vocab_size = int(encoder_config.get("vocab_size") or text.get("vocab_size", 152064))
    vocab, merges = _byte_level_vocab_and_merges(_QWEN_SPECIALS)
    fixed = {token: encoder_config.get(key) for token, key in _QWEN_VL_TOKENS.items()}
    if not all(isinstance(i, int) and len(vocab) <= i < vocab_size for i in fixed.values()):
        raise ValueError(f"the text encoder's vision token ids {sorted(map(str, fixed.values()))} do not fit the offline "
                         f"Qwen2-VL tokenizer ({len(vocab)} ids) and the vocabulary ({vocab_size})")
    vocab.update(fixed)  # sparse ids: the BPE model keeps them, and the added tokens below take them
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               unk_token=None, model_max_length=32768)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in [*_QWEN_SPECIALS, *fixed]])
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    low, high = _QWEN_VL_PIXELS
    Qwen2VLImageProcessorPil(patch_size=int(vision.get("patch_size", 14)),
                             merge_size=int(vision.get("spatial_merge_size", 2)),
                             temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                             min_pixels=low, max_pixels=high).save_pretrained(folder)
    return folder


def qwen2_vl_processor(folder: str | Path):
    """Qwen2VLProcessor without torchvision, which transformers 5 needs for its video half: the same class with
    transformers' PIL image processor (`Qwen2VLImageProcessorPil`, the slow one) and the folder's tokenizer, and
    no video processor (Qwen-Image-Edit passes images only). Same tokens and pixel values as the processor a
    pipeline without torchvision would have, had transformers built one."""
    # transformers: imported on use, so start-up stays free of torch
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return _image_only_qwen2_vl()(Qwen2VLImageProcessorPil.from_pretrained(folder), Qwen2Tokenizer.from_pretrained(folder))


@lru_cache(maxsize=1)
def _image_only_qwen2_vl():
    # transformers: imported on use, so start-up stays free of torch
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """transformers' Qwen2VLProcessor whose sub-processors are the image processor and the tokenizer only."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor


def torchvision_free_processor(class_name: str, folder: str | Path):
    """A processor class that needs torchvision, built without it where dmap knows how (Qwen2VLProcessor), else None."""
    if class_name in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor"):
        return qwen2_vl_processor(folder)
    return None


_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def write_gemma_tokenizer(folder: str | Path, vocab_size: int, model_max_length: int = 1024) -> Path:
    """A Gemma tokenizer (BPE with byte fallback, spaces as "▁", as Gemma's own): the specials, the 256 byte
    tokens, then each word of _WORDS merged left to right, bare and followed by "▁"."""
    # transformers: imported on use, so start-up stays free of torch
    from transformers import GemmaTokenizer

    vocab = {token: i for i, token in enumerate(_GEMMA_SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    vocab.setdefault("▁", len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _WORDS + [w + "▁" for w in _WORDS]:  # the pre-tokenizer keeps each space after its word
        symbols = list(word)
        for symbol in symbols:
            vocab.setdefault(symbol, len(vocab))
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
            symbols = [pair[0] + pair[1]] + symbols[2:]
    _check_vocab("Gemma", vocab, vocab_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
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
    if "Qwen2Tokenizer" in tokenizer_class:
        return write_qwen2_tokenizer(folder, vocab_size)
    if "GemmaTokenizer" in tokenizer_class:  # LTX-2's Gemma-3 (its vocabulary is the text config's)
        text = encoder_config.get("text_config") or {}
        return write_gemma_tokenizer(folder, int(text.get("vocab_size", vocab_size)))
    if tokenizer_class in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor"):  # Qwen-Image-Edit's (Qwen2.5-VL's)
        return write_qwen2_vl_processor(folder, encoder_config)
    if tokenizer_class == "PixtralProcessor":
        return write_pixtral_processor(folder, encoder_config)
    raise ValueError(f"no offline tokenizer for {tokenizer_class}")
