"""vgpuctl: the operator's tool (status, doctor, cluster, slice)."""
