"""kube-vgpu mutating admission webhook: :mod:`webhook.mutate` (rules), :mod:`webhook.admission`
(AdmissionReview envelope), :mod:`webhook.server` (HTTPS service), :mod:`webhook.tlsreload`."""
