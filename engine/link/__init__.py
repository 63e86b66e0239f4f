"""The stage link: framing, hello, v0 messages (sans-IO) and the socket transport."""
