"""Sharding: FSDP2 ranks as Ray actors, the sharded policy they train."""
