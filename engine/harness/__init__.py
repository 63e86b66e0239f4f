"""Test and benchmark harnesses: engines on loopback, rounds driven by hand, golden link bytes.

Nothing in a served engine imports this package; tests, benchmarks, the demo and the
fixtures' regeneration do.
"""
