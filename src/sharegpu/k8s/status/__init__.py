"""What the control plane shows: ``sharegpu status`` (table, JSON, live page) and the nodes' bench notes."""
