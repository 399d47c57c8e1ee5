"""Client for polyak, the network-served EMA service for PyTorch training."""

__version__ = "0.1.0"
