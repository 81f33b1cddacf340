"""The synchronous engine: scheduler, paged KV cache, model runner, sampling. No gRPC here."""
from engine.config import EngineConfig, RerankParams, SamplingParams
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.outputs import RequestOutput, RerankResult, StepOutput, StepRecord

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RerankParams",
           "RequestOutput", "RerankResult", "StepOutput", "StepRecord"]
