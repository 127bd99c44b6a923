"""Model store: names, Modelfiles, manifests and blobs, and the embedded default model."""
