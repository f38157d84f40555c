"""kube-vgpu scheduler: the kube-scheduler HTTP extender (the trace replay lives in ``replay``)."""
