"""Other projects' servers and libraries the benchmarks measure tandem against, each driven from here.

* llama_server.py: llama.cpp's `llama-server` and `llama-quantize`, built from source and cached;
* st_server.py: sentence-transformers behind TEI's HTTP shape (`/embed`, `/rerank`);
* st_worker.py: sentence-transformers `encode` timed in a peer venv's own process;
* venvs.py: the peer virtual environments (sentence-transformers with ONNX Runtime, Infinity), made and cached.

A peer that cannot be built, installed or started raises `PeerUnavailable` with the reason; the benchmarks write
that reason into their JSON and go on with the other systems.
"""
from __future__ import annotations


class PeerUnavailable(RuntimeError):
    """A peer could not be built, installed or started; the message says why."""
