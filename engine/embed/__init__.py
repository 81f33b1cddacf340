"""Embeddings: an Embedder (engine/embed/embedder.py) turns texts into encoder rows and packed rows into vectors;
EmbedJob tracks one request's rows. The scheduler sees a row only as a prefill-only, KV-free sequence
(SeqKind.EMBED) that runs whole, like a cross-encoder pair."""
from __future__ import annotations

from engine.embed.embedder import EmbedRow, Embedder, embedded_embedder_dir
from engine.embed.job import EmbedJob
from engine.embed.pooling import Pooling

__all__ = ["EmbedJob", "EmbedRow", "Embedder", "Pooling", "embedded_embedder_dir"]
