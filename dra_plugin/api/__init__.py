"""Generated kubelet API modules of the DRA plugin (pluginregistration v1, DRA v1).

Regenerate with dra_plugin/api/gen.sh; the .proto files are the project's own, with the
public API's package names and field numbers.
"""
