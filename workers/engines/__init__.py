"""Engines: one module per inference library, imported lazily through registry.py."""
