"""Score plugins and GPU selectors, one family per module: the FGD paper's baselines, FGD itself, and sharegpu's
refinement of it. A policy (placement.policies) is a named set of them with weights."""
