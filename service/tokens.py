"""Each token id's text and bytes, as OpenAI's logprobs report them (`token`, `bytes`).

Built once per server, on a worker thread, from the tokenizer (read-only). Byte-level BPE
vocabularies (GPT-2 style: SmolLM2, Llama 3, Qwen) map each piece's characters back to bytes; SentencePiece
ones (Llama 2, Gemma) read `▁` as a space and `<0xNN>` as a byte; special tokens keep their text. A token that is
not whole UTF-8 on its own is written `bytes:\\xNN...` (vLLM's spelling), its `bytes` exact either way.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass(slots=True)
class TokenTexts:
    texts: list[str]
    raw: list[bytes]

    def text(self, token_id: int) -> str:
        return self.texts[token_id] if 0 <= token_id < len(self.texts) else ""

    def bytes(self, token_id: int) -> list[int]:
        return list(self.raw[token_id]) if 0 <= token_id < len(self.raw) else []


def build_token_texts(tokenizer, vocab_size: int) -> TokenTexts:
    """Every id of the model's vocabulary (which may be larger than the tokenizer's)."""
    size = max(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    decoder = gpt2_byte_decoder()
    byte_level = sum(1 for p in pieces[:2000] if p and all(ch in decoder for ch in p)) > 0.9 * min(2000, len(pieces))
    texts, raw = [], []
    for token_id in range(size):
        piece = pieces[token_id] if token_id < len(pieces) else None
        if piece is None:
            data = b""
        elif token_id in special:
            data = piece.encode()
        elif byte_level and all(ch in decoder for ch in piece):
            data = bytes(decoder[ch] for ch in piece)
        else:
            m = _BYTE_PIECE.fullmatch(piece)
            data = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        raw.append(data)
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            texts.append("bytes:" + "".join(f"\\x{b:02x}" for b in data))
    return TokenTexts(texts, raw)
