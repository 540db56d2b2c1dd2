"""The node core: what both kubelet front ends (device plugin, DRA plugin) share."""
