"""What a server listens on and allows: `ServerConfig`, shared by the gRPC server, the HTTP door and `tandem serve`."""
from __future__ import annotations

from dataclasses import dataclass, field

from service.core import DEFAULT_MAX_BUFFER_BYTES, Limits, Names
from service.tool_calls import ToolParser, ToolSettings


@dataclass(slots=True)
class ServerConfig:
    """What a server listens on and allows. `tandem serve` sets every field but stop_grace_s from its flags
    (service/cli.py; each flag also reads TANDEM_<FLAG>); a flag left unset keeps the default here."""
    host: str = "127.0.0.1"
    port: int = 50051  # 0: an ephemeral port (TandemServer.address tells which)
    max_message_bytes: int = 4 * 2**20
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight work may take before it is aborted
    # SIGTERM: health (gRPC and /healthz) says NOT_SERVING this long before new work is refused, so load
    # balancers stop routing first (set it to the balancer's health-check interval times its fall count).
    drain_grace_s: float = 0.0
    stop_grace_s: float = 1.0  # after draining: new work refused this long, then streams get as long to close
    tls_cert: str | None = None  # PEM paths; both or neither
    tls_key: str | None = None
    auth_token: str | None = None
    replica: str | None = None  # default: host:port
    # Responses one stream may hold unread before it fails with RESOURCE_EXHAUSTED (service/session.py).
    max_stream_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES
    tls_client_ca: str | None = None  # PEM CA bundle: mutual TLS
    # Tokens limited to some methods (e.g. a retrieval pipeline's: Rerank, RerankStream); other methods get
    # PERMISSION_DENIED. `auth_token` may call everything.
    auth_scoped_tokens: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # HTTP/2 keepalive: ping a connection idle this long, close it when the ping is not answered in time
    # (a peer that vanished without a FIN: its streams are cancelled and their KV blocks freed).
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    # Close connections idle (no open call) this long; recycle connections after this age (lets a load
    # balancer rebalance long-lived clients; in-flight calls get drain_timeout_s to finish). None: never.
    max_connection_idle_s: float | None = None
    max_connection_age_s: float | None = None
    # Concurrent calls one connection may open (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); None: grpc's default.
    max_concurrent_streams: int | None = None
    # The HTTP door (service/http/) on the same host, started by `tandem serve` (service/serve.py): None off, 0 an
    # ephemeral port (on the command line, --http-port 0 means off). It shares TLS, bearer tokens,
    # max_message_bytes (its body limit) and max_stream_buffer_bytes with gRPC (and the engine's document and input
    # counts, --max-documents and --max-embed-inputs, which EngineConfig holds).
    http_port: int | None = 8000
    # Host headers the HTTP door answers besides the loopback names (service/http/hosts.py, --allowed-hosts): bound to
    # loopback, only those; bound elsewhere, any host unless this lists some; "*": any.
    allowed_hosts: tuple[str, ...] = ()
    # What a request's `model` may say (service/core.py Names): --served-model-name, --strict-model-names.
    served_model_names: tuple[str, ...] = ()
    strict_model_names: bool = False
    # Tool calling (service/tool_calls.py), vLLM's flags. The format (hermes | llama3_json | mistral) is read from the
    # chat template (else the model's family) when not given; "auto" works wherever it is known, the switch is
    # accepted for vLLM's command lines (and refused at start-up where no format is known).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        self.tool_settings()  # a bad parser name is refused here
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("mutual TLS (--tls-client-ca) needs the server's own --tls-cert and --tls-key")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_stream_buffer_bytes < 1024:
            raise ValueError(f"max_stream_buffer_bytes must be >= 1024, got {self.max_stream_buffer_bytes}")
        if self.drain_grace_s < 0 or self.keepalive_time_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("drain_grace_s must be >= 0, keepalive_time_s and keepalive_timeout_s > 0")
        for name in ("max_connection_idle_s", "max_connection_age_s", "max_concurrent_streams"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535] or None, got {self.http_port}")
        if any(not name or name != name.strip() for name in self.served_model_names):
            raise ValueError(f"served model names must be non-empty, without surrounding spaces: "
                             f"{list(self.served_model_names)}")
        for p in self.allowed_hosts:  # patterns as service/http/hosts.py reads them
            if "*" in p[1:] or (p.startswith("*") and p != "*" and not p.startswith("*.")) or "/" in p or " " in p:
                raise ValueError(f"--allowed-hosts: {p!r} is not a host name, an address, '*.domain' or '*'")
        for token, methods in self.auth_scoped_tokens.items():
            if not token or not methods:
                raise ValueError("each scoped auth token needs a non-empty token and at least one method")

    def tool_settings(self) -> ToolSettings:
        parsers = [p.value for p in ToolParser]
        if self.tool_call_parser is not None and self.tool_call_parser not in parsers:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(parsers)}, got {self.tool_call_parser!r}")
        return ToolSettings(auto=self.enable_auto_tool_choice,
                            parser=ToolParser(self.tool_call_parser) if self.tool_call_parser else None)

    def names(self) -> Names:
        return Names(served=tuple(self.served_model_names), strict=self.strict_model_names)

    def limits(self) -> Limits:
        """What one request may ask for, through either door."""
        return Limits(max_message_bytes=self.max_message_bytes,
                      max_stream_buffer_bytes=self.max_stream_buffer_bytes)

    def grpc_options(self) -> list[tuple[str, int]]:
        ms = lambda seconds: int(seconds * 1000)  # noqa: E731
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.so_reuseport", 0),
                   ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
                   ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
                   # clients may keep idle connections alive with pings of their own, one per 10 s at most
                   ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.min_ping_interval_without_data_ms", 10_000)]
        if self.max_connection_idle_s is not None:
            options.append(("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)))
        if self.max_connection_age_s is not None:
            options += [("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
                        ("grpc.max_connection_age_grace_ms", ms(self.drain_timeout_s))]
        if self.max_concurrent_streams is not None:
            options.append(("grpc.max_concurrent_streams", self.max_concurrent_streams))
        return options
