"""Tests for supervisor: fleet.yaml parsing and diff, the memory model, placement."""
