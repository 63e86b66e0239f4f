"""Tests for engine.link: framing, hello, v0 messages, layout checks, transport, golden bytes."""
