"""trainwatch: observability and reliability sidecars for distributed PyTorch training."""

__version__ = "0.1.0"
