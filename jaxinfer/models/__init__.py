"""The model: config, forward, attention dispatch, params, KV pool layout, sharding."""
