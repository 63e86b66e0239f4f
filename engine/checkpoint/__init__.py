"""Hugging Face checkpoints: the maker for tests and demos, and the range-only reader."""
