"""The gRPC service: server, engine-thread bridge, admission, CLI. Imports the engine lazily (serve only)."""
