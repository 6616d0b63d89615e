"""Model configuration: the config, the family records, layer kinds and sharding axes."""
