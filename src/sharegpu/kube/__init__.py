"""The Kubernetes client layer shared by the control plane (:mod:`sharegpu.k8s`) and the node (:mod:`sharegpu.node`).

- :mod:`~sharegpu.kube.errors`: one exception hierarchy and the one translation of lightkube's and httpx's errors;
- :mod:`~sharegpu.kube.kubeconfig`, :mod:`~sharegpu.kube.exec_auth`, :mod:`~sharegpu.kube.transport`: credentials
  and the wire (lightkube's requests carried by aiohttp);
- :mod:`~sharegpu.kube.client`: the requests every component makes, as plain JSON, errors translated;
- :mod:`~sharegpu.kube.api`: the control plane's interface to the cluster, :mod:`~sharegpu.kube.lease` the Lease API;
- :mod:`~sharegpu.kube.schema`: the pydantic shapes of the objects read; :mod:`~sharegpu.kube.quantity` their
  quantities;
- :mod:`~sharegpu.kube.informer`: list-then-watch, the one loop every follower of the API server runs.
"""
