"""rankwise: reference implementations of 2026 low-rank methods for neural networks."""

__version__ = "0.1.0"
