"""Wire adapters: one package per protocol, the field readers they share, the reasoning codec."""
