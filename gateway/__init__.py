"""Tiergate: an OpenAI-compatible gateway that routes each request to a fast or a standard tier."""

__version__ = "0.1.0"
