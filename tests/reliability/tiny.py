"""A tiny random Llama (the embedded model's tokenizer, 2 layers of width 32) and fake model runners.

The engine is built exactly as in production (`LLMEngine(EngineConfig(model=dir))`: loader, model code,
scheduler, BlockPool, runner); only the weights are random and small, so a step costs milliseconds on CPU.
`ScriptedRunner` replaces `engine.runner` where even that is too slow (hypothesis), and `FaultyRunner` wraps a
real runner to raise inside chosen steps.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import threading
import zlib
from pathlib import Path
from typing import Callable, Iterator

import torch

from engine import EngineConfig, LLMEngine
from engine.request import SeqKind
from engine.runner import RunnerOutput
from engine.scheduler import Batch

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def make_tiny_model_dir(target: Path, seed: int = 0) -> Path:
    """An HF Llama directory with random tiny weights and SmolLM2's tokenizer and chat template."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.loader import default_model_dir, read_config
    from engine.settings import Settings

    src = default_model_dir(Settings.from_env().cache_dir)
    cfg = {**read_config(src), **TINY}
    cfg.pop("head_dim", None)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, target / name)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(cfg))
    return target


@contextlib.contextmanager
def shared_tokenizer() -> Iterator[None]:
    """Engines built inside share one loaded tokenizer per directory (loading it is most of a tiny engine's
    start-up, and hypothesis builds one engine per example)."""
    import transformers

    original = transformers.AutoTokenizer.from_pretrained
    cache: dict[str, object] = {}

    def cached(path, *args, **kwargs):
        key = str(path)
        if key not in cache:
            cache[key] = original(path, *args, **kwargs)
        return cache[key]

    transformers.AutoTokenizer.from_pretrained = cached
    try:
        yield
    finally:
        transformers.AutoTokenizer.from_pretrained = original


def tiny_engine(model_dir: Path, **config) -> LLMEngine:
    """Plain budget filling unless `config` names an objective: what a step holds must not depend on a step-time
    model fitted to this host's timing (a hypothesis state machine replays its rules and needs the same states)."""
    config.setdefault("tpot_target_ms", None)
    return LLMEngine(EngineConfig(model=str(model_dir), **config))


def scripted_token(request_id: str, index: int, vocab: int = 49152) -> int:
    """The token a ScriptedRunner samples for a request's index-th output (never 0..15: no special tokens)."""
    return 16 + zlib.crc32(f"{request_id}/{index}".encode()) % (vocab - 16)


class ScriptedRunner:
    """Stands in for ModelRunner: deterministic tokens and scores, and a shadow KV store it checks.

    Every token a step computes is written into `shadow` at the (block, slot) its block table names; every
    position a sequence attends to must read back its own token (so the scheduler and the block pool never
    hand one block to two live sequences, nor a block whose content was overwritten). Requests whose id
    contains "eos" sample EOS (`eos_id`) as their third token.
    """

    def __init__(self, block_size: int, eos_id: int, budget: int, max_seqs: int) -> None:
        self.block_size = block_size
        self.eos_id = eos_id
        self.budget = budget
        self.max_seqs = max_seqs
        self.shadow: dict[tuple[int, int], int] = {}
        self.fail_next: BaseException | None = None  # raised (once) by the next run()
        self.batches: list[list[str]] = []  # request ids per run() call, failed ones included
        self.violations: list[str] = []  # assertions that failed inside run()
        self.pool = None  # the engine's BlockPool, when set: a block two sequences hold is never written

    def run(self, batch: Batch, staged=None) -> RunnerOutput:
        # `staged`: the engine's staged encoder states (engine/staged_states.py); these tiny models have no encoder rows.
        # The engine turns any exception of a step into failed requests: keep our own findings visible.
        try:
            return self._run(batch)
        except AssertionError as exc:
            self.violations.append(repr(exc))
            raise

    def _run(self, batch: Batch) -> RunnerOutput:
        assert batch.num_tokens <= self.budget, (batch.num_tokens, self.budget)
        assert len(batch) <= self.max_seqs, (len(batch), self.max_seqs)
        self.batches.append([s.request_id for s in batch.seqs])
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        bs = self.block_size
        out = RunnerOutput.empty(len(batch))
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            assert len(seq.block_table) * bs >= end, (seq.request_id, seq.block_table, end)
            for pos in range(start, end):
                if self.pool is not None:
                    assert self.pool.ref_counts[seq.block_table[pos // bs]] == 1, (seq.request_id, pos)
                self.shadow[(seq.block_table[pos // bs], pos % bs)] = seq.token_ids[pos]
            for pos in range(end):  # what attention would read: this sequence's own tokens only
                got = self.shadow.get((seq.block_table[pos // bs], pos % bs))
                assert got == seq.token_ids[pos], (seq.request_id, pos, got, seq.token_ids[pos])
            completes = end == seq.num_tokens
            if seq.logprob_start is not None:  # as the runner: the prompt tokens this chunk predicts (a pair's span)
                first, stop = max(start, seq.logprob_start - 1), min(end, seq.num_prompt_tokens - 1)
                if stop > first:
                    out.prompt_logprobs[row] = [-(zlib.crc32(repr(seq.token_ids[:p + 2]).encode()) % 1000) / 1000
                                                for p in range(first, stop)]
                    if seq.num_prompt_logprobs is not None:
                        out.prompt_top_logprobs[row] = [{seq.token_ids[p + 1]: v} for p, v in
                                                        zip(range(first, stop), out.prompt_logprobs[row])]
            if seq.kind is SeqKind.RERANK:
                if completes and seq.logprob_start is None:  # a mode that scores at the pair's last position
                    out.scores[row] = (zlib.crc32(repr(seq.token_ids[-8:]).encode()) % 1000) / 1000
            elif completes:
                index = seq.num_output_tokens
                token = self.eos_id if "eos" in seq.request_id and index == 2 else scripted_token(seq.request_id, index)
                out.sampled[row] = token
        return out


class FaultyRunner:
    """Wraps a real ModelRunner; `fail_when(batch)` returning an exception makes that step raise it."""

    def __init__(self, inner, fail_when: Callable[[Batch], BaseException | None]) -> None:
        self._inner = inner
        self.fail_when = fail_when
        self.failed_batches: list[list[str]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):  # scorer, kv_caches, ...: the real runner's
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        if name in ("_inner", "fail_when", "failed_batches", "_lock"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def run(self, batch: Batch, staged=None) -> RunnerOutput:
        error = self.fail_when(batch)
        if error is not None:
            with self._lock:
                self.failed_batches.append(sorted({s.request_id for s in batch.seqs}))
            raise error
        return self._inner.run(batch, staged)
