"""kube-vgpu's offline trace replay (``kube-vgpu replay``, alias ``kube-vgpu simulate``).

Replays a whole workload (the Alibaba GPU-sharing trace, or a built-in synthetic one) on a model
cluster under each placement policy, FGD-artifact style, and reports GPU allocation. It runs the
same placement engine as the extender (:mod:`kube_vgpu.placement`) but talks to no cluster. For a
what-if on a *live* cluster ("where would this pod go?") see ``kubectl vgpu what-if``
(:mod:`kubectl_vgpu.simulate`).
"""
