"""Request intake: what every kind's builder reads to check and tokenize a request before anything reaches the
scheduler (the tokenizer, the limits, the scorer, the pooling encoders, the arrival counter), and the prompt and chat
tokenizing a generation and the service's /tokenize share.

Every check raises ValueError naming the field, so the service can answer INVALID_ARGUMENT and nothing is queued
(NotLoaded, a ValueError, where the engine lacks what the request needs: FAILED_PRECONDITION). These checks are the
only ones: the service's core API and its doors do not repeat them (an empty input, the document and input counts,
no embedder), they pass what the engine says on. Each kind's builder lives with its kind (engine/kinds.py lists
them: engine/generation_intake.py, engine/rerank/intake.py, engine/embed/intake.py).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable

from engine import chat_templates
from engine.config import EngineConfig, PoolingTask
from engine.embed import Embedder
from engine.rerank import PairScorer

if TYPE_CHECKING:
    from engine.structured import GrammarCompiler


class RequestIntake:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, max_model_len: int, budget: int,
                 scorer: PairScorer, grammar_compiler: "Callable[[], GrammarCompiler] | None" = None,
                 max_model_len_by: str = "max_model_len", poolers: dict[PoolingTask, Embedder] | None = None
                 ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.budget = budget  # tokens of one step: a cross-encoder pair runs whole, so it must fit
        self.max_model_len_by = max_model_len_by  # what sets max_model_len, named in errors
        self.scorer = scorer
        # Every pooling encoder by task, the one owner of them: an EmbedSpec's params.task picks the one that runs
        # its rows (the embedder is poolers[PoolingTask.EMBED])
        self.poolers = dict(poolers or {})
        self.grammar_compiler = grammar_compiler  # called only for a request with structured_outputs
        self.arrivals = itertools.count()  # admission order of every row, whatever its kind
        # A chat stops at its template's end-of-turn tokens as at EOS (Gemma's <end_of_turn> is not its GGUF's EOS).
        self.end_of_turn_ids = chat_templates.end_of_turn_ids(tokenizer, getattr(tokenizer, "chat_template", None))

    @property
    def embedder(self) -> Embedder | None:
        """The embedding model (a rerank mode that embeds reads it too); None: not loaded."""
        return self.poolers.get(PoolingTask.EMBED)

    def chat_token_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat rendered by the chat template for a reply; `tools` (OpenAI function definitions) in the
        template's own tool format, as transformers renders them."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content}")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string role and string content")
        if not self.tokenizer.chat_template:
            raise ValueError("messages: this model has no chat template (a base model): start the server with "
                             f"--chat-template NAME ({', '.join(chat_templates.names())}) or a Jinja file "
                             "(EngineConfig.chat_template), or send a prompt instead")
        if tools and "tools" not in self.tokenizer.chat_template:
            raise ValueError("tools: this model's chat template has no tool format (give one that renders tools "
                             "with --chat-template)")
        ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def prompt_token_ids(self, prompt, messages, tools: list[dict] | None = None) -> list[int]:
        if messages is not None:
            if prompt is not None:
                raise ValueError("give either prompt or messages, not both")
            return self.chat_token_ids(messages, tools)
        if tools:
            raise ValueError("tools need messages (a chat), not a prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt must not be empty")
            vocab = self.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            return list(prompt)
        if prompt is None:
            raise ValueError("request has no input: set prompt, messages or token_ids")
        raise ValueError("prompt must be a string or a list of token ids")
