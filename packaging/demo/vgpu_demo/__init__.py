"""The k8s-vgpu demo (`make demo`) and the scenario the end-to-end test runs (tests/e2e)."""
