"""Engines: each inference library's adapter modules (named after it: ``vllm*.py``, ``trtllm*.py``,
``transformers*.py``), described once and imported lazily through registry.py."""
