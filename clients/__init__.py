"""Python clients for tandem (grpcio + the proto stubs only; never torch)."""
from clients.aio import AsyncClient
from clients.sync import Client
from clients.types import Completion, Delta, RerankResult, RerankResults, TandemError, Usage

__all__ = ["AsyncClient", "Client", "Completion", "Delta", "RerankResult", "RerankResults", "TandemError", "Usage"]
