"""The DRA driver: ResourceSlices, the kubelet DRA plugin and claim preparation (Kubernetes >= 1.34)."""
