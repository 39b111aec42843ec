"""The host: hook specs, registry, meshes, sharding rules and the trainer."""
