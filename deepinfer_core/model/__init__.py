"""What every architecture shares: typed weight records, checkpoint manifests and the safetensors loader
they drive, the paged cache and its layout, per-step batch metadata. Architectures live in
:mod:`deepinfer_core.models`."""
