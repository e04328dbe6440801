"""llamamesh: the core shared by the gRPC gateway (services/) and the workers (workers/)."""

__version__ = "0.1.0"
