"""The synchronous engine: scheduler, paged KV cache, model runner, sampling. No gRPC here."""
from engine.config import EmbedParams, EngineConfig, RerankParams, SamplingParams, StructuredOutputsParams
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.outputs import (CompletionOutput, EmbedOutput, RequestOutput, RerankOutput, RerankResult, StepOutput,
                            StepRecord, TokenDelta)
from engine.specs import EmbedSpec, GenerateSpec, JobSpec, RerankSpec

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RerankParams", "EmbedParams", "StructuredOutputsParams",
           "CompletionOutput", "RequestOutput", "RerankResult", "StepOutput", "TokenDelta", "RerankOutput", "EmbedOutput",
           "StepRecord", "JobSpec", "GenerateSpec", "RerankSpec", "EmbedSpec"]
