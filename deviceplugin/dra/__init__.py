"""The kubelet DRA plugin of the kube-vgpu DRA driver (``kube-vgpu dra-plugin``; docs/dra-node.md)."""
