"""``sharegpu bench``: dedicated GPU, time-slicing, MPS without and with limits, and MIG, measured on this node.

The seed study's shape (light inference, heavy compute, parallel batch jobs, a memory-hungry job) run by separate
client processes against one GPU or MIG instance; MPS through the node agent's own MpsManager and client
environment. Importing this package is cheap: CuPy, NVML, matplotlib and Kubernetes are imported only where used.
"""
