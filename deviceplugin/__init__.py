"""kube-vgpu kubelet device plugin (``kube-vgpu device-plugin``): advertises vGPU slots, publishes the
node inventory and answers kubelet's Allocate with the shim's env contract. See docs/device-plugin.md."""
