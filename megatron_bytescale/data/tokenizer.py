"""Byte-level tokenization: token id = UTF-8 byte value, plus a few special ids above 255.

Why bytes: no vocabulary file to download, exact round trip for any text, and the vocab fits
the tiny model (``--vocab-size 512`` in configs/models/tiny.args). Ids:

    0-255   the bytes of the UTF-8 text
    256     EOD (end of document), appended to every document
    257     PAD (never written to datasets; for callers that pad)

This is megatron-core's ``ByteLevelTokenizer`` (megatron.core.tokenizers) with EOD/PAD moved
above the byte range, so byte 0 and EOD never collide. Encoding itself is a zero-copy view of
the bytes (``numpy.frombuffer``); ``ByteLevelTokenizer.text_to_ids`` builds a Python list per
byte, far too slow for multi-megabyte repositories (a test checks both give the same ids).

Training on these datasets with Megatron's ``pretrain_gpt.py``:
``--tokenizer-type NullTokenizer --vocab-size 512`` (the dataset's vocabulary: the HDP loader refuses a
smaller one; our loader appends EOD 256 itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

BYTE_VOCAB = 256


@dataclass(frozen=True)
class ByteTokenizer:
    vocab_size: int = 512
    eod: int = 256
    pad: int = 257
    name: str = "byte-level"

    def __post_init__(self) -> None:
        if min(self.eod, self.pad) < BYTE_VOCAB or max(self.eod, self.pad) >= self.vocab_size or self.eod == self.pad:
            raise ConfigError(
                f"byte-level tokenizer needs distinct EOD/PAD ids in [256, vocab_size); got eod={self.eod}, "
                f"pad={self.pad}, vocab_size={self.vocab_size}. Use a vocab size of at least 258 (the tiny model uses "
                "512)."
            )

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids (uint8 view for bytes input; callers widen when writing)."""
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(raw, dtype=np.uint8)

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        return ids[ids < BYTE_VOCAB].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def megatron_tokenizer(self):
        """The equivalent megatron-core tokenizer object (for code that wants Megatron's API)."""
        from megatron.core.tokenizers.text.libraries.bytelevel_tokenizer import ByteLevelTokenizer

        return ByteLevelTokenizer(vocab_size=self.vocab_size, _eos_id=self.eod, _pad_id=self.pad)

    def to_dict(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}

    @classmethod
    def from_dict(cls, data: dict, source: str) -> ByteTokenizer:
        if data.get("type") != "byte-level":
            raise ConfigError(
                f"{source}: tokenizer {data.get('type')!r} is not supported; rebuild with `bytescale prepare-data`"
            )
        return cls(vocab_size=int(data["vocab_size"]), eod=int(data["eod"]), pad=int(data["pad"]))
