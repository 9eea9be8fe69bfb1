"""Serving sharegpu's HTTP apps: sockets, TLS and a cap on request bodies."""
