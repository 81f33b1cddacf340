"""Generated gRPC stubs for tandem.v1 (from proto/tandem.proto; regenerate, never edit by hand)."""
