"""The built-in text encoder's tokenizer, without torch: prompt -> text ids.

Two rules: "bytes" (a prompt's UTF-8 bytes: any text, but the encoder must learn what a word is)
and "words" (lower-cased words and punctuation, each hashed into one of `buckets` ids: a word is
one embedding from the first step, which a small model trained from scratch learns far faster).
The server counts a prompt's tokens with these functions before it queues a job.
"""

from __future__ import annotations

import re
import zlib

TOKEN_UNITS = {"bytes": "bytes (UTF-8)", "words": "tokens (words and punctuation)"}
_WORD = re.compile(r"\w+|[^\w\s]")


def token_ids(prompt: str, tokenizer: str = "bytes", buckets: int = 4096) -> list[int]:
    """A prompt's text ids, without framing: UTF-8 bytes, or hashed lower-cased words."""
    if tokenizer == "bytes":
        return list(prompt.encode("utf-8"))
    # crc32 is stable across processes and platforms, unlike hash() of a str.
    return [zlib.crc32(w.encode("utf-8")) % buckets for w in _WORD.findall(prompt.lower())]


def count_tokens(prompt: str, tokenizer: str = "bytes") -> int:
    """How many text tokens a prompt takes (BOS and EOS not counted)."""
    return len(token_ids(prompt, tokenizer))
