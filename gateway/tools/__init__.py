"""Tools beside the gateway, never on its request path: the emulated upstream and ``tiergate bench``."""
