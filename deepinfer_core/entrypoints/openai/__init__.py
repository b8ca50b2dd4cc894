"""The OpenAI-compatible server (``deepinfer serve``): protocol, handlers, metrics and the app."""
