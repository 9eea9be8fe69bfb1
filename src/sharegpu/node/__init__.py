"""The node agent: GPU backends, device plugin, MIG and MPS managers, metrics and the loop that ties them."""
