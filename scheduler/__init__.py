"""kube-vgpu scheduler: the kube-scheduler HTTP extender and the `simulate` replay."""
