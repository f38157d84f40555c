"""kubelet's device plugin API (``v1beta1``, api.proto) and PodResources API (``v1``, podresources.proto):
the generated stubs (``*_pb2*.py``, written by generate.sh) and the device plugin API's constants
(upstream: ``k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/constants.go``)."""

#: the API version a device plugin registers with
API_VERSION = "v1beta1"
#: kubelet's registration socket, in the device plugin directory
KUBELET_SOCKET = "kubelet.sock"
#: a device's health in ListAndWatch
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
