"""The kubelet device plugin API (v1beta1): the .proto and the Python modules generated from it (committed)."""
