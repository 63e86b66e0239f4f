"""Backends: one interface, one file per framework."""
