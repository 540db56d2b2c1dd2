"""Simulators of real programs: the GPU driver and NVML, the NVIDIA container toolkit, and the Kubernetes
components (kubelet, API server, kube-scheduler) the demo and the tests run against."""
