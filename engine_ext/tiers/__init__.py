"""Secondary offload tiers behind one protocol (`engine_ext.tiers.store.ObjectStore`)."""
