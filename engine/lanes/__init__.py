"""Rank 0's lane host: tokens, admission, rounds and sampling."""
