"""The MLX backend: Metal, CUDA and the CPU."""
