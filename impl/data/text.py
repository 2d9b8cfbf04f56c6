"""Text <-> token ids for a model: one small adapter whatever the model's vocabulary is.

Three kinds, chosen from the model spec by `tokenizer_for`:

- `HFTokenizer`: a checkpoint folder that brings its own tokenizer (tokenizer.json or
  tokenizer_config.json beside config.json), loaded with transformers' `AutoTokenizer`.
- `ByteTokenizer`: a byte-level vocabulary (at most 256 ids, no tokenizer files), such as the
  embedded `tiny-gsm` checkpoint and the `tiny` preset: a token id is a byte of the UTF-8 text,
  exactly as `impl.data.arith` and `scripts/eval_tiny.py` encode prompts. It has no EOS token
  (the tiny model ends an answer with text, the END after `#### N`).
- `NoTokenizer`: a random-weight preset with a large vocabulary and no tokenizer (the Ling
  shapes): only workloads of token ids (synthetic) make sense; encoding text raises and says so.

Every adapter has `encode(text) -> list[int]`, `decode(ids) -> str`, `eos_id` (int or None),
`vocab_size` (the ids it may produce, for random prompts) and `name`.
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Protocol, Sequence

BYTE_VOCAB_MAX = 256  # a vocabulary this small, without tokenizer files, is bytes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TokenizerError(ValueError):
    pass


class VocabularyError(TokenizerError):
    """Text a byte vocabulary cannot hold; `n_tokens` is how many ids it would have taken, so a
    caller can still tell whether it would have fit a context."""

    def __init__(self, message: str, n_tokens: int):
        super().__init__(message)
        self.n_tokens = n_tokens


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _as_list(ids) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


class ByteTokenizer:
    """Token id = byte of the UTF-8 text. With 128 ids (the tiny models) only ASCII fits."""

    eos_id = None

    def __init__(self, vocab_size: int = 128, name: str = "bytes"):
        if not 1 <= vocab_size <= BYTE_VOCAB_MAX:
            raise TokenizerError(f"a byte vocabulary has 1 to {BYTE_VOCAB_MAX} ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.name = name

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        if ids and max(ids) >= self.vocab_size:
            i = next(i for i, ch in enumerate(text) if max(ch.encode("utf-8")) >= self.vocab_size)
            raise VocabularyError(
                f"{self.name}: character {text[i]!r} at offset {i} of the text is outside the byte "
                f"vocabulary of {self.vocab_size} ids (text near it: {text[max(0, i - 20):i + 20]!r})", len(ids))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        # For ids < 128 this is arith.text_of's ASCII decoding, byte for byte.
        return bytes(_as_list(ids)).decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, name={self.name!r})"


class HFTokenizer:
    """A transformers tokenizer. No special tokens are added on encoding (no BOS), as
    lm-evaluation-harness encodes a causal model's context; decoding drops special tokens."""

    def __init__(self, tokenizer, name: str = "tokenizer"):
        self.tok = tokenizer
        self.name = name
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id

    @classmethod
    def from_folder(cls, folder: str | Path) -> "HFTokenizer":
        from transformers import AutoTokenizer
        folder = Path(folder)
        try:
            tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:  # transformers raises many types here; say which folder failed
            raise TokenizerError(f"{folder}: could not load its tokenizer with AutoTokenizer: {e}") from e
        return cls(tok, name=folder.name)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(_as_list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class NoTokenizer:
    """A model without a tokenizer: its workloads are token ids only."""

    eos_id = None
    has_text = False  # outputs are ids; a serving record's text is ""

    def __init__(self, vocab_size: int, name: str = "model"):
        self.vocab_size = vocab_size
        self.name = name

    def _refuse(self):
        raise TokenizerError(
            f"model {self.name!r} has no tokenizer (a vocabulary of {self.vocab_size} ids and no tokenizer "
            "files), so it cannot run a text workload; use a synthetic workload (token ids), a byte-level "
            "model, or a checkpoint folder that holds its tokenizer")

    def encode(self, text: str) -> list[int]:
        self._refuse()

    def decode(self, ids: Sequence[int]) -> str:
        self._refuse()

    def __repr__(self) -> str:
        return f"NoTokenizer(vocab_size={self.vocab_size}, name={self.name!r})"


def has_tokenizer_files(folder: str | Path) -> bool:
    folder = Path(folder)
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def write_byte_tokenizer(folder: str | Path, vocab_size: int, max_length: int) -> None:
    """Tokenizer files for a byte vocabulary of `vocab_size` ids (at most 128: ASCII), so that
    other engines (vLLM, SGLang, transformers) load the checkpoint with the tokenizer this project
    uses: a `tokenizers` WordLevel model of the characters 0..vocab_size-1, split per character,
    decoded by joining them (`decoders.Fuse`): ids equal the bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    if not 1 <= vocab_size <= 128:
        raise TokenizerError(f"a byte tokenizer file covers ASCII (at most 128 ids), got {vocab_size}")
    folder = Path(folder)
    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(vocab_size)}, unk_token="\x00"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "unk_token": "\x00",
         "clean_up_tokenization_spaces": False, "moeperf_byte_vocabulary": vocab_size}, indent=2) + "\n")


def _byte_vocabulary(folder: Path) -> int | None:
    """The byte vocabulary's size where `folder`'s tokenizer files are write_byte_tokenizer's."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("moeperf_byte_vocabulary") if isinstance(config, dict) else None
    return size if isinstance(size, int) else None


def tokenizer_for(spec, vocab_size: int | None = None) -> Tokenizer:
    """The adapter for the model that `impl.model.build_model(spec)` builds.

    `spec` is what build_model was given: a preset name, a ModelConfig, an embedded checkpoint
    name or a checkpoint folder; `vocab_size` is the model's (`model.config.vocab_size`), read
    from the spec when omitted. A folder with tokenizer files gets its own tokenizer (which must
    not produce ids past the model's embedding); otherwise a vocabulary of at most 256 ids is
    bytes, and a larger one has no tokenizer."""
    from impl.model.config import EMBEDDED
    from impl.model.config import PRESETS, ModelConfig, get_config

    folder: Path | None = None
    if isinstance(spec, ModelConfig):
        name, config = spec.name, (lambda: spec)
    elif isinstance(spec, (str, Path)) and str(spec) in PRESETS:
        name, config = str(spec), (lambda: get_config(str(spec)))
    elif isinstance(spec, (str, Path)) and (str(spec) in EMBEDDED or Path(spec).is_dir()):
        from impl.model.loading import read_config
        folder = EMBEDDED.get(str(spec), Path(spec))
        name, config = str(spec), (lambda: read_config(folder))
    else:
        raise TokenizerError(f"model spec {spec!r} is neither a preset ({sorted(PRESETS)}), an embedded "
                             f"checkpoint ({sorted(EMBEDDED)}), a ModelConfig nor a checkpoint folder")
    vocab = vocab_size if vocab_size is not None else config().vocab_size
    if folder is not None and _byte_vocabulary(folder):
        # The byte tokenizer's files, shipped for other engines: the same ids as ByteTokenizer,
        # which refuses a character outside the vocabulary where the file's model would map it to 0.
        return ByteTokenizer(_byte_vocabulary(folder), name)
    if folder is not None and has_tokenizer_files(folder):
        tok = HFTokenizer.from_folder(folder)
        if tok.vocab_size > vocab:
            raise TokenizerError(f"{folder}: its tokenizer has {tok.vocab_size} ids but the model embeds only "
                                 f"{vocab}; the tokenizer does not belong to this checkpoint")
        return tok
    if vocab <= BYTE_VOCAB_MAX:
        return ByteTokenizer(vocab, name=name)
    return NoTokenizer(vocab, name=name)
