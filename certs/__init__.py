"""kube-vgpu webhook certificates: :mod:`certs.pki` (CA + serving cert), :mod:`certs.store`
(Secret, files, caBundle), :mod:`certs.main` (the ``kube-vgpu certs`` command)."""
