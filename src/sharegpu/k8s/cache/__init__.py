"""The cluster cache: the API server's objects followed by one informer, the ledgers derived from them, and the
assume cache of placements this process made that the API server does not show yet."""
