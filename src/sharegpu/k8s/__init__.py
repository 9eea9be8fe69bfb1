"""The Kubernetes control plane: scheduler extender, admission webhook, cluster view, binder and status."""
