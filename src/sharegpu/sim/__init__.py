"""The simulator: replays cluster traces through the same core (placement, ledger) as the control plane."""
