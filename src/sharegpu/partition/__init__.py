"""MIG layout planning: where on a GPU a new instance should go."""
