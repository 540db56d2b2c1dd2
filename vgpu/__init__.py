"""k8s-vgpu shared core: configuration, host paths, schemas, region access.

Imported by the runtime hook, the device plugin and the monitor; never the
other way round.  Keep module-level imports light: the hook's no-token path
imports this package before deciding to exit.
"""

__version__ = "0.1.0"
