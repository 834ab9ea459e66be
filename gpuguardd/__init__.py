"""gpuguard: find and safely end processes that keep NVIDIA GPUs busy after their unit stopped."""

__version__ = "0.1.0"
