"""The PyTorch backend: CUDA, MPS and CPU."""
