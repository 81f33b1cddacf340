"""vLLM's /tokenize and /detokenize bodies (pydantic), and TEI's /info answer."""
from __future__ import annotations

from typing import Union

from service.core import ModelInfo
from service.http.errors import HttpError
from service.http.openai_schema import ChatMessage, _Model, refuse_extras


class TokenizeRequest(_Model):
    """vLLM's: a prompt, or chat messages rendered with the chat template (add_generation_prompt as for a chat)."""
    model: str = ""
    prompt: Union[str, None] = None
    messages: Union[list[ChatMessage], None] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def checked(self) -> "TokenizeRequest":
        refuse_extras(self)
        if (self.prompt is None) == (self.messages is None):
            raise HttpError(400, "give either prompt or messages", param="prompt")
        if self.messages is not None and not self.add_generation_prompt:
            raise HttpError(400, "add_generation_prompt: false is not supported (chats are rendered for a reply)",
                            param="add_generation_prompt")
        return self

    def chat(self) -> list[dict[str, str]] | None:
        if self.messages is None:
            return None
        out = []
        for i, m in enumerate(self.messages):
            refuse_extras(m, f"messages[{i}].")
            out.append({"role": m.role, "content": m.text(i)})
        return out


class DetokenizeRequest(_Model):
    model: str = ""
    tokens: list[int]


def tei_info(info: ModelInfo, version: str, reranker: str) -> dict:
    """TEI's GET /info: the reranker that scores /rerank (`reranker`: its id, CoreAPI.rerank_name), the dtype its
    forwards run in, and the limits (TEI's model_type for a reranker)."""
    return {"model_id": reranker, "model_sha": None, "model_dtype": info.rerank_dtype or info.dtype,
            "rerank_mode": info.rerank_mode,
            "model_type": {"reranker": {"id2label": {"0": "relevance"}, "label2id": {"relevance": 0}}},
            "max_concurrent_requests": info.max_waiting, "max_input_length": info.rerank_max_pair_tokens,
            "max_batch_tokens": info.rerank_max_pair_tokens, "max_batch_requests": None,
            "max_client_batch_size": info.max_documents, "auto_truncate": True, "tokenization_workers": 1,
            "version": version, "sha": None, "docker_label": None}
