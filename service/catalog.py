"""What this replica serves: the engine's model info and the model names requests may give (both doors read it)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import grpc

from service.bridge import EngineBridge
from service.errors import ServiceError


@dataclass(slots=True)
class Catalog:
    info: dict = field(default_factory=dict)  # engine.model_info() plus vocab_size
    served_names: set[str] = field(default_factory=lambda: {""})  # "" (the default) included

    @classmethod
    async def load(cls, bridge: EngineBridge) -> "Catalog":
        info = await bridge.call(_model_info)
        names = {"", info["model"], os.path.basename(str(info.get("model_dir", "")))} - {None}
        return cls(info=info, served_names=names)

    @property
    def names(self) -> list[str]:
        """The non-empty served names, sorted (ModelInfo.served_names, HTTP /v1/models)."""
        return sorted(n for n in self.served_names if n)

    def check_model(self, model: str) -> None:
        if model not in self.served_names:
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"model {model!r} is not served by this replica; it serves {self.names} "
                               "(leave model empty for the default)")


def _model_info(engine) -> dict:
    """engine.model_info() plus the vocabulary size clients need for token ids and logit_bias."""
    return {**engine.model_info(), "vocab_size": engine.model_args.vocab_size}
